"""Building a trainer: from a LlamaFactory job (`build_trainer`) or from parts (`assemble_trainer`).

`build_trainer` takes tokenizer, template, dataset preprocessing, LoRA attachment and the
data collator from LlamaFactory, exactly as ``llamafactory-cli train`` would, then hands
the PEFT model to `assemble_trainer`, which splits it into stages, moves what stays
resident (LoRA weights, buffers) to the device, gives the frozen weights to a weight
source and a window, checks the memory budget, and builds AdamW and the LR schedule the
way the Hugging Face Trainer does. All of it happens before the first unit runs, so
every configuration error surfaces before training starts.
"""

from __future__ import annotations

import copy
import dataclasses
import logging
import math
from pathlib import Path
from typing import Any, Callable, Sequence

import torch

from harvest.train.computed_buffers import check_computed_buffers
from harvest.train.data import IGNORE_INDEX, StepBatches, micro_batch_from
from harvest.train.evaluation import EvalSettings, Evaluation
from harvest.train.errors import JobError
from harvest.train.job import DEFAULT_UNIT_TARGET_MS, HARVEST_SECTION, HarvestOptions, TrainJob, import_llamafactory
from harvest.train.llamafactory_env import LOADING_LOCK
from harvest.train.microbatch import UnitSizing, choose_micro_batch_size
from harvest.train.plan import check_device, job_identity_name, ready_job
from harvest.train.split_model import MicroBatch, SplitCausalLM
from harvest.train.trainer import LayerSplitTrainer
from harvest.train.weights import BaseWeightSource, HostCopyWeightSource
from harvest.train.window import WeightWindow, stages_fitting
from harvest.train.window_memory import BaseWindowAllocator, TorchWindowAllocator

logger = logging.getLogger(__name__)
_NO_DECAY_PATTERNS = [r"bias", r"layernorm", r"rmsnorm", r"(?:^|\.)norm(?:$|\.)", r"_norm(?:$|\.)"]  # HF Trainer's


@dataclasses.dataclass(frozen=True)
class TrainerSettings:
    """Optimization, schedule and saving settings (LlamaFactory's training arguments, distilled)."""

    samples_per_step: int
    learning_rate: float
    seed: int = 42
    max_steps: int = -1  # > 0 wins over num_train_epochs
    num_train_epochs: float = 1.0
    weight_decay: float = 0.0
    adam_beta1: float = 0.9
    adam_beta2: float = 0.999
    adam_epsilon: float = 1e-8
    fused_adamw: bool = False
    lr_scheduler_type: str = "linear"
    lr_scheduler_kwargs: dict = dataclasses.field(default_factory=dict)
    warmup_steps: float = 0  # >= 1: steps; < 1: fraction of the run
    save_steps: float | None = None  # >= 1: steps; < 1: fraction of the run; None: no periodic saves
    save_total_limit: int | None = None
    max_grad_norm: float = 1.0
    output_dir: Path | None = None
    autocast_dtype: torch.dtype | None = None
    fingerprint: dict = dataclasses.field(default_factory=dict)
    shuffle: bool = True  # False: each epoch in dataset order (LlamaFactory's disable_shuffling)
    save_only_model: bool = False  # checkpoints without optimizer/schedule/RNG state (not resumable)
    evaluation: EvalSettings = EvalSettings()  # when to evaluate (with eval sets)
    # ignore_pad_token_for_loss: false: padding carries loss, so what a step trains depends
    # on how its samples are batched; micro_batch_size auto then takes LlamaFactory's batch.
    padded_loss_batch_size: int | None = None

    @classmethod
    def from_job(cls, job: TrainJob) -> "TrainerSettings":
        args = job.training_args
        save_steps = None if str(getattr(args.save_strategy, "value", args.save_strategy)) == "no" else args.save_steps
        return cls(
            samples_per_step=job.samples_per_step, learning_rate=args.learning_rate,
            seed=args.data_seed if args.data_seed is not None else args.seed,
            max_steps=args.max_steps, num_train_epochs=args.num_train_epochs, weight_decay=args.weight_decay,
            adam_beta1=args.adam_beta1, adam_beta2=args.adam_beta2, adam_epsilon=args.adam_epsilon,
            fused_adamw=str(getattr(args.optim, "value", args.optim)) == "adamw_torch_fused",
            lr_scheduler_type=str(getattr(args.lr_scheduler_type, "value", args.lr_scheduler_type)),
            lr_scheduler_kwargs=dict(args.lr_scheduler_kwargs or {}), warmup_steps=args.warmup_steps,
            save_steps=save_steps, save_total_limit=args.save_total_limit, max_grad_norm=args.max_grad_norm,
            output_dir=Path(args.output_dir), autocast_dtype=torch.bfloat16 if args.bf16 else None,
            fingerprint=job.fingerprint(), shuffle=not job.finetuning_args.disable_shuffling,
            save_only_model=bool(args.save_only_model), evaluation=_eval_settings(args),
            padded_loss_batch_size=(None if job.data_args.ignore_pad_token_for_loss
                                    else int(args.per_device_train_batch_size)))


