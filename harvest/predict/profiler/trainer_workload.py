"""Co-run workload: harvest's own layer-split trainer running a job file (harvest.train).

The workload that will really run beside decode, unit by unit
(``LayerSplitTrainer.run_one_unit``: one stage of one micro-batch, forward or backward,
or the optimizer update), so its units interleave phases as in training: one phase,
``mixed``. The job is run in a scratch output directory with checkpoints off and no step
limit, so profiling neither writes into the job's own output nor ends the job midway.
"""

from __future__ import annotations

import tempfile
from pathlib import Path

from harvest.predict.profiler.corun import CoRunError, UnitLoopWorkload

_NEVER = 10**9


def load_finetune_job(job_path: str, device: str, output_dir: str):
    """The job of ``--finetune-job`` as the workload runs it: in ``output_dir``, checkpoints
    off, no step limit, on ``device``. Raises CoRunError naming the flag and the file;
    `harvest profile` calls it before it loads anything, the workload again to build."""
    import yaml

    from harvest.settings import yaml_problem

    try:
        from harvest.train.errors import JobError
        from harvest.train.job import HARVEST_SECTION, load_job
    except ImportError as exc:
        raise CoRunError(f"--finetune-job needs harvest's trainer (harvest.train): {exc}") from exc
    path = Path(job_path)
    try:
        raw = yaml.safe_load(path.read_text())
    except IsADirectoryError:
        raise CoRunError(f"--finetune-job {job_path}: is a folder, not a job file") from None
    except OSError as exc:
        raise CoRunError(f"--finetune-job {job_path}: cannot read it: {exc.strerror or exc}") from None
    except UnicodeDecodeError as exc:
        raise CoRunError(f"--finetune-job {job_path}: is not valid YAML: {exc}") from None
    except yaml.YAMLError as exc:
        raise CoRunError(f"--finetune-job {job_path}: is not valid YAML: {yaml_problem(exc)}") from None
    if not isinstance(raw, dict):
        raise CoRunError(f"--finetune-job {job_path}: expected a YAML mapping of job arguments")
    raw.update(output_dir=output_dir, overwrite_output_dir=True, save_steps=_NEVER, max_steps=_NEVER)
    raw.pop("num_train_epochs", None)
    section = raw.get(HARVEST_SECTION)
    raw[HARVEST_SECTION] = {**(section if isinstance(section, dict) else {}), "device": device}
    if section is not None and not isinstance(section, dict):
        raw[HARVEST_SECTION] = section  # load_job names the bad section
    try:
        return load_job(raw)
    except JobError as exc:
        raise CoRunError(f"--finetune-job {job_path}: {exc}") from None


class HarvestTrainerWorkload(UnitLoopWorkload):
    name = "harvest-trainer"
    phases = ("mixed",)

    def __init__(self, job_path: str, device: str):
        super().__init__()
        from harvest.train.build import build_trainer
        from harvest.train.errors import JobError

        self._scratch = tempfile.TemporaryDirectory(prefix="harvest-profile-trainer-")
        job = load_finetune_job(job_path, device, self._scratch.name)
        try:
            self.trainer = build_trainer(job, resume=False)
        except JobError as exc:
            raise CoRunError(f"--finetune-job {job_path}: {exc}") from exc
        args = job.llamafactory_args
        self.base_model = str(args["model_name_or_path"])
        self.description = (
            f"harvest layer-split trainer, job {job_path}: LoRA rank {args.get('lora_rank')} on {args.get('lora_target')}, "
            f"micro-batch {self.trainer.micro_batch_size}, cutoff {args.get('cutoff_len')}; units: one stage of one "
            f"micro-batch (forward or backward) or the optimizer update, in training order"
        )
        self._stream = None
        self._micro_batch_tokens = 0  # tokens of the micro-batches whose first stage ran forward
        self._micro_batches = 0  # how many those were

    @property
    def micro_batch_tokens(self) -> float | None:
        """Measured: non-padding tokens of the micro-batches started, per micro-batch."""
        return self._micro_batch_tokens / self._micro_batches if self._micro_batches else None

    @property
    def tokens_per_unit(self) -> float:
        """Measured: micro-batches started over units run (forward, backward and optimizer)."""
        if self.units_done == 0:
            raise CoRunError("tokens_per_unit: no unit has run yet")
        return self._micro_batch_tokens / self.units_done

    def start(self, phase: str, stream=None) -> None:
        self._stream = stream
        super().start(phase, stream)

    def run_unit(self, phase: str) -> None:
        record = self.trainer.run_one_unit(self._stream)
        if record is None:
            raise CoRunError("the finetune job finished during profiling")
        if record.kind.value == "forward" and record.stage == 0:
            self._micro_batch_tokens += record.num_tokens
            self._micro_batches += 1
        if self.trainer.device.type == "cuda":
            import torch

            torch.cuda.current_stream().synchronize()

    def close(self) -> None:
        trainer, self.trainer = getattr(self, "trainer", None), None
        if trainer is not None:
            trainer.close()
        self._scratch.cleanup()
