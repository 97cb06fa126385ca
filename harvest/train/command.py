"""`harvest train job.yaml`: run a finetune job standalone (no serving), with a progress bar.

The job is a LlamaFactory training YAML plus an optional `harvest:` section (see
`harvest.train.job`). An output_dir that already holds checkpoint-N directories is resumed
from the newest one, as LlamaFactory does (``overwrite_output_dir: true`` starts over).
Ctrl-C (or SIGTERM) stops at the next unit boundary after writing a checkpoint.
"""

from __future__ import annotations

import signal
import sys
from pathlib import Path

HELP = "run a LoRA finetune job (LlamaFactory YAML + harvest: section) standalone with the layer-split trainer"


def add_arguments(parser) -> None:
    parser.add_argument("job", type=Path,
                        help="job YAML: LlamaFactory training keys plus an optional 'harvest:' mapping")
    parser.add_argument("--check", action="store_true",
                        help="check the job and print its plan (model, template, samples, steps, resume), then exit; "
                             "nothing is trained or written")
    parser.add_argument("--no-progress", action="store_true", help="print one line per step instead of a progress bar")
    from harvest.settings import argument
    from harvest.train.trainer_cpu import TrainerConfig

    parser.add_argument("--compile", **argument(TrainerConfig, "compile", yaml_path="trainer.compile"))


def run(args) -> int:
    from harvest.fleet.store import FleetError
    from harvest.train.build import build_trainer
    from harvest.train.errors import CheckpointError, JobError, TrainingDiverged
    from harvest.train.gate import Gate
    from harvest.train.job import load_job

    from harvest.train.plan import check_job

    try:
        job = load_job(args.job)
        if args.check:
            for line in check_job(job).lines():
                print(line)
            print(f"harvest train --check: {args.job} is ready to train")
            return 0
        trainer = build_trainer(job, compile_layers=args.compile)
    except (JobError, CheckpointError) as exc:
        print(f"harvest train: {exc}", file=sys.stderr)
        return 2
    gate = Gate()
    interrupted = []

    def stop(signum, _frame):
        interrupted.append(signum)
        gate.stop()

    previous = {sig: signal.signal(sig, stop) for sig in (signal.SIGINT, signal.SIGTERM)}
    progress = _progress(trainer, args.no_progress or job.training_args.disable_tqdm)
    trainer.step_callbacks.append(progress)
    try:
        outcome = trainer.run(gate)
    except TrainingDiverged as exc:  # the last good step is checkpointed
        print(f"harvest train: {job.source}: {exc}", file=sys.stderr)
        return 3
    except FleetError as exc:  # joining the fleet failed, or every_step lost a member
        print(f"harvest train: {job.source}: {exc}", file=sys.stderr)
        return 2
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
        progress.close()
        trainer.close()
    stats = trainer.stats()
    print(f"harvest train: {outcome} at step {stats.global_step}/{stats.total_steps}, loss {stats.loss}, "
          f"{stats.tokens_per_s:.0f} tokens/s, output in {job.output_dir}")
    return 130 if interrupted else 0


class _progress:
    def __init__(self, trainer, plain: bool):
        self.trainer = trainer
        self.bar = None
        if not plain:
            from tqdm import tqdm

            self.bar = tqdm(total=trainer.total_steps, initial=trainer.global_step, unit="step", dynamic_ncols=True)

    def __call__(self, entry: dict) -> None:
        stats = self.trainer.stats()
        fields = dict(loss=f"{entry['loss']:.4f}", tok_s=f"{stats.tokens_per_s:.0f}", W=stats.window_stages,
                      MiB=f"{stats.resident_bytes / 2**20:.1f}")
        if self.bar is None:
            print(f"step {entry['step']}/{self.trainer.total_steps} " + " ".join(f"{k}={v}" for k, v in fields.items()),
                  flush=True)
        else:
            self.bar.set_postfix(fields, refresh=False)
            self.bar.update(1)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
