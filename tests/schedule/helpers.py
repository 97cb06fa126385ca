"""Shared builders for the scheduler tests."""

from __future__ import annotations

import math

from harvest.ladder import GREEN_CONTEXTS, Ladder, Level
from harvest.schedule import (
    QoSController,
    SchedulerConfig,
    SchedulerInput,
    SchedulerState,
    TrainerState,
)

NAN = math.nan
RUNNING = TrainerState.RUNNING


def ladder(*pairs: tuple[int, int], total: int = 132) -> Ladder:
    """A green-context ladder of ``total`` SMs: the (decode, trainer) levels given, in that
    order, then the whole-device level (decode all, trainer paused)."""
    levels = tuple(Level(d, t) for d, t in pairs) + (Level(total, 0),)
    return Ladder(total, levels, GREEN_CONTEXTS)


# Four partitions of a 132-SM device: level i gives decode fewer SMs and the trainer more;
# level 4 is the whole device, where a pause decision puts decode.
LADDER = ladder((120, 12), (96, 36), (64, 68), (32, 100))
WHOLE = LADDER.whole_device_index


def config(**overrides) -> SchedulerConfig:
    """Defaults, except the floor and the backoff are off unless a test asks for them
    (they would otherwise fire in long pause sequences or violation walks that test
    something else)."""
    overrides.setdefault("floor_after_paused_steps", None)
    overrides.setdefault("backoff_steps", None)
    return SchedulerConfig(**overrides)


def snap(*colo_ms: float, trainer: TrainerState = RUNNING, whole_device_ms: float = 10.0) -> SchedulerInput:
    """The co-located predictions of a :func:`ladder`'s partitions; its whole-device level
    (no trainer SMs) is predicted at ``whole_device_ms``, decode alone, as the predictor
    does for it."""
    return SchedulerInput(tuple(colo_ms) + (whole_device_ms,), trainer, whole_device_ms)


def state(reference: int | None = None, *, hold: int = 0, paused: int = 0, margin: float = 0.05, step: int = 0,
          backoff_until: int = 0, backoff_length: int = 0):
    return SchedulerState(step, reference, hold, paused, margin, backoff_until, backoff_length)


def controller(ladder=LADDER, **overrides) -> QoSController:
    return QoSController(config(**overrides), ladder)


def settle(ctl: QoSController, inp: SchedulerInput, steps: int | None = None) -> None:
    """Decide ``inp`` until the trainer has left the start-up resume wait."""
    for _ in range(steps if steps is not None else ctl.config.hysteresis_steps):
        ctl.decide(inp)
