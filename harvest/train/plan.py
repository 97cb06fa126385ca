"""Checking a job before anything starts: what it will train on, for how long, and where.

`ready_job` decides everything the build refuses before the model loads: the device, what
a tensor-parallel or fleet trainer cannot run, LlamaFactory's tokenizer, the template
against the model's vocabulary, the datasets (loaded and preprocessed, so an empty or
broken data file is named here), the model's split over tensor-parallel ranks, the step
count and the checkpoint a run would resume from (against the job's fingerprint).
`check_job` (``harvest train --check``, ``harvest launch``, the plugin's pre-flight,
``harvest ctl submit``) and `build_trainer` both call it, so what the check accepted is
what the build accepts, on the same prepared data. Value checks of single keys are
`load_job`'s, which every caller runs first. What only the loaded model can tell (LoRA
targets, computed buffers, the memory budget, the architecture) the build checks after it.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import math
import sys
from pathlib import Path
from typing import Any

from harvest.train.errors import CheckpointError, JobError
from harvest.train.job import HARVEST_SECTION, TrainJob, check_fleet_job, import_llamafactory, job_identity
from harvest.train.llamafactory_env import LOADING_LOCK


@dataclasses.dataclass
class PreparedData:
    """What LlamaFactory's data side gives a job: tokenizer module, template, datasets."""

    tokenizer_module: dict[str, Any]
    template: Any
    train_dataset: Any
    eval_dataset: Any  # a dataset, a dict of them (eval_on_each_dataset), or None


@dataclasses.dataclass(frozen=True)
class JobPlan:
    """What a job will do, as `harvest train --check` prints it."""

    source: str
    model_path: str
    model_type: str
    vocab_size: int
    template: str
    datasets: tuple[str, ...]
    num_train_samples: int
    num_eval_samples: int
    samples_per_step: int
    steps_per_epoch: int
    total_steps: int
    output_dir: str
    start: str  # "fresh", or "resumes from <checkpoint> at step N"
    notes: tuple[str, ...]

    def lines(self) -> list[str]:
        epochs = self.total_steps / self.steps_per_epoch
        lines = [
            f"job         {self.source}",
            f"model       {self.model_path} ({self.model_type}, vocabulary {self.vocab_size})",
            f"template    {self.template}",
            f"datasets    {', '.join(self.datasets)}: {self.num_train_samples} training samples"
            + (f", {self.num_eval_samples} evaluation samples" if self.num_eval_samples else ""),
            f"steps       {self.total_steps} optimizer steps of {self.samples_per_step} samples "
            f"({self.steps_per_epoch} per epoch, {epochs:.2f} epochs)",
            f"output_dir  {self.output_dir}",
            f"start       {self.start}",
        ]
        return lines + [f"note        {note}" for note in self.notes]


@contextlib.contextmanager
def _naming_the_job_file(job: TrainJob):
    """A `JobError` or `CheckpointError` from a job read from a file starts with the file,
    as load_job's do (one that names a job file already is left as it is)."""
    try:
        yield
    except (JobError, CheckpointError) as exc:
        if job.source == "<dict>" or str(exc).startswith("job file "):
            raise
        raise type(exc)(f"job file {job.source!r}: {exc}") from None


def _prepare_data(job: TrainJob) -> PreparedData:
    """Tokenizer, template and preprocessed datasets, through LlamaFactory, as
    ``llamafactory-cli train`` prepares them; `JobError` naming the key on any problem."""
    with LOADING_LOCK:  # LlamaFactory's loaders and HF datasets' caches: one job at a time
        return _load_data(job)


