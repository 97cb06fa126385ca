"""What the QoS scheduler reads and returns: the per-step input snapshot, the decision,
and the scheduler's own state between steps.

The ladder is fixed and validated at start-up; the per-step :class:`SchedulerInput`
carries only what changes every step (one predicted latency per level, in milliseconds,
and the trainer's state). The three records built every step are NamedTuples for their
construction cost (docs/measurements.md, 'The decode step's hook'); their tuple-ness
(indexing, unpacking) is not part of the contract. Nothing here imports the predictor, so
either side can change alone.
"""

from __future__ import annotations

import enum
import math
from typing import Any, NamedTuple


class TrainerState(str, enum.Enum):
    """The trainer's state: the one vocabulary of the trainer host, this scheduler, the
    metrics and the endpoints. Before a decode step the scheduler sees it independent of
    its own pause (a trainer this scheduler paused last step is still RUNNING); a status
    report calls a running trainer that no decision lets run PAUSED."""

    RUNNING = "running"  # a job is active and has ready work; it runs whenever a decision lets it
    PAUSED = "paused"  # the operator paused the job (control endpoint) until resumed
    STARVED = "starved"  # waiting on a swap-in: no unit is ready this step (Harli (arXiv:2511.11729) §6.2)
    BUILDING = "building"  # a job's model and data are loading on the trainer thread
    FINISHED = "finished"  # every job ran to its end
    STOPPED = "stopped"  # stopped by the operator or a signal (after its checkpoint)
    FAILED = "failed"  # a fault stopped it (serving went on)
    ABSENT = "absent"  # no finetune job is configured


class TrainerAction(str, enum.Enum):
    RUN = "run"  # the trainer runs on the chosen level's trainer stream
    PAUSE = "pause"  # the trainer waits at its next unit boundary; decode runs on the whole-device level


class DecisionReason(str, enum.Enum):
    FITS = "fits"  # Harli's rule: the level closest under target × (1 − margin)
    HYSTERESIS_HOLD = "hysteresis_hold"  # a better level exists but QoS does not require the move yet
    FLOOR = "floor"  # minimum-progress floor: run on the safest level under the relaxed target
    NONE_FITS = "none_fits"  # no level predicts under budget: trainer paused (Harli (arXiv:2511.11729) §6.2)
    QOS_BACKOFF = "qos_backoff"  # violations the margin could not absorb: trainer paused for a while
    TRAINER_STARVED = "trainer_starved"  # trainer waits on a swap-in: decode takes all SMs (Harli (arXiv:2511.11729) §6.2)
    TRAINER_PAUSED = "trainer_paused"  # operator pause
    TRAINER_STOPPED = "trainer_stopped"
    NO_TRAINER = "no_trainer"


class SchedulerInput(NamedTuple):
    """One decode step as the scheduler sees it (checked by ``choose``, not here).

    - ``predicted_colo_ms[i]``: predicted latency (ms) of this decode step on level ``i``
      with the trainer running on the level's trainer SMs (Harli eq. 3), one entry per
      ladder level. NaN, ±inf and values ≤ 0 mean "no trustworthy prediction" and never
      fit: pass NaN for a batch the profile does not cover (e.g. prefill or mixed batches
      on a non-disaggregated server) and the trainer is paused for it.
    - ``trainer_state``: see :class:`TrainerState`.
    - ``predicted_whole_device_ms``: predicted latency with the trainer paused and decode
      on the whole-device level; reported in pause decisions only (NaN if unknown).
    """

    predicted_colo_ms: tuple[float, ...]
    trainer_state: TrainerState
    predicted_whole_device_ms: float = math.nan


def _json_float(value: float) -> float | None:
    return value if math.isfinite(value) else None


class Decision(NamedTuple):
    """What to do for one decode step.

    ``level_index`` is always a level of the ladder. Invariant: when ``trainer_action`` is
    PAUSE it is the ladder's ``whole_device_index`` (decode alone on every SM); when RUN
    it is a level giving the trainer SMs (on a one-level shared ladder, that same level).
    ``margin`` is the feedback margin in force; ``budget_ms`` the latency the chosen level
    was checked against (``target × (1 − margin)``, or the floor's relaxed target for
    FLOOR); ``predicted_ms`` the predicted latency of the step as decided (the level's
    co-located prediction, or the whole-device prediction when paused, possibly NaN).
    """

    step: int
    level_index: int
    trainer_action: TrainerAction
    reason: DecisionReason
    margin: float
    budget_ms: float
    predicted_ms: float

    @property
    def runs_trainer(self) -> bool:
        return self.trainer_action is TrainerAction.RUN

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready (enums as strings, non-finite floats as None)."""
        return {
            "step": self.step,
            "level_index": self.level_index,
            "trainer_action": self.trainer_action.value,
            "reason": self.reason.value,
            "margin": self.margin,
            "budget_ms": _json_float(self.budget_ms),
            "predicted_ms": _json_float(self.predicted_ms),
        }


class SchedulerState(NamedTuple):
    """What the scheduler carries from one step to the next.

    - ``step``: decisions made so far (the next decision's ``step``).
    - ``reference_level``: the level in force for hysteresis — the last level chosen for
      a runnable trainer, or None after a QoS pause (and at start): no trainer level is
      in force. (Not the whole-device index: on a one-level shared ladder that level is
      also the trainer's, and resuming there must still wait out the hysteresis.) Steps
      in which the trainer could not run (starved, paused by the operator, ...) leave it
      alone, so a starved trainer returns to its level without waiting out the hysteresis.
    - ``hold_streak``: consecutive hysteresis holds (a better level existed).
    - ``paused_steps``: consecutive steps in which a runnable trainer was kept paused.
    - ``margin``: the feedback margin in force.
    - ``backoff_until``: decisions with ``step`` below it keep a runnable trainer paused
      (QOS_BACKOFF); ``backoff_length``: the length of the last backoff, 0 once reset.
    """

    step: int
    reference_level: int | None
    hold_streak: int
    paused_steps: int
    margin: float
    backoff_until: int = 0
    backoff_length: int = 0

    @classmethod
    def initial(cls, initial_margin: float) -> "SchedulerState":
        """Start as if resuming from a pause: the trainer first runs once a level has fit
        for ``hysteresis_steps`` consecutive steps."""
        return cls(0, None, 0, 0, initial_margin, 0, 0)
