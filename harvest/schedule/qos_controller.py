"""The QoS controller: holds the scheduler's state between decode steps and records what
it decided. The policy itself lives in the pure functions of ``rule.py`` and
``margin.py``; this class only commits their results, so the per-step loop reads

    decision = controller.decide(SchedulerInput(colo_ms, trainer_state, whole_device_ms))
    apply(decision); measured_ms = run_step()
    controller.observe_measurement(measured_ms)

Threading: ``decide`` and ``observe_measurement`` are called from the decode thread only.
``recent_decisions``, ``stats`` and the properties may be called from any thread: they
copy in single C-level operations under the GIL and retry if an append interleaved.
"""

from __future__ import annotations

import collections
import dataclasses
import logging
import math
from typing import Any, Mapping

from harvest.ladder import Ladder
from harvest.logs import get_logger
from harvest.schedule.scheduler_config import SchedulerConfig
from harvest.schedule.margin import backoff_after, margin_after
from harvest.schedule.rule import advance, choose
from harvest.schedule.snapshots import (
    Decision,
    DecisionReason,
    SchedulerInput,
    SchedulerState,
    TrainerAction,
)

log = get_logger(__name__)


@dataclasses.dataclass(frozen=True)
class SchedulerStats:
    """Counters since start. ``decisions_by_level`` is keyed by level index (pauses count
    on the whole-device level); ``num_colocated_violations`` counts violations with the trainer running
    (the ones the margin reacts to); ``num_backoffs`` the backoffs started."""

    num_decisions: int
    decisions_by_reason: Mapping[DecisionReason, int]
    decisions_by_level: Mapping[int, int]
    num_measurements: int
    num_violations: int
    num_colocated_violations: int
    margin: float
    num_backoffs: int = 0

    @property
    def violation_rate(self) -> float:
        return self.num_violations / self.num_measurements if self.num_measurements else 0.0

    def to_dict(self) -> dict[str, Any]:
        return {
            "num_decisions": self.num_decisions,
            "decisions_by_reason": {reason.value: count for reason, count in self.decisions_by_reason.items()},
            "decisions_by_level": {str(level): count for level, count in self.decisions_by_level.items()},
            "num_measurements": self.num_measurements,
            "num_violations": self.num_violations,
            "num_colocated_violations": self.num_colocated_violations,
            "violation_rate": self.violation_rate,
            "margin": self.margin,
            "num_backoffs": self.num_backoffs,
        }