def _load_data(job: TrainJob) -> PreparedData:
    import copy

    import_llamafactory()
    from llamafactory.data import get_dataset, get_template_and_fix_tokenizer
    from llamafactory.model import load_tokenizer

    model_args = copy.copy(job.model_args)
    model_args.device_map = {"": "cpu"}
    try:
        tokenizer_module = load_tokenizer(model_args)
    except (OSError, ValueError) as exc:
        raise JobError(f"model_name_or_path: LlamaFactory could not load the tokenizer of "
                       f"{job.model_args.model_name_or_path!r}: {exc}") from None
    tokenizer = tokenizer_module["tokenizer"]
    size_before = len(tokenizer)
    try:
        template = get_template_and_fix_tokenizer(tokenizer, job.data_args)
    except ValueError as exc:
        raise JobError(f"template: {job.data_args.template!r} does not work with this tokenizer: {exc}") from None
    _check_vocabulary(job, tokenizer, size_before)
    try:
        # LlamaFactory prints a training example with print(): onto stderr with the logs
        # (stdout carries harvest train --check's plan).
        with contextlib.redirect_stdout(sys.stderr):
            dataset_module = get_dataset(template, model_args, job.data_args, job.training_args, stage="sft",
                                         **tokenizer_module)
    except Exception as exc:  # datasets raises many types (DatasetGenerationError, ArrowInvalid, ...)
        raise JobError(f"dataset: {job.data_args.dataset} could not be loaded from {_data_files(job)}: "
                       f"{type(exc).__name__}: {_first_line(exc)}") from None
    train = dataset_module.get("train_dataset")
    if train is None or len(train) == 0:
        raise JobError(f"dataset: {job.data_args.dataset} gives no training samples (from {_data_files(job)}; "
                       f"check the data file, max_samples and cutoff_len: {job.data_args.cutoff_len})")
    return PreparedData(tokenizer_module, template, train, dataset_module.get("eval_dataset"))


def check_job(job: TrainJob, *, tp_size: int = 1) -> JobPlan:
    """What ``harvest train --check`` prints: `ready_job`'s plan. Writes nothing."""
    return ready_job(job, tp_size=tp_size)[0]


def ready_job(job: TrainJob, *, tp_size: int = 1, resume: bool = True) -> tuple[JobPlan, PreparedData]:
    """Everything the build refuses before it loads the model, decided once: `JobError` or
    `CheckpointError` naming the job file and the key or checkpoint. ``tp_size``: the
    tensor-parallel ranks that will train it; ``resume``: False when the build will not
    resume (then no checkpoint is read). Loads no weights and writes nothing."""
    with _naming_the_job_file(job):
        return _ready_job(job, tp_size, resume)


def _ready_job(job: TrainJob, tp_size: int, resume: bool) -> tuple[JobPlan, PreparedData]:
    check_device(job.harvest.device)
    if tp_size > 1:
        check_tensor_parallel_job(job)
    fleet = job.harvest.fleet
    if fleet.enabled:
        check_fleet_job(job, tp_size)  # before the data: what a fleet member cannot run, by key
        if not fleet.job_id:
            job_identity_name(job)  # the fleet's id for the job: its name, or its file's
    data = _prepare_data(job)
    config = _model_config(job)
    if tp_size > 1:
        from harvest.train.tensor_parallel import check_shardable

        check_shardable(config, tp_size)
    steps_per_epoch = math.ceil(len(data.train_dataset) / job.samples_per_step)
    args = job.training_args
    total_steps = args.max_steps if args.max_steps > 0 else math.ceil(args.num_train_epochs * steps_per_epoch)
    eval_set = data.eval_dataset
    num_eval = (sum(len(d) for d in eval_set.values()) if isinstance(eval_set, dict)
                else len(eval_set) if eval_set is not None else 0)
    plan = JobPlan(
        source=job.source, model_path=str(job.model_args.model_name_or_path),
        model_type=str(getattr(config, "model_type", "?")), vocab_size=int(getattr(config, "vocab_size", 0)),
        template=str(job.data_args.template), datasets=tuple(job.data_args.dataset or ()),
        num_train_samples=len(data.train_dataset), num_eval_samples=num_eval, samples_per_step=job.samples_per_step,
        steps_per_epoch=steps_per_epoch, total_steps=total_steps, output_dir=str(job.output_dir),
        start=_start(job, total_steps, resume), notes=job.notes)
    return plan, data


def _start(job: TrainJob, total_steps: int, resume: bool) -> str:
    from harvest.train.checkpoint import check_resumable, list_checkpoints

    if job.training_args.overwrite_output_dir:
        stale = list_checkpoints(job.output_dir)
        return "fresh (overwrite_output_dir: true" + (
            f"; removes {len(stale)} checkpoint(s) of an earlier run: {', '.join(p.name for p in stale)})"
            if stale else ")")
    checkpoint = job.training_args.resume_from_checkpoint
    if not checkpoint or not resume:
        return "fresh"
    # What the trainer's resume_from decides again once the model is loaded (same function).
    state = check_resumable(Path(checkpoint), total_steps=total_steps, fingerprint=job.fingerprint())
    return f"resumes from {checkpoint} at step {int(state['global_step'])}"