def _eval_settings(args) -> EvalSettings:
    strategy = str(getattr(args.eval_strategy, "value", args.eval_strategy))
    steps = args.eval_steps if args.eval_steps is not None else args.logging_steps  # as the HF Trainer
    return EvalSettings(strategy=strategy, steps=float(steps), delay=float(args.eval_delay or 0),
                        on_start=bool(args.eval_on_start), at_end=bool(args.do_eval),
                        batch_size=int(args.per_device_eval_batch_size))


def resolve_device(name: str) -> torch.device:
    """A torch device with an explicit index for CUDA (tensors report ``cuda:0``, and
    ``torch.device("cuda") != torch.device("cuda", 0)``)."""
    if name == "auto":
        name = "cuda" if torch.cuda.is_available() else "cpu"
    check_device(name)
    device = torch.device(name)
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    return device


def build_trainer(job: TrainJob, *, weight_source: BaseWeightSource | None = None,
                  allocator: BaseWindowAllocator | None = None, resume: bool = True,
                  tp=None, compile_layers: str = "auto", unit_sizing: UnitSizing | None = None) -> LayerSplitTrainer:
    """A trainer for `job`, resumed from ``resume_from_checkpoint`` (which LlamaFactory sets
    to the newest ``checkpoint-N`` in output_dir unless ``overwrite_output_dir``).
    ``tp`` (harvest.train.tensor_parallel.TensorParallel): this rank's place in a
    tensor-parallel trainer; every rank builds the same job and keeps its shard.
    Everything it refuses before the model loads, `plan.ready_job` refuses (first thing
    here), which `harvest train --check` runs too, so the two cannot disagree.
    ``compile_layers``: ``trainer.compile`` (auto | on | off; harvest.train.compiled_units).
    ``unit_sizing``: what ``micro_batch_size: auto`` sizes units for when the job's
    ``unit_target_ms`` is auto (a decode server's: a fraction of its step, on a partition);
    None: the stand-alone default."""
    import_llamafactory()
    from llamafactory.data import SFTDataCollatorWith4DAttentionMask
    from llamafactory.model import load_model

    _, data = ready_job(job, tp_size=tp.size if tp is not None else 1, resume=resume)
    device = resolve_device(job.harvest.device)
    settings = TrainerSettings.from_job(job)
    writer = tp is None or tp.rank == 0  # tensor-parallel: rank 0 writes the run's files
    fleet = job.harvest.fleet if job.harvest.fleet.enabled else None
    model_args = copy.copy(job.model_args)
    model_args.device_map = {"": "cpu"}  # frozen weights belong in host memory; the trainer places the rest
    tokenizer_module, template, dataset = data.tokenizer_module, data.template, data.train_dataset
    eval_sets = ({f"eval_{name}": d for name, d in data.eval_dataset.items()} if isinstance(data.eval_dataset, dict)
                 else {"eval": data.eval_dataset} if data.eval_dataset is not None else None)
    try:
        with LOADING_LOCK:  # from_pretrained changes process-global state while it runs
            model = load_model(tokenizer_module["tokenizer"], model_args, job.finetuning_args, is_trainable=True)
    except ValueError as exc:
        if "Target modules" in str(exc) or "target_modules" in str(exc):
            raise JobError(f"lora_target: {job.llamafactory_args.get('lora_target')!r} matches no module of the "
                           f"model ({exc})") from None
        raise JobError(f"model_name_or_path: LlamaFactory could not load the model: {exc}") from None
    # Built as LlamaFactory's SFT workflow builds it for training, so a batch holds what
    # llamafactory-cli train feeds the model: the packed rows' position_ids, neat packing's
    # block-diagonal mask, padded labels per ignore_pad_token_for_loss.
    collator = SFTDataCollatorWith4DAttentionMask(
        template=template, model=None, pad_to_multiple_of=8,
        label_pad_token_id=(IGNORE_INDEX if job.data_args.ignore_pad_token_for_loss
                            else tokenizer_module["tokenizer"].pad_token_id),
        block_diag_attn=model_args.block_diag_attn, neat_packing=job.data_args.neat_packing,
        attn_implementation=getattr(model.config, "_attn_implementation", None),
        compute_dtype=model_args.compute_dtype or torch.float32, **tokenizer_module)
    try:  # what the collator makes must be something the trainer feeds on, before any step runs
        micro_batch_from(collator([dataset[0]]), 0, torch.device("cpu"))
    except ValueError as exc:
        raise JobError(f"dataset: {exc}") from None
    checkpoint_path = job.training_args.resume_from_checkpoint if resume else None
    if resume and job.training_args.overwrite_output_dir and writer:
        _remove_earlier_run(job.output_dir)

    def make_log(total_steps: int, steps_per_epoch: int):
        from harvest.train.train_log import TrainLog

        return TrainLog(job.training_args, output_dir=job.output_dir, total_steps=total_steps,
                        steps_per_epoch=steps_per_epoch, samples_per_step=job.samples_per_step,
                        plot_loss=bool(job.finetuning_args.plot_loss))

    # A fleet's members share output_dir: its checkpoints are the fleet's (one member writes
    # each), and no member keeps the one-process trainer log there.
    return assemble_trainer(model, dataset, collator, settings, job.harvest, device=device,
                            weight_source=weight_source, allocator=allocator, resume_from=checkpoint_path,
                            make_optimizer=job_optimizer(job),
                            make_log=make_log if resume and writer and fleet is None else None,
                            eval_sets=eval_sets, tp=tp, compile_layers=compile_layers, unit_sizing=unit_sizing,
                            fleet_job_id=(fleet.job_id or job_identity_name(job)) if fleet is not None else None)


