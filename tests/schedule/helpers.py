"""Shared builders for the scheduler tests."""

from __future__ import annotations

import math

from harvest.schedule import (
    WHOLE_GPU,
    QoSController,
    SchedulerConfig,
    SchedulerInput,
    SchedulerLadder,
    SchedulerState,
    TrainerState,
)

NAN = math.nan
RUNNING = TrainerState.RUNNING

# Four partitions of a 132-SM device: level i gives decode fewer SMs and the trainer more.
LADDER = SchedulerLadder((120, 96, 64, 32), (12, 36, 68, 100))


def config(**overrides) -> SchedulerConfig:
    """Defaults, except the floor and the backoff are off unless a test asks for them
    (they would otherwise fire in long pause sequences or violation walks that test
    something else)."""
    overrides.setdefault("floor_after_paused_steps", None)
    overrides.setdefault("backoff_steps", None)
    return SchedulerConfig(**overrides)


def snap(*colo_ms: float, trainer: TrainerState = RUNNING, whole_gpu_ms: float = 10.0) -> SchedulerInput:
    return SchedulerInput(tuple(colo_ms), trainer, whole_gpu_ms)


def state(reference: int = WHOLE_GPU, *, hold: int = 0, paused: int = 0, margin: float = 0.05, step: int = 0,
          backoff_until: int = 0, backoff_length: int = 0):
    return SchedulerState(step, reference, hold, paused, margin, backoff_until, backoff_length)


def controller(ladder=LADDER, **overrides) -> QoSController:
    return QoSController(config(**overrides), ladder)


def settle(ctl: QoSController, inp: SchedulerInput, steps: int | None = None) -> None:
    """Decide ``inp`` until the trainer has left the start-up resume wait."""
    for _ in range(steps if steps is not None else ctl.config.hysteresis_steps):
        ctl.decide(inp)
