"""Per-decode-step control: predict, decide, apply, measure (Harli (arXiv:2511.11729) §5-§6).

    plan = control.before_step(StepLoad(batch_size, sum_context, is_decode))
    ... the engine runs the step on plan.stream with the decode graphs of plan.level, timed under plan.step ...
    control.after_step(plan.step, measured_s)  # or later, when a CUDA-event timer completes

Invariants: a measurement is paired with its decision by step number (a step whose
measurement never comes is given up when a later one arrives); applying a decision is an
O(1) partition selection plus the trainer gate; measurements feed the feedback margin at
once and the bookkeeping (predictor windows, step records, metrics) every ``RECORD_EVERY``
steps, when idle or when read; steps the profile does not cover predict as NaN and are
never co-located. Figures: docs/measurements.md, 'The decode step's hook'.
"""

from __future__ import annotations

import collections
import math
import threading
import time
from typing import Any, NamedTuple

from harvest.logs import get_logger
from harvest.schedule import QoSController, SchedulerInput, TrainerAction, TrainerState

logger = get_logger(__name__)


class StepLoad(NamedTuple):
    batch_size: int
    sum_context: int
    is_decode: bool


class StepPlan(NamedTuple):
    """One decode step as decided, :meth:`StepController.before_step`'s answer: what the
    step runs on, read from here alone, and what its measurement is booked with. The
    same tuple waits for that measurement (one allocation per step)."""

    step: int  # the QoS decision's number: the step is timed under it, its measurement paired by it
    level: int  # the SM level's index in the ladder; also names the level's decode-graph set
    stream: Any  # the level's decode stream (None: the engine thread's current stream)
    load: StepLoad | None  # None: a tensor-parallel rank following rank 0's plan
    phase: str | None  # trainer phase co-running; None: decode alone
    predicted_s: float
    trainer_ran: bool
    decision: Any  # the QoS Decision (harvest.schedule); None on a rank following rank 0


class StepRecord(NamedTuple):
    time_s: float  # wall clock (time.time) at the end of the step
    batch_size: int
    measured_ms: float
    predicted_ms: float  # NaN when nothing was predicted
    level: int
    trainer_ran: bool
    is_decode: bool  # False: a prefill or mixed batch (not a TPOT step)
    reason: str  # why the QoS scheduler decided so (DecisionReason value: fits, none_fits, floor, ...)