def _remove_earlier_run(output_dir: Path) -> None:
    """``overwrite_output_dir: true``: an older run's checkpoints and state go before this run
    writes its own (a later run without overwrite would otherwise resume from them)."""
    import shutil

    from harvest.train.checkpoint import list_checkpoints
    from harvest.train.train_log import TRAINER_LOG, TRAINER_STATE

    stale = list_checkpoints(output_dir)
    files = [output_dir / name for name in (TRAINER_STATE, TRAINER_LOG) if (output_dir / name).is_file()]
    for path in stale:
        shutil.rmtree(path)
    for path in files:
        path.unlink()
    if stale or files:
        logger.warning("overwrite_output_dir: removed an earlier run's %s from %s",
                       ", ".join(p.name for p in stale + files), output_dir)


def job_optimizer(job: TrainJob) -> Callable[[torch.nn.Module], torch.optim.Optimizer]:
    """``make(peft_model)``: the optimizer ``llamafactory-cli train`` would build for the job.

    LlamaFactory's own factory first (LoRA+, Muon, Adam-mini), else the Hugging Face
    Trainer's: the class and arguments for ``optim`` (and ``optim_args``), over its two
    weight-decay groups. Only optimizers the optimizer unit can drive get here (job.py
    checks ``optim``)."""

    def make(peft_model: torch.nn.Module) -> torch.optim.Optimizer:
        import_llamafactory()
        from llamafactory.train.trainer_utils import create_custom_optimizer
        from transformers import Trainer

        custom = create_custom_optimizer(peft_model, job.training_args, job.finetuning_args)
        if custom is not None:
            return custom
        optimizer_cls, optimizer_kwargs = Trainer.get_optimizer_cls_and_kwargs(job.training_args, peft_model)
        groups = _decay_groups(peft_model, job.training_args.weight_decay)
        return optimizer_cls(groups, **optimizer_kwargs)

    return make


