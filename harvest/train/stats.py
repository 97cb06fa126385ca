"""What the trainer reports: unit records and a progress snapshot the metrics layer reads."""

from __future__ import annotations

import dataclasses
import enum


class UnitKind(str, enum.Enum):
    FORWARD = "forward"
    BACKWARD = "backward"
    OPTIMIZER = "optimizer"  # clip, AdamW step, LR schedule, zero grads (+ a checkpoint when due)
    EVAL = "eval"  # forward of one stage for one evaluation micro-batch, no gradients


@dataclasses.dataclass(frozen=True)
class Unit:
    kind: UnitKind
    stage: int  # -1 for the optimizer unit
    micro_batch: int  # -1 for the optimizer unit


@dataclasses.dataclass(frozen=True)
class UnitRecord:
    """One unit that ran. On CUDA `host_ms` is the time to enqueue it; `device_ms()` waits for
    the unit's end event and gives its device time (when the trainer records events)."""

    step: int
    kind: UnitKind
    stage: int
    stage_name: str
    micro_batch: int
    num_tokens: int  # non-padding tokens of the micro-batch (0 for the optimizer unit)
    host_ms: float
    load_ms: float  # host time spent loading this unit's stage (a window miss)
    device_events: tuple | None = None

    def device_ms(self) -> float | None:
        if self.device_events is None:
            return None
        start, end = self.device_events
        end.synchronize()
        return start.elapsed_time(end)


@dataclasses.dataclass(frozen=True)
class TrainerStats:
    """A consistent snapshot of the trainer's progress (read from any thread)."""

    state: str  # idle | running | paused | stopped | finished | failed
    global_step: int  # optimizer steps completed
    total_steps: int
    samples_seen: int
    tokens_seen: int  # non-padding tokens of completed steps
    loss: float | None  # mean token loss of the last completed step
    learning_rate: float | None
    tokens_per_s: float  # this session: tokens over time spent in units
    units_run: int
    pauses: int  # times the gate held the trainer
    paused_s: float
    window_stages: int  # W
    window_bytes: int  # device memory the window holds
    resident_bytes: int  # window + trainable parameters, gradients and optimizer state
    micro_batch_size: int
    load_wait_s: float  # host time spent in synchronous stage loads (window misses)
    starved: int  # times a unit could not start: no window memory for its stage
    eval_loss: float | None = None  # the last evaluation's loss (the first eval set's, with several)
    fleet: dict | None = None  # a fleet member's view (harvest.fleet.member.FleetMember.stats); None: trains alone
    # The step of the newest checkpoint this trainer wrote or resumed from, shown only once it is
    # on disk (global_step counts a step before its due checkpoint is written); None: none yet.
    checkpoint_step: int | None = None
    # trainer.compile: {"requested", "layers_compiled", "reason"}, with compiled pairs
    # also "signatures" (the most one layer traced), "compiled_pairs" (distinct, shared by
    # layers with equal graphs), "units_past_signature_limit" (harvest.train.compiled_units)
    compile: dict | None = None
    # How micro_batch_size was chosen: {"micro_batch_size", "reason", and for a measured
    # choice "target_ms", "measured_ms"} (harvest.train.microbatch.UnitSizing.status)
    unit_sizing: dict | None = None