class StepController:
    def __init__(self, *, partitioner, qos: QoSController, trainer_host, predictor=None, refiner=None, metrics=None,
                 target_tpot_ms: float):
        self.partitioner = partitioner
        self.qos = qos
        self.trainer = trainer_host
        self.predictor = predictor
        self.refiner = refiner
        self.metrics = metrics
        self.target_s = target_tpot_ms / 1e3
        self.levels = partitioner.ladder.levels
        self.whole_index = partitioner.ladder.whole_device_index
        num_levels = len(self.levels)
        self._solo_ms = [math.nan] * num_levels
        self._colo_ms = [math.nan] * num_levels
        self._no_prediction = (math.nan,) * num_levels
        # The stage-2 model: the worst of the per-phase ones when the profile has them
        # (trainer units are often shorter than a decode step, so both phases can run
        # during one step; QoS first), else the combined one.
        self._colo_model = predictor.worst_phase if predictor is not None else 0
        # Decisions waiting for their measurement, oldest first; bounded, so an engine that
        # never reports a step cannot grow it.
        self._pending: collections.deque[StepPlan] = collections.deque(maxlen=self.MAX_UNMEASURED)
        self.unmeasured_steps = 0  # decisions given up without a measurement
        self._unrecorded: collections.deque = collections.deque()  # (end time, StepPlan, measured_s)
        self._record_lock = threading.Lock()
        self._recent_steps: collections.deque[StepRecord] = collections.deque(maxlen=8192)
        self.num_recorded = 0  # sequence number of the newest record in recent_steps
        self.level = self.levels[self.whole_index]
        self.applied = (self.whole_index, False)  # (level index, trainer runs) last applied
        self.num_steps = 0
        self.last_decision = None  # the QoS decision of the latest before_step
        self._last_decision_step = -1

    # -- before the step ------------------------------------------------------------------
    def before_step(self, load: StepLoad) -> StepPlan:
        """Predict every level, let the QoS scheduler decide, select the level and open or
        close the trainer's gate: the step's plan."""
        trainer_state = self.trainer.scheduler_state() if self.trainer is not None else TrainerState.ABSENT
        colo_ms = self._no_prediction
        whole_ms = math.nan
        predicted_all = load.is_decode and self.predictor is not None and trainer_state is TrainerState.RUNNING
        if predicted_all:
            self.predictor.predict_levels(load.batch_size, load.sum_context, self._solo_ms, self._colo_ms,
                                          self._colo_model, 1e3)
            colo_ms = tuple(self._colo_ms)
            whole_ms = self._solo_ms[self.whole_index]
        decision = self.qos.decide(SchedulerInput(colo_ms, trainer_state, whole_ms))
        index = decision.level_index
        run = decision.trainer_action is TrainerAction.RUN
        phase = None
        if run:
            predicted_s = self._colo_ms[index] / 1e3
            phase = self.trainer.next_phase()  # the unit the trainer runs next: before it is let go
        elif predicted_all:
            predicted_s = self._solo_ms[index] / 1e3
        elif load.is_decode and self.predictor is not None:
            predicted_s = self.predictor.predict_solo(index, load.batch_size, load.sum_context)
        else:
            predicted_s = math.nan
        self.level = self.partitioner.select(index)
        if self.trainer is not None:
            self.trainer.apply(run, self.level.trainer_stream)
        self.applied = (index, run)
        self.last_decision = decision
        self._last_decision_step = decision.step
        if len(self._pending) == self.MAX_UNMEASURED:
            self.unmeasured_steps += 1  # the append drops the oldest
        plan = StepPlan(decision.step, index, self.level.decode_stream, load, phase, predicted_s, run, decision)
        self._pending.append(plan)
        return plan

    # -- after the step (measurements may arrive one step late, in order) -----------------
    MAX_UNMEASURED = 1024

    def after_step(self, step: int, measured_s: float) -> None:
        """The measurement of the decision numbered ``step``: feedback to the QoS scheduler
        now (the next decision needs it); the rest of the bookkeeping (step record,
        predictor window, metrics) is queued and done for ``RECORD_EVERY`` steps at once,
        off most steps' path. Earlier decisions still waiting are given up (their
        measurement was lost); a measurement of no waiting decision is ignored."""
        queue = self._pending
        while queue and queue[0].step < step:
            queue.popleft()
            self.unmeasured_steps += 1
        if not queue or queue[0].step != step:
            return
        pending = queue.popleft()
        self.num_steps += 1
        if measured_s > 0:
            # The scheduler takes a measurement only for its latest decision; a late one
            # (CUDA events under overlap scheduling) still feeds the predictor and metrics.
            if pending.step == self._last_decision_step:
                self.qos.observe_measurement(measured_s * 1e3)
            self._unrecorded.append((time.time(), pending, measured_s))
            if len(self._unrecorded) >= self.RECORD_EVERY:
                self.record_steps(blocking=False)

    RECORD_EVERY = 32

    def record_steps(self, blocking: bool = True) -> None:
        """Do the queued steps' bookkeeping: ``recent_steps``, the online predictor's
        windows, the metrics. Any thread; the decode thread does not wait for another
        thread doing it (``blocking=False``)."""
        if not self._unrecorded or not self._record_lock.acquire(blocking):
            return
        try:
            queue, refiner, metrics, levels = self._unrecorded, self.refiner, self.metrics, self.levels
            while queue:
                end_time, pending, measured_s = queue.popleft()
                predicted_s = None if math.isnan(pending.predicted_s) else pending.predicted_s
                load = pending.load
                self._recent_steps.append(StepRecord(end_time, load.batch_size, measured_s * 1e3, pending.predicted_s * 1e3,
                                                     pending.level, pending.trainer_ran, load.is_decode,
                                                     pending.decision.reason.value))
                self.num_recorded += 1
                if refiner is not None and load.is_decode:
                    refiner.observe(pending.level, load.batch_size, load.sum_context, measured_s, phase=pending.phase,
                                    predicted_s=predicted_s)
                if metrics is not None:
                    level = levels[pending.level]
                    metrics.observe_step(
                        measured_s=measured_s, predicted_s=predicted_s, target_s=self.target_s, level_index=pending.level,
                        decode_sms=level.decode_sms, trainer_sms=level.trainer_sms if pending.trainer_ran else 0,
                    )
        finally:
            self._record_lock.release()

    @property
    def recent_steps(self) -> collections.deque:
        """The last steps' records, oldest first (queued bookkeeping done first)."""
        self.record_steps()
        return self._recent_steps

    def forget_unmeasured(self) -> None:
        """Give up the decisions still waiting: their measurements will not come (the
        timer has none outstanding)."""
        self.unmeasured_steps += len(self._pending)
        self._pending.clear()

    # -- idle ---------------------------------------------------------------------------
    def on_idle(self) -> None:
        """No decode step is running: do the queued bookkeeping; give the trainer the level
        with the most trainer SMs."""
        if self._unrecorded:
            self.record_steps(blocking=False)
        if self.trainer is None or self._pending:
            return
        if self.trainer.scheduler_state() not in (TrainerState.RUNNING, TrainerState.STARVED):
            return
        best = max(range(len(self.levels)), key=lambda i: self.levels[i].trainer_sms)
        if self.levels[best].trainer_sms == 0:
            return
        self.level = self.partitioner.select(best)
        self.trainer.apply(True, self.level.trainer_stream)
        self.applied = (best, True)

    def apply_decision(self, index: int, run: bool) -> None:
        """A tensor-parallel rank other than 0: apply rank 0's decision (harvest.colocate.rank_sync)."""
        if (index, run) == self.applied:
            return
        self.level = self.partitioner.select(index)
        if self.trainer is not None:
            self.trainer.apply(run, self.level.trainer_stream)
        self.applied = (index, run)

    def follow(self, step: int, index: int, run: bool) -> StepPlan:
        """A tensor-parallel rank other than 0: rank 0's plan for ``step``, applied here
        (measured here and booked on rank 0, so nothing waits for it on this rank)."""
        self.apply_decision(index, run)
        return StepPlan(step, index, self.level.decode_stream, None, None, math.nan, run, None)