def assemble_trainer(peft_model, dataset: Sequence[dict[str, Any]], collate: Callable, settings: TrainerSettings,
                     options: HarvestOptions, *, device: torch.device, weight_source: BaseWeightSource | None = None,
                     allocator: BaseWindowAllocator | None = None, resume_from: str | Path | None = None,
                     record_device_events: bool = False,
                     make_optimizer: Callable[[torch.nn.Module], torch.optim.Optimizer] | None = None,
                     make_log: Callable[[int, int], Any] | None = None,
                     eval_sets: dict[str, Sequence[dict[str, Any]]] | None = None, tp=None,
                     fleet_job_id: str | None = None, compile_layers: str = "auto",
                     unit_sizing: UnitSizing | None = None, compile_pairs: bool | None = None) -> LayerSplitTrainer:
    """The trainer over a PEFT model. ``make_optimizer(peft_model)`` builds the optimizer
    (default: AdamW from ``settings``, as the Hugging Face Trainer builds it);
    ``make_log(total_steps, steps_per_epoch)`` its TrainLog (default: none); ``eval_sets``
    (metric prefix -> dataset) are evaluated as ``settings.evaluation`` says."""
    device = resolve_device(str(device))
    check_computed_buffers(peft_model)  # before anything trains on a garbage rotary table
    split = SplitCausalLM(peft_model)
    sharded = None
    if tp is not None and tp.size > 1:
        from harvest.train.tensor_parallel import shard_model

        sharded = shard_model(split, tp)  # before the weight source and window: they hold this rank's shard
    # Before the window: compiling changes no parameter, and the first units (micro-batch
    # sizing, below) compile on this thread, while the job builds.
    if settings.autocast_dtype is not None:
        keep_lora_inputs_in_compute_dtype(split.peft_model)
    split.compile_layers(compile_layers, device, tensor_parallel=sharded is not None, pairs=compile_pairs)
    layouts = split.layouts()
    if weight_source is None:
        host = {name: tensor for s in range(split.num_stages) for name, _, _, tensor in split.frozen_tensors(s)}
        weight_source = HostCopyWeightSource(host, pin_memory=device.type == "cuda")
    for param in (p for p in split.causal_lm.parameters() if p.requires_grad):
        param.data = param.data.to(device)
    for module in split.causal_lm.modules():
        for name, buffer in module._buffers.items():
            if buffer is not None:
                module._buffers[name] = buffer.to(device)

    trainable_bytes = sum(p.numel() * p.element_size() for p in split.causal_lm.parameters() if p.requires_grad)
    resident_bytes = 4 * trainable_bytes  # weights, gradients, AdamW exp_avg and exp_avg_sq
    stage_bytes = [0 if weight_source.device_resident else layout.num_bytes for layout in layouts]
    capacity, window_limit = _window_capacity(options, stage_bytes, resident_bytes)
    if allocator is None:
        allocator = TorchWindowAllocator(device, limit_bytes=window_limit)
    window = WeightWindow(layouts, weight_source, allocator, capacity=capacity)

    batches = StepBatches(dataset, collate, settings.samples_per_step, settings.seed, shuffle=settings.shuffle)
    total_steps = settings.max_steps if settings.max_steps > 0 else math.ceil(
        settings.num_train_epochs * batches.steps_per_epoch)
    optimizer = make_optimizer(split.peft_model) if make_optimizer is not None else _adamw(split.peft_model, settings)
    from transformers import get_scheduler

    scheduler = get_scheduler(settings.lr_scheduler_type, optimizer,
                              num_warmup_steps=_steps(settings.warmup_steps, total_steps) or 0,
                              num_training_steps=total_steps, scheduler_specific_kwargs=settings.lr_scheduler_kwargs)
    trainer = LayerSplitTrainer(
        split=split, window=window, batches=batches, optimizer=optimizer, scheduler=scheduler,
        total_steps=total_steps, micro_batch_size=options.micro_batch_size or settings.samples_per_step,
        device=device, output_dir=settings.output_dir, microbatches_per_pass=options.microbatches_per_pass,
        save_steps=_steps(settings.save_steps, total_steps), save_total_limit=settings.save_total_limit,
        max_grad_norm=settings.max_grad_norm, autocast_dtype=settings.autocast_dtype,
        fingerprint=settings.fingerprint, record_device_events=record_device_events,
        train_log=make_log(total_steps, batches.steps_per_epoch) if make_log is not None and settings.output_dir
        else None, save_only_model=settings.save_only_model,
        evaluation=Evaluation(eval_sets, collate, settings.evaluation, total_steps=total_steps,
                              steps_per_epoch=batches.steps_per_epoch,
                              microbatches_per_pass=options.microbatches_per_pass) if eval_sets else None,
        sharded=sharded, fleet=_fleet_member(options, fleet_job_id, total_steps, settings))
    resumed = None
    if resume_from:
        resumed = trainer.resume_from(Path(resume_from))
        logger.info("resumed from %s at step %d", resume_from, trainer.global_step)
    if options.micro_batch_size is None:
        sizing = _unit_sizing(options, unit_sizing)
        if resumed is not None and resumed.get("micro_batch_size"):
            trainer.micro_batch_size = int(resumed["micro_batch_size"])  # same split as the first run
            trainer.unit_sizing = {"micro_batch_size": trainer.micro_batch_size,
                                   "reason": "the checkpoint's: a resumed run keeps its micro-batches"}
        elif settings.padded_loss_batch_size is not None:
            trainer.micro_batch_size = settings.padded_loss_batch_size
            trainer.unit_sizing = {"micro_batch_size": trainer.micro_batch_size,
                                   "reason": "ignore_pad_token_for_loss: false: padding carries loss, so a unit pads "
                                             "per_device_train_batch_size samples together, as llamafactory-cli train "
                                             "does"}
        else:
            longest = dataset[_longest_sample(dataset)]

            def probe_batch(size: int) -> MicroBatch:
                return micro_batch_from(collate([longest] * size), 0, device)

            trainer.micro_batch_size, unit_ms = choose_micro_batch_size(
                trainer, sizing.target_ms, probe_batch, settings.samples_per_step,
                agree_ms=sharded.tp.max_float if sharded is not None else None, stream=sizing.stream)
            trainer.unit_sizing = sizing.status(trainer.micro_batch_size, unit_ms)
            logger.info("micro-batch size %d: longest unit %.2f ms (target %.2f ms: %s)",
                        trainer.micro_batch_size, unit_ms, sizing.target_ms, sizing.reason)
    else:
        trainer.unit_sizing = {"micro_batch_size": trainer.micro_batch_size,
                               "reason": "harvest.micro_batch_size in the job"}
    return trainer