class QoSController:
    """Decides, before every decode step, the SM level and whether the trainer runs.

    ``ladder`` is the device's harvest.ladder.Ladder, indexed as the predictor's levels;
    at least one level must give the trainer SMs, else it could never run.
    """

    def __init__(self, config: SchedulerConfig, ladder: Ladder):
        if not isinstance(config, SchedulerConfig):
            raise ValueError(f"QoSController: config={config!r} must be a SchedulerConfig")
        if not isinstance(ladder, Ladder):
            raise ValueError(f"QoSController: ladder={ladder!r} must be a harvest.ladder.Ladder")
        if not ladder.trainer_levels:
            raise ValueError(
                f"QoSController: no level of the {ladder.describe()} gives the trainer SMs, so it could never run; "
                "add a level with trainer_sms > 0 (on a single shared device: decode_sms == trainer_sms == all SMs)"
            )
        self.config = config
        self.ladder = ladder
        self._state = SchedulerState.initial(config.initial_margin)
        self._ring: collections.deque[Decision] = collections.deque(maxlen=config.ring_size)
        self._awaiting_measurement: Decision | None = None
        self._reason_counts = {reason: 0 for reason in DecisionReason}
        self._level_counts = [0] * ladder.num_levels  # a list: no key lookup per decision
        self._num_measurements = 0
        self._num_violations = 0
        self._num_colocated_violations = 0
        self._warned_max_margin = False
        self._num_backoffs = 0

    # -- queries (no state change) ----------------------------------------------------------
    @property
    def state(self) -> SchedulerState:
        return self._state

    @property
    def margin(self) -> float:
        return self._state.margin

    def choose(self, snapshot: SchedulerInput) -> Decision:
        """What :meth:`decide` would return for ``snapshot``, without committing it."""
        return choose(self.config, self.ladder, self._state, snapshot)

    def recent_decisions(self) -> tuple[Decision, ...]:
        """The last ``ring_size`` decisions, oldest first."""
        return self._copy(tuple, self._ring)

    def stats(self) -> SchedulerStats:
        reasons = self._copy(dict, self._reason_counts)
        levels = self._copy(list, self._level_counts)
        return SchedulerStats(
            num_decisions=self._state.step,
            decisions_by_reason=reasons,
            decisions_by_level=dict(enumerate(levels)),
            num_measurements=self._num_measurements,
            num_violations=self._num_violations,
            num_colocated_violations=self._num_colocated_violations,
            margin=self._state.margin,
            num_backoffs=self._num_backoffs,
        )

    @staticmethod
    def _copy(kind, source):
        # A copy is one C call under the GIL; only a garbage collection that runs Python
        # finalizers mid-copy could let the decode thread append, hence the retry.
        for _ in range(8):
            try:
                return kind(source)
            except RuntimeError:
                continue
        return kind(source)

    # -- commands -----------------------------------------------------------------------------
    def decide(self, snapshot: SchedulerInput) -> Decision:
        """Decide the next decode step and commit it. Bad input raises ValueError with the
        state unchanged. An unmeasured previous decision is simply superseded (the runtime
        may skip measuring a step)."""
        decision = choose(self.config, self.ladder, self._state, snapshot)
        self._state = advance(self._state, decision)
        self._ring.append(decision)
        self._reason_counts[decision.reason] += 1
        self._level_counts[decision.level_index] += 1
        self._awaiting_measurement = decision
        return decision

    def observe_measurement(self, measured_ms: float) -> bool:
        """Record the measured latency of the step the last decision governed, once; move
        the feedback margin if the trainer ran during it. Returns whether the step violated
        the target. Raises (state unchanged) on a non-positive or non-finite value, or when
        no decision awaits a measurement."""
        number = isinstance(measured_ms, (int, float)) and not isinstance(measured_ms, bool)
        if not number or not 0.0 < measured_ms < math.inf:
            raise ValueError(f"observe_measurement: measured_ms={measured_ms!r} must be a finite number of ms > 0")
        decision = self._awaiting_measurement
        if decision is None:
            raise RuntimeError(
                "observe_measurement: no decision awaits a measurement; call decide() before each decode "
                "step and observe_measurement() at most once after it"
            )
        self._awaiting_measurement = None
        violated = measured_ms > self.config.target_tpot_ms
        colocated = decision.trainer_action is TrainerAction.RUN
        self._num_measurements += 1
        if violated:
            self._num_violations += 1
            self._num_colocated_violations += colocated
        state = self._state
        margin = margin_after(self.config, state.margin, measured_ms, colocated)
        # backoff_after leaves a paused step's length alone; not called for one (most steps).
        length, starts = (backoff_after(self.config, state.margin, measured_ms, True, state.backoff_length) if colocated
                          else (state.backoff_length, False))
        if margin != state.margin:
            if margin == self.config.max_margin and not self._warned_max_margin:
                # Once per excursion: re-armed when the margin is back at its initial value.
                self._warned_max_margin = True
                log.warning(
                    "QoS margin reached its maximum %.2f after a %.2f ms step against a %.1f ms target: co-located "
                    "latency is under-predicted; consider re-profiling this (GPU, model, job)",
                    margin, measured_ms, self.config.target_tpot_ms,
                )
            elif margin == self.config.initial_margin:
                self._warned_max_margin = False
        if margin != state.margin or length != state.backoff_length or starts:
            until = state.backoff_until
            if starts:
                until = state.step + length
                self._num_backoffs += 1
                # A warning for a fresh backoff, info for a doubling; once at its maximum
                # length (a machine that stays slow), debug: one line per backoff is noise.
                level = logging.WARNING if state.backoff_length == 0 else logging.INFO
                log.log(
                    level if length != state.backoff_length else logging.DEBUG,
                    "QoS backoff: a %.2f ms co-located step against a %.1f ms target with the margin at its maximum "
                    "%.2f; the trainer pauses for %d decisions",
                    measured_ms, self.config.target_tpot_ms, state.margin, length,
                )
            self._state = SchedulerState(
                state.step, state.reference_level, state.hold_streak, state.paused_steps, margin, until, length
            )
        return violated
