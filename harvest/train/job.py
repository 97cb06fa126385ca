"""Finetune job definitions: LlamaFactory's own argument vocabulary plus a `harvest:` section.

A job file is the YAML a user would give ``llamafactory-cli train``, with one extra
``harvest:`` mapping for the layer-split trainer. Everything is validated here, once,
before any model or data is loaded: a bad value raises `JobError` naming the field. Every
LlamaFactory key has a fate (`harvest.train.job_keys`): honoured, refused naming the key
and the reason, or accepted with a note (`TrainJob.notes`); LlamaFactory's own parser then
runs and its errors are re-raised as `JobError`. Relative paths resolve against the job
file's folder; ``model_name_or_path`` is never downloaded.

Keys, paths and an example: docs/jobs.md (the top, 'Paths', 'Every key').
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
import math
import os
import re
from pathlib import Path
from typing import Any, Mapping

from harvest.fleet.options import FleetOptions
from harvest.setting_kinds import NAME_EXPECTED, NAME_PATTERN
from harvest.output_paths import folder_problem
from harvest.settings import Integer, Number, SettingError, Text, from_mapping, section, setting, validate, yaml_problem
from harvest.train.errors import JobError
from harvest.train.llamafactory_env import LOADING_LOCK, import_llamafactory  # noqa: F401  (its home for most callers)

logger = logging.getLogger(__name__)
HARVEST_SECTION = "harvest"
# A job's name is a Prometheus label value, a URL path segment and an SGLang LoRA name.
JOB_NAME_PATTERN, JOB_NAME_EXPECTED = NAME_PATTERN, NAME_EXPECTED

# Keys harvest sets when the job does not: the layer-split trainer keeps one micro-batch
# pass of activations by design, so HF gradient checkpointing would only recompute work.
_LLAMAFACTORY_DEFAULTS = {
    "stage": "sft",
    "do_train": True,
    "finetuning_type": "lora",
    "disable_gradient_checkpointing": True,
    "report_to": "none",
}
# The largest learning_rate a job may set: LoRA finetunes train at 1e-5 to 1e-3 (SGD up to
# about 0.5); above 1.0 the first updates overflow the weights.
MAX_LEARNING_RATE = 1.0
# harvest.unit_target_ms: auto outside a decode server (harvest train, harvest profile's
# trainer): short enough to pause within, long enough that a GPU unit is not host-bound.
DEFAULT_UNIT_TARGET_MS = 10.0
# The Hugging Face Trainer's optimizers that are plain torch optimizers (one step() per
# optimizer step, no closure, no train/eval mode, no extra package): what the layer-split
# trainer's optimizer unit can drive.
SUPPORTED_OPTIMIZERS = ("adamw_torch", "adamw_torch_fused", "adafactor", "sgd", "adagrad", "rmsprop")
# Inside a decode server preprocessing runs on the trainer thread: datasets' worker
# processes would fork a process that holds the serving engine's CUDA context.
SERVER_PREPROCESSING_WORKERS = None
_PATH_KEYS = ("output_dir", "media_dir", "tokenized_path")


@dataclasses.dataclass(frozen=True)
class HarvestOptions:
    """The `harvest:` section of a job, validated (each option declared once, with
    :mod:`harvest.settings`)."""

    micro_batch_size: int | None = setting(None, "sequences per unit; auto: measured so a unit takes about "
                                           "unit_target_ms", Integer(minimum=1), words={"auto": None})
    unit_target_ms: float | None = setting(
        None, "target duration of one (stage, micro-batch, forward or backward) unit, in ms; auto: in a decode "
        "server trainer.unit_step_fraction of the decode step (qos.target_tpot_ms), timed on the trainer's smallest "
        f"partition; alone {DEFAULT_UNIT_TARGET_MS:g} ms", Number(minimum=0.0, exclusive_minimum=True),
        words={"auto": None})
    window_stages: int | None = setting(None, "frozen-weight window W in stages (embed, each layer, head); all: every "
                                        "stage resident", Integer(minimum=1), words={"all": None})
    memory_budget_mb: float | None = setting(None, "device memory the trainer may hold, in MiB (null: no limit)",
                                             Number(minimum=0.0, exclusive_minimum=True), nullable=True)
    microbatches_per_pass: int = setting(1, "micro-batches that share one pass over the layers", Integer(minimum=1))
    device: str = setting("auto", "the trainer's device (auto: cuda when available, else cpu)",
                          Text(r"auto|cpu|cuda|cuda:[0-9]+", "auto, cpu, cuda or cuda:N"))
    # Inside a decode server (harvest.yaml jobs, `harvest ctl submit`): how the job is
    # named, shares the trainer with the others, and is served when it finishes.
    name: str | None = setting(None, "the job's name in a server (status, metrics label job_name, harvest ctl); "
                               "null: the job file's name without .yaml", Text(JOB_NAME_PATTERN, JOB_NAME_EXPECTED),
                               nullable=True)
    weight: float = setting(1.0, "its share of the trainer's time beside the server's other jobs (fair share: "
                            "weights 1 and 3 get a quarter and three quarters)",
                            Number(minimum=0.0, exclusive_minimum=True))
    serve_as: str | None = setting(None, "when the job finishes, load its adapter into the same SGLang server under "
                                   "this LoRA name (the server needs --enable-lora); null: not served",
                                   Text(JOB_NAME_PATTERN, JOB_NAME_EXPECTED), nullable=True)
    # One job trained by many servers together (harvest.fleet; docs/fleet.md).
    fleet: FleetOptions = section(FleetOptions, "train this job together with other servers (rendezvous: null: alone)")

    def __post_init__(self) -> None:
        validate(self)

    @classmethod
    def from_mapping(cls, raw: Mapping[str, Any] | None) -> "HarvestOptions":
        try:
            return from_mapping(cls, raw, path=HARVEST_SECTION)
        except SettingError as error:
            raise JobError(str(error)) from None


@dataclasses.dataclass(frozen=True)
class TrainJob:
    """A validated job: the LlamaFactory arguments as given (plus harvest's defaults), the
    parsed LlamaFactory argument objects, and the harvest options."""

    llamafactory_args: Mapping[str, Any]
    harvest: HarvestOptions
    model_args: Any
    data_args: Any
    training_args: Any
    finetuning_args: Any
    source: str = "<dict>"
    notes: tuple[str, ...] = ()  # keys accepted without effect, and paths resolved: say them once

    @property
    def output_dir(self) -> Path:
        return Path(self.training_args.output_dir)

    @property
    def samples_per_step(self) -> int:
        return self.training_args.per_device_train_batch_size * self.training_args.gradient_accumulation_steps

    def fingerprint(self) -> dict[str, Any]:
        """The fields a checkpoint must agree on to be resumed by this job."""
        keys = ("model_name_or_path", "dataset", "template", "cutoff_len", "lora_rank", "lora_alpha",
                "lora_target", "lora_dropout", "per_device_train_batch_size", "gradient_accumulation_steps", "seed",
                "learning_rate", "lr_scheduler_type", "warmup_steps", "weight_decay", "disable_shuffling")
        return {key: _jsonable(self.llamafactory_args.get(key)) for key in keys}


def check_fleet_job(job: TrainJob, tp_size: int = 1) -> None:
    """JobError for what a fleet member cannot run (named with the key to change)."""
    args = job.training_args
    if tp_size > 1:
        raise JobError("harvest.fleet: a fleet job on a tensor-parallel server is not supported; train it on "
                       "tp = 1 servers")
    if str(getattr(args.eval_strategy, "value", args.eval_strategy)) != "no" or args.do_eval:
        raise JobError("eval_strategy: evaluation during a fleet job is not supported; evaluate the finished adapter")
    if args.overwrite_output_dir:
        raise JobError("overwrite_output_dir: a fleet's members share output_dir and resume from the fleet's "
                       "checkpoints; remove the directory yourself to start the fleet over")
    scheduler = str(getattr(args.lr_scheduler_type, "value", args.lr_scheduler_type))
    if job.harvest.fleet.sync == "periodic" and scheduler == "reduce_lr_on_plateau":
        raise JobError("lr_scheduler_type: reduce_lr_on_plateau depends on one process's evaluation history; a "
                       "periodic fleet sets each step's rate from its global step")


def load_job(source: str | os.PathLike | Mapping[str, Any], *, in_server: bool = False) -> TrainJob:
    """Read and validate a job from a YAML file or a mapping. Raises `JobError`; for a
    file, the message starts with the file (a server may run several). ``in_server``: the
    job runs inside a decode server (preprocessing workers are capped)."""
    if isinstance(source, Mapping):
        return _validated_job(dict(source), "<dict>", None, in_server)
    raw = _read_yaml(Path(source))  # its errors name the file already
    try:
        return _validated_job(raw, str(source), Path(source).resolve().parent, in_server)
    except JobError as exc:
        raise JobError(f"job file {str(source)!r}: {exc}") from None


@dataclasses.dataclass(frozen=True)
class JobIdentity:
    """What a server needs of a job file before building it: its name, fair-share weight,
    served adapter name and output folder (the YAML and the ``harvest:`` section only, no
    LlamaFactory: milliseconds, so a server can take a submission between decode steps)."""

    path: Path
    name: str
    weight: float
    serve_as: str | None
    output_dir: Path | None


def job_identity(path: str | os.PathLike) -> JobIdentity:
    """Raises `JobError` naming the file and the field."""
    path = Path(path).expanduser().resolve()
    raw = _read_yaml(path)
    try:
        options = HarvestOptions.from_mapping(raw.get(HARVEST_SECTION))
    except JobError as exc:
        raise JobError(f"job file {str(path)!r}: {exc}") from None
    output_dir = raw.get("output_dir")
    if isinstance(output_dir, str) and output_dir:
        output_dir = Path(output_dir).expanduser()
        output_dir = output_dir if output_dir.is_absolute() else path.parent / output_dir
    else:
        output_dir = None
    name = options.name or path.name.removesuffix(".yaml").removesuffix(".yml")
    if options.name is None and not re.fullmatch(JOB_NAME_PATTERN, name):
        raise JobError(f"job file {str(path)!r}: its file name {name!r} is not a job name ({JOB_NAME_EXPECTED}); "
                       f"name it in the job: harvest: {{name: ...}}")
    return JobIdentity(path, name, options.weight, options.serve_as, output_dir)


def _validated_job(raw: dict[str, Any], origin: str, job_dir: Path | None, in_server: bool) -> TrainJob:
    from harvest.train.job_keys import judge, llamafactory_argument_fields

    options = HarvestOptions.from_mapping(raw.pop(HARVEST_SECTION, None))
    given = _translate_warmup_ratio(raw)
    fields = llamafactory_argument_fields()
    unknown = sorted(set(given) - set(fields))
    if unknown:
        raise JobError(f"{unknown[0]}: not a LlamaFactory training argument "
                       f"(harvest's own keys go under '{HARVEST_SECTION}:')")
    refusals, notes = judge(given, fields)
    if refusals:
        raise JobError(refusals[0][1])
    lf_args = {**_LLAMAFACTORY_DEFAULTS, **given}
    notes += _resolve_paths(lf_args, job_dir)
    _check_llamafactory_args(lf_args)
    notes += _resolve_model(lf_args)
    if in_server and lf_args.get("preprocessing_num_workers") not in (None, SERVER_PREPROCESSING_WORKERS):
        notes.append(f"preprocessing_num_workers: {lf_args['preprocessing_num_workers']!r} is capped to none inside "
                     "a decode server (preprocessing runs on the trainer thread; worker processes would fork the "
                     "serving process)")
        lf_args["preprocessing_num_workers"] = SERVER_PREPROCESSING_WORKERS
    if lf_args.get("bf16") and _trains_on_cpu(options.device):
        # transformers refuses bf16 without a GPU unless told the run is on the CPU, where
        # the trainer autocasts to bf16 as it would on a GPU.
        lf_args.setdefault("use_cpu", True)
    parsed = _parse_with_llamafactory(lf_args)
    model_args, data_args, training_args, finetuning_args = parsed
    _check_parsed(model_args, data_args, training_args, finetuning_args)
    if (not data_args.ignore_pad_token_for_loss and options.micro_batch_size is not None
            and options.micro_batch_size != training_args.per_device_train_batch_size):
        notes.append(f"ignore_pad_token_for_loss: false with harvest.micro_batch_size {options.micro_batch_size} "
                     f"and per_device_train_batch_size {training_args.per_device_train_batch_size}: padding carries "
                     "loss and a micro-batch pads its samples to its longest, so the loss (and what is trained) "
                     "differs from llamafactory-cli train's; leave micro_batch_size out (auto) to match it")
    for note in notes:
        logger.info("job %s: %s", origin, note)
    return TrainJob(lf_args, options, model_args, data_args, training_args, finetuning_args, origin, tuple(notes))


def _trains_on_cpu(device: str) -> bool:
    if device == "cpu":
        return True
    if device == "auto":
        import torch

        return not torch.cuda.is_available()
    return False


def _check_parsed(model_args, data_args, training_args, finetuning_args) -> None:
    """Checks on values LlamaFactory has parsed (enums, derived fields)."""
    if training_args.fp16:
        raise JobError("fp16: not supported by the layer-split trainer (it has no loss scaling); use bf16 or fp32")
    optim = str(getattr(training_args.optim, "value", training_args.optim))
    custom = finetuning_args.loraplus_lr_ratio is not None or finetuning_args.use_muon or finetuning_args.use_adam_mini
    if optim not in SUPPORTED_OPTIMIZERS and not (custom and optim in ("adamw_torch", "adamw_torch_fused")):
        raise JobError(f"optim: {optim!r} is not supported by the layer-split trainer (use one of "
                       f"{', '.join(SUPPORTED_OPTIMIZERS)}, or LoRA+ / use_muon / use_adam_mini)")
    if finetuning_args.use_adam_mini:
        import importlib.util

        if importlib.util.find_spec("adam_mini") is None:
            raise JobError("use_adam_mini: the adam-mini package is not installed here (pip install adam-mini)")
    from harvest.train.train_log import check_reporters

    check_reporters(training_args.report_to)
    save_strategy = str(getattr(training_args.save_strategy, "value", training_args.save_strategy))
    if save_strategy not in ("steps", "no"):
        raise JobError(f"save_strategy: {save_strategy!r} is not supported; use steps (with save_steps) or no")
    if not training_args.do_train:
        raise JobError("do_train: false leaves nothing to do; a harvest job trains (do_train: true)")
    if model_args.disable_gradient_checkpointing is False:
        raise JobError("disable_gradient_checkpointing: false is not supported; the layer-split trainer keeps one "
                       "micro-batch pass of activations instead (lower harvest.micro_batch_size to use less memory)")


def _resolve_paths(args: dict[str, Any], job_dir: Path | None) -> list[str]:
    """Relative paths of a job file against its folder (``dataset_dir`` also against the
    working directory, as LlamaFactory resolves it). Returns notes saying what was taken."""
    notes = []
    if job_dir is None:
        return notes
    for key in _PATH_KEYS:
        value = args.get(key)
        if value and not Path(str(value)).expanduser().is_absolute():
            args[key] = str(job_dir / str(value))
            notes.append(f"{key}: {value!r} is relative: taken relative to the job file ({args[key]})")
    dataset_dir = str(args.get("dataset_dir", "data"))
    if not Path(dataset_dir).expanduser().is_absolute():
        beside_job, beside_cwd = job_dir / dataset_dir, Path.cwd() / dataset_dir
        if (beside_job / "dataset_info.json").is_file() or not (beside_cwd / "dataset_info.json").is_file():
            args["dataset_dir"] = str(beside_job)
            notes.append(f"dataset_dir: {dataset_dir!r} is relative: taken relative to the job file ({beside_job})")
        else:
            args["dataset_dir"] = str(beside_cwd)
            notes.append(f"dataset_dir: {dataset_dir!r} is relative and the job file's folder has none: taken "
                         f"relative to the working directory, as LlamaFactory does ({beside_cwd})")
    return notes


def _resolve_model(args: dict[str, Any]) -> list[str]:
    """A hub id in ``model_name_or_path`` becomes its snapshot in the local Hugging Face cache
    (nothing is downloaded: a serving process must not reach the hub)."""
    given = str(args["model_name_or_path"])
    local = Path(given).expanduser()
    if (local / "config.json").is_file():
        return []
    looked = [f"{str(local)!r} (a local directory)"]
    if _looks_like_hub_id(given):
        from huggingface_hub import constants, snapshot_download
        from huggingface_hub.errors import LocalEntryNotFoundError

        cache_dir = args.get("cache_dir") or constants.HF_HUB_CACHE
        looked.append(f"the Hugging Face cache {str(cache_dir)!r}")
        try:
            snapshot = snapshot_download(given, revision=args.get("model_revision") or None,
                                         cache_dir=args.get("cache_dir"), local_files_only=True)
        except (LocalEntryNotFoundError, OSError, ValueError):
            snapshot = None
        if snapshot is not None and (Path(snapshot) / "config.json").is_file():
            args["model_name_or_path"] = snapshot
            return [f"model_name_or_path: {given!r} found in the Hugging Face cache ({snapshot})"]
    raise JobError(f"model_name_or_path: {given!r} is not a local model directory (no config.json) and not in the "
                   f"local Hugging Face cache; looked in {' and '.join(looked)}. Download it first "
                   "(huggingface-cli download, or give the path of a downloaded checkpoint): harvest never "
                   "downloads from a serving process")


def _looks_like_hub_id(value: str) -> bool:
    parts = value.split("/")
    return len(parts) == 2 and all(parts) and not value.startswith((".", "~"))


def _translate_warmup_ratio(raw: dict[str, Any]) -> dict[str, Any]:
    """``warmup_ratio: r`` as ``warmup_steps: r``. transformers 5 dropped warmup_ratio from
    TrainingArguments (a ``warmup_steps`` below 1 is the fraction of the run now), so
    LlamaFactory's parser rejects the key its own examples still use."""
    if "warmup_ratio" not in raw:
        return raw
    ratio = _as_number(raw["warmup_ratio"])
    if ratio is None or not 0 <= ratio < 1:
        raise JobError(f"warmup_ratio: must be a number in [0, 1), got {raw['warmup_ratio']!r}")
    if _as_number(raw.get("warmup_steps", 0)):
        raise JobError("warmup_ratio and warmup_steps: give one of them (both set the warmup; "
                       f"warmup_steps: {raw['warmup_steps']!r}, warmup_ratio: {raw['warmup_ratio']!r})")
    translated = {key: value for key, value in raw.items() if key != "warmup_ratio"}
    translated["warmup_steps"] = ratio
    return translated


def _read_yaml(path: Path) -> dict[str, Any]:
    # Read the way `llamafactory-cli train job.yaml` does (OmegaConf), so values such as
    # ``1e-4`` are numbers as LlamaFactory users expect (plain YAML 1.1 makes it a string).
    import yaml
    from omegaconf import OmegaConf
    from omegaconf.errors import OmegaConfBaseException

    if not path.is_file():
        raise JobError(f"job file {str(path)!r} {'is not a file' if path.exists() else 'does not exist'}")
    try:
        data = OmegaConf.to_container(OmegaConf.load(path))
    except (OmegaConfBaseException, yaml.YAMLError, ValueError) as exc:
        raise JobError(f"job file {str(path)!r} is not valid YAML: {yaml_problem(exc)}") from None
    if not isinstance(data, dict):
        raise JobError(f"job file {str(path)!r} must be a mapping of LlamaFactory keys (plus 'harvest:')")
    return data


def _check_llamafactory_args(args: Mapping[str, Any]) -> None:
    """The checks LlamaFactory leaves to training time (or never makes), done up front."""
    for field in ("model_name_or_path", "dataset", "output_dir"):
        if not args.get(field):
            raise JobError(f"{field}: required (a job needs a base model, a dataset and an output_dir)")
    if args["stage"] != "sft":
        raise JobError(f"stage: {args['stage']!r} is not supported; the layer-split trainer runs stage: sft")
    if args["finetuning_type"] != "lora":
        raise JobError(f"finetuning_type: {args['finetuning_type']!r} is not supported; use finetuning_type: lora")
    _check_output_dir(str(args["output_dir"]))
    _check_datasets(str(args["dataset"]), str(args.get("dataset_dir", "data")))
    for field in ("cutoff_len", "per_device_train_batch_size", "gradient_accumulation_steps", "lora_rank"):
        if field in args and not (_is_int(args[field]) and args[field] > 0):
            raise JobError(f"{field}: must be an integer > 0, got {args[field]!r}")
    if "learning_rate" in args:
        _check_learning_rate(args["learning_rate"])
    max_steps = args.get("max_steps", -1)
    epochs = args.get("num_train_epochs", 3.0)
    if not _is_int(max_steps) or max_steps == 0 or max_steps < -1:
        raise JobError(f"max_steps: must be a positive integer (or -1 to use num_train_epochs), got {max_steps!r}")
    if max_steps == -1 and not (_as_number(epochs) or 0) > 0:
        raise JobError(f"num_train_epochs: must be > 0 when max_steps is not set, got {epochs!r}")
    if "save_steps" in args and not (_as_number(args["save_steps"]) or 0) > 0:
        raise JobError(f"save_steps: must be > 0 (a step count, or a fraction of the run), got {args['save_steps']!r}")
    strategy = str(args.get("eval_strategy", "no"))
    if (strategy != "no" or args.get("do_eval")) and not (_as_number(args.get("val_size", 0)) or args.get("eval_dataset")):
        raise JobError(f"eval_strategy: {strategy!r} (or do_eval) needs evaluation data: set val_size or eval_dataset")
    if str(args.get("lr_scheduler_type")) == "reduce_lr_on_plateau":
        raise JobError("lr_scheduler_type: reduce_lr_on_plateau needs an evaluation metric every step; "
                       "use a schedule (linear, cosine, ...)")
    template = args.get("template")
    if template is not None:
        import_llamafactory()
        from llamafactory.data.template import TEMPLATES

        if template not in TEMPLATES:
            close = sorted(name for name in TEMPLATES if name.startswith(str(template)[:3]))[:8]
            raise JobError(f"template: unknown LlamaFactory template {template!r}"
                           + (f" (similar: {', '.join(close)})" if close else ""))
        plugin = type(TEMPLATES[template].mm_plugin).__name__
        if plugin != "BasePlugin":
            raise JobError(f"template: {template!r} is a multimodal template ({plugin}); the layer-split trainer "
                           "trains text-only decoders")


def _check_learning_rate(value: Any) -> None:
    """A rate above MAX_LEARNING_RATE overflows the weights within a step or two (1e30 gave
    a non-finite loss at step 2, after the model had loaded): refused before anything runs."""
    rate = _as_number(value)
    if rate is not None and not math.isfinite(rate):
        raise JobError(f"learning_rate: must be a finite number, got {value!r}")
    if rate is None or not rate > 0:
        raise JobError(f"learning_rate: must be a number > 0, got {value!r}")
    if rate > MAX_LEARNING_RATE:
        raise JobError(f"learning_rate: {value!r} is above {MAX_LEARNING_RATE}, beyond any rate a LoRA finetune "
                       "trains at (LlamaFactory's examples use 1e-5 to 1e-4): the first updates would overflow the "
                       "weights; lower it")


def _check_output_dir(output_dir: str) -> None:
    """output_dir must be a writable folder, or creatable: LlamaFactory's parser lists it, and
    the first checkpoint would fail after a step has run."""
    problem = folder_problem(output_dir)
    if problem is not None:
        raise JobError(f"output_dir: {output_dir!r} {problem}")


def _check_datasets(names: str, dataset_dir: str) -> None:
    info_path = Path(dataset_dir).expanduser() / "dataset_info.json"
    if not info_path.is_file():
        raise JobError(f"dataset_dir: {dataset_dir!r} has no dataset_info.json (LlamaFactory's dataset registry)")
    try:
        info = json.loads(info_path.read_text())
    except json.JSONDecodeError as exc:
        raise JobError(f"dataset_dir: {str(info_path)!r} is not valid JSON: {exc}") from None
    for name in (n.strip() for n in names.split(",")):
        if name not in info:
            raise JobError(f"dataset: {name!r} is not defined in {str(info_path)!r} "
                           f"(defined: {', '.join(sorted(info)) or 'none'})")
        file_name = info[name].get("file_name")
        data_path = Path(dataset_dir).expanduser() / file_name if file_name else None
        if data_path is not None and not data_path.exists():
            raise JobError(f"dataset: {name!r} points to {file_name!r}, which does not exist in {dataset_dir!r}")
        if data_path is not None and data_path.is_file() and _holds_no_samples(data_path):
            raise JobError(f"dataset: {name!r} has no samples: {str(data_path)!r} is empty")


def _holds_no_samples(path: Path) -> bool:
    """An empty data file, or a JSON file that is an empty list (datasets then reports
    'Instruction "train" corresponds to no data!')."""
    if path.stat().st_size == 0:
        return True
    if path.suffix == ".json" and path.stat().st_size < 64:
        return path.read_text(errors="replace").strip() in ("[]", "{}", "")
    return False


@contextlib.contextmanager
def generators_kept():
    """Python's, NumPy's and torch's random generators as they were, after the block.

    LlamaFactory's argument parsing seeds them all with the job's seed (transformers'
    ``set_seed``), which is what makes a job's LoRA initialisation the same wherever it is
    built. The processes that parse a job and go on must get their own generators back:
    SGLang's launcher, which draws its internal ports with ``random`` (two servers started
    together, both seeded 0 by their job check, picked the same port and one failed), and
    a scheduler, whose sampling generators SGLang seeded with ``--random-seed`` (left
    reseeded, every server that built the same job sampled from the same sequence after
    it). What is drawn inside the block comes from the job's seed; the process's own
    sequence resumes where it was, nothing of it drawn twice."""
    import random

    import numpy as np
    import torch

    # CUDA's generator only where CUDA is up (a scheduler), and only its own device's: asking
    # elsewhere would start CUDA, and another device's would put a context on that GPU.
    devices = [torch.cuda.current_device()] if torch.cuda.is_initialized() else []
    python_state, numpy_state = random.getstate(), np.random.get_state()
    with torch.random.fork_rng(devices=devices):
        try:
            yield
        finally:
            random.setstate(python_state)
            np.random.set_state(numpy_state)


def _parse_with_llamafactory(args: dict[str, Any]):
    import_llamafactory()
    from llamafactory.hparams import get_train_args

    with LOADING_LOCK:
        try:
            model_args, data_args, training_args, finetuning_args, _ = get_train_args(dict(args))
        except ValueError as exc:
            raise JobError(f"LlamaFactory rejected the job: {exc}") from None
        _quiet_transformers()
    return model_args, data_args, training_args, finetuning_args


def _quiet_transformers() -> None:
    # get_train_args turns transformers' INFO logging on for the whole process; a trainer
    # running inside a serving process must not flood its log.
    if os.environ.get("LLAMAFACTORY_VERBOSITY", "WARN").upper() not in ("DEBUG", "INFO"):
        import transformers

        transformers.utils.logging.set_verbosity_warning()


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _as_number(value: Any) -> float | None:
    """A float from a number or numeric string (YAML 1.1 reads ``1e-4`` as a string)."""
    if isinstance(value, bool):
        return None
    try:
        return float(value)
    except (TypeError, ValueError):
        return None


def _jsonable(value: Any) -> Any:
    return value if isinstance(value, (str, int, float, bool, type(None))) else str(value)