def _unit_sizing(options, server: UnitSizing | None) -> UnitSizing:
    """The job's own ``unit_target_ms`` (timed on the server's partition, if any), else the
    server's sizing, else the stand-alone default."""
    if options.unit_target_ms is not None:
        return UnitSizing(options.unit_target_ms, server.stream if server is not None else None,
                          "harvest.unit_target_ms in the job")
    if server is not None:
        return server
    return UnitSizing(DEFAULT_UNIT_TARGET_MS, None, "harvest.unit_target_ms: auto, outside a decode server")


def keep_lora_inputs_in_compute_dtype(peft_model) -> int:
    """Turn off PEFT's cast of each LoRA layer's input to its (fp32) weights' dtype, for a
    model that trains under autocast; returns the layers changed.

    Under autocast the cast is undone at once: LoRA A's matmul casts its input back to the
    compute dtype, and a bf16 or fp16 value cast to fp32 and back is the same value, so
    gradients do not change; the two casts are only two more operators per LoRA layer,
    forward and backward. Kept where LoRA dropout runs on the input, since dropout in
    another dtype could round differently."""
    from peft.tuners.tuners_utils import BaseTunerLayer

    changed = 0
    for module in peft_model.modules():
        dropouts = getattr(module, "lora_dropout", None)
        if isinstance(module, BaseTunerLayer) and dropouts is not None and all(
                isinstance(dropout, torch.nn.Identity) for dropout in dropouts.values()):
            module.cast_input_dtype_enabled = False
            changed += 1
    return changed