def _check_vocabulary(job: TrainJob, tokenizer, size_before: int) -> None:
    """A template that adds tokens the model's embedding lacks (or makes one of them its
    end-of-sequence or padding token) fails at the first step with an IndexError;
    LlamaFactory only warns ("make sure resize_vocab is True")."""
    if job.model_args.resize_vocab:
        return
    vocab_size = int(getattr(_model_config(job), "vocab_size", 0) or 0)
    if not vocab_size:
        return
    used = {tokenizer.convert_ids_to_tokens(index) for index in range(max(size_before, vocab_size), len(tokenizer))}
    for token_id in (tokenizer.eos_token_id, tokenizer.pad_token_id):
        if token_id is not None and token_id >= vocab_size:
            used.add(tokenizer.convert_ids_to_tokens(token_id))
    if used:
        raise JobError(f"template: {job.data_args.template!r} needs tokens the model's vocabulary lacks "
                       f"({', '.join(sorted(used)[:5])}; vocab_size {vocab_size}): use the template made for this "
                       "model, or set resize_vocab: true to grow the embeddings")


def _model_config(job: TrainJob):
    from transformers import AutoConfig

    try:
        return AutoConfig.from_pretrained(job.model_args.model_name_or_path,
                                          trust_remote_code=job.model_args.trust_remote_code)
    except (OSError, ValueError) as exc:
        raise JobError(f"model_name_or_path: {job.model_args.model_name_or_path!r} has no readable config.json: "
                       f"{exc}") from None


def _data_files(job: TrainJob) -> str:
    """The files behind the job's datasets, for messages."""
    dataset_dir = Path(job.data_args.dataset_dir)
    try:
        info = json.loads((dataset_dir / "dataset_info.json").read_text())
    except (OSError, json.JSONDecodeError):
        return repr(str(dataset_dir))
    files = [str(dataset_dir / info[name]["file_name"]) for name in job.data_args.dataset or ()
             if name in info and info[name].get("file_name")]
    return ", ".join(repr(f) for f in files) or repr(str(dataset_dir))


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip() or repr(exc)
    cause = exc.__cause__ or exc.__context__
    if cause is not None and str(cause).strip():  # datasets wraps the parser's own message
        text = f"{text.splitlines()[0]} ({str(cause).strip().splitlines()[0]})"
    return text.splitlines()[0]


def check_device(name: str) -> None:
    """`JobError` (harvest.device) for a device this machine lacks. Starts no CUDA context
    (is_available and device_count ask NVML), so a check may call it before a server forks."""
    import torch

    device = torch.device("cpu" if name == "auto" else name)
    if device.type != "cuda":
        return
    if not torch.cuda.is_available():
        raise JobError(f"{HARVEST_SECTION}.device: {name!r} requested but CUDA is not available here")
    count = torch.cuda.device_count()
    if device.index is not None and device.index >= count:
        raise JobError(f"{HARVEST_SECTION}.device: {name!r} requested but this process sees {count} CUDA "
                       f"device(s) (cuda:0 to cuda:{count - 1}; CUDA_VISIBLE_DEVICES renumbers them)")


def job_identity_name(job: TrainJob) -> str:
    if job.harvest.name:
        return job.harvest.name
    if job.source.endswith((".yaml", ".yml")):
        return job_identity(job.source).name
    raise JobError("harvest.fleet.job_id: a job that is not read from a file needs a job_id (or harvest.name)")


def check_tensor_parallel_job(job: TrainJob) -> None:
    """JobError for what a tensor-parallel trainer cannot run the way a tp = 1 one does."""
    from harvest.train.tensor_parallel import ELEMENTWISE_OPTIMIZERS

    args, finetuning = job.training_args, job.finetuning_args
    optim = str(getattr(args.optim, "value", args.optim))
    if optim not in ELEMENTWISE_OPTIMIZERS:
        raise JobError(f"optim: {optim!r} does not update a shard as it would the whole tensor; with tensor "
                       f"parallelism use one of {', '.join(ELEMENTWISE_OPTIMIZERS)}")
    for key in ("use_muon", "use_adam_mini", "use_galore", "use_apollo", "use_badam", "use_dora"):
        if getattr(finetuning, key, False):
            raise JobError(f"{key}: not supported with tensor parallelism (it needs whole weight matrices)")