def _fleet_member(options: HarvestOptions, job_id: str | None, total_steps: int, settings: TrainerSettings):
    if not options.fleet.enabled:
        return None
    from harvest.fleet.member import FleetMember

    if job_id is None:
        raise JobError("harvest.fleet.job_id: needed to train a job assembled from parts in a fleet")
    return FleetMember(options.fleet, job_id=job_id, total_steps=total_steps,
                       fingerprint={**settings.fingerprint, "samples_per_step": settings.samples_per_step},
                       save_steps=_steps(settings.save_steps, total_steps))


def _window_capacity(options: HarvestOptions, stage_bytes: list[int], resident_bytes: int) -> tuple[int, int | None]:
    """(W, bytes the window may hold); JobError if the budget cannot hold one stage."""
    wanted = options.window_stages or len(stage_bytes)
    if options.memory_budget_mb is None:
        return wanted, None
    budget = int(options.memory_budget_mb * 2**20)
    window_limit = budget - resident_bytes
    need = resident_bytes + max(stage_bytes)
    if window_limit < max(stage_bytes):
        raise JobError(
            f"{HARVEST_SECTION}.memory_budget_mb: {options.memory_budget_mb:g} MiB cannot hold the trainer's resident "
            f"state: LoRA weights + gradients + AdamW state {resident_bytes / 2**20:.2f} MiB plus the largest stage "
            f"{max(stage_bytes) / 2**20:.2f} MiB = {need / 2**20:.2f} MiB; raise it to at least that "
            "(activations come on top)")
    return max(1, min(wanted, stages_fitting(stage_bytes, window_limit))), window_limit


def _adamw(model: torch.nn.Module, settings: TrainerSettings) -> torch.optim.AdamW:
    groups = _decay_groups(model, settings.weight_decay)
    return torch.optim.AdamW(groups, lr=settings.learning_rate, betas=(settings.adam_beta1, settings.adam_beta2),
                             eps=settings.adam_epsilon, fused=settings.fused_adamw or None)


def _decay_groups(model: torch.nn.Module, weight_decay: float) -> list[dict]:
    """The Hugging Face Trainer's parameter groups: weight decay except for biases and norms."""
    from transformers.trainer_pt_utils import get_parameter_names

    decay_names = set(get_parameter_names(model, [torch.nn.LayerNorm], _NO_DECAY_PATTERNS))
    named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    groups = [
        {"params": [p for n, p in named if n in decay_names], "weight_decay": weight_decay},
        {"params": [p for n, p in named if n not in decay_names], "weight_decay": 0.0},
    ]
    return [g for g in groups if g["params"]]


def _steps(value: float | None, total_steps: int) -> int | None:
    if value is None:
        return None
    return int(value) if value >= 1 else math.ceil(value * total_steps)


def _longest_sample(dataset: Sequence[dict[str, Any]]) -> int:
    """The index of the longest of (at most about 2048, evenly spread) samples."""
    count = len(dataset)
    stride = max(1, count // 2048)
    return max(range(0, count, stride), key=lambda i: len(dataset[i]["input_ids"]))
