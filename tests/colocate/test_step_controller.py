"""StepController, the per-step loop, without a serving engine: one shared CPU level, a
predictor with known coefficients and a scripted trainer host."""

from __future__ import annotations

import math

import pytest

from harvest.colocate import StepController, StepLoad
from harvest.compute import create_partitioner
from harvest.predict.buckets import BatchSizeBuckets
from harvest.ladder import Ladder
from harvest.predict.latency_model import CoRunCoefficients, LatencyPredictor, ProfiledRange, SoloCoefficients
from harvest.schedule import DecisionReason, QoSController, SchedulerConfig, TrainerAction, TrainerState

# Solo step: 1 ms + 0.1 ms per request. Co-located: x1.2 backward, x2.0 forward.
SOLO = SoloCoefficients(b0=1e-4, c0=1e-3, k0=0.0)


class ScriptedHost:
    def __init__(self, state=TrainerState.RUNNING, phase="backward"):
        self.trainer = None
        self.state, self.phase = state, phase
        self.applied = []

    def scheduler_state(self):
        return self.state

    def next_phase(self):
        return self.phase

    def apply(self, run, stream=None):
        self.applied.append(run)


def controller(target_ms, host, phases=True, margin=0.05):
    partitioner = create_partitioner("cpu")
    ladder = Ladder.whole_device(1)
    by_phase = {"forward": CoRunCoefficients(1.0, 1.0), "backward": CoRunCoefficients(0.6, 0.6)} if phases else None
    predictor = LatencyPredictor(ladder, BatchSizeBuckets(), [SOLO], CoRunCoefficients(0.8, 0.8),
                                 ProfiledRange(1, 64, 0.0, 1e6), corun_by_phase=by_phase)
    qos = QoSController(SchedulerConfig(target_tpot_ms=target_ms, initial_margin=margin, hysteresis_steps=1), partitioner.ladder)
    return StepController(partitioner=partitioner, qos=qos, trainer_host=host, predictor=predictor, target_tpot_ms=target_ms)


def run_steps(control, n, measured_s=0.002, load=StepLoad(10, 500, True)):
    decisions = []
    for _ in range(n):
        plan = control.before_step(load)
        decisions.append(plan.decision)
        control.after_step(plan.step, measured_s)
    return decisions


def test_worst_phase_decides_even_when_the_next_unit_is_the_cheap_one():
    # bs 10: solo 2 ms; backward 2.4 ms, forward 4.0 ms. Target 4 ms x 0.95 = 3.8 ms: only
    # the backward model fits, but a forward unit may run during the step -> no co-location.
    host = ScriptedHost(phase="backward")
    decisions = run_steps(controller(4.0, host), 5)
    assert all(d.trainer_action is TrainerAction.PAUSE for d in decisions)
    assert decisions[-1].reason is DecisionReason.NONE_FITS
    # With room for the forward model too, the trainer runs (after the hysteresis step).
    host = ScriptedHost(phase="backward")
    decisions = run_steps(controller(5.0, host), 5)
    assert decisions[-1].trainer_action is TrainerAction.RUN
    assert decisions[-1].predicted_ms == pytest.approx(4.0)
    assert host.applied[-1] is True


def test_combined_model_when_the_profile_has_no_phases():
    host = ScriptedHost()
    decisions = run_steps(controller(5.0, host, phases=False), 4)
    assert decisions[-1].trainer_action is TrainerAction.RUN
    assert decisions[-1].predicted_ms == pytest.approx(3.2)  # 2 ms x 1.6


@pytest.mark.parametrize("state", [TrainerState.STARVED, TrainerState.PAUSED, TrainerState.STOPPED, TrainerState.ABSENT])
def test_a_trainer_that_cannot_run_gets_nothing(state):
    host = ScriptedHost(state=state)
    decisions = run_steps(controller(50.0, host), 3)
    assert all(d.trainer_action is TrainerAction.PAUSE for d in decisions)
    assert host.applied == [False] * 3


def test_prefill_steps_are_never_co_located():
    host = ScriptedHost()
    decisions = run_steps(controller(50.0, host), 4, load=StepLoad(3, 900, False))
    assert all(d.trainer_action is TrainerAction.PAUSE for d in decisions)


def test_late_measurements_feed_metrics_not_the_scheduler():
    host = ScriptedHost()
    control = controller(5.0, host)
    load = StepLoad(10, 500, True)
    first = control.before_step(load)
    second = control.before_step(load)  # the first step's measurement has not arrived yet (CUDA events)
    control.after_step(first.step, 0.002)  # the first step's: superseded for the scheduler
    assert control.qos.stats().num_measurements == 0
    control.after_step(second.step, 0.002)  # the latest decision's
    assert control.qos.stats().num_measurements == 1
    assert len(control.recent_steps) == 2 and control.num_steps == 2


def test_on_idle_gives_the_trainer_the_device():
    host = ScriptedHost()
    control = controller(4.0, host)
    run_steps(control, 3)  # nothing fits: paused
    assert host.applied[-1] is False
    control.on_idle()
    assert host.applied[-1] is True
    host.state = TrainerState.STOPPED
    host.applied.clear()
    control.on_idle()
    assert host.applied == []


def test_nan_free_predictions_and_record_fields():
    host = ScriptedHost()
    control = controller(5.0, host)
    run_steps(control, 3, measured_s=0.0031)
    record = control.recent_steps[-1]
    assert record.batch_size == 10 and record.measured_ms == pytest.approx(3.1)
    assert not math.isnan(record.predicted_ms)


class RecordingRefiner:
    def __init__(self):
        self.seen = []

    def observe(self, level, batch_size, sum_context, latency_s, phase=None, predicted_s=None):
        self.seen.append((phase, predicted_s))


def test_the_online_predictor_gets_the_phase_only_when_the_trainer_ran_and_the_prediction_in_force():
    # Target 4 ms: nothing fits, the trainer pauses: a solo step, predicted 2 ms (bs 10).
    control = controller(4.0, ScriptedHost(phase="forward"))
    control.refiner = refiner = RecordingRefiner()
    run_steps(control, 2)
    control.record_steps()
    assert refiner.seen == [(None, pytest.approx(0.002))] * 2
    # Target 5 ms: the trainer runs (hysteresis 1), beside the unit it runs next; the step
    # is predicted with the worst phase's model (4 ms).
    control = controller(5.0, ScriptedHost(phase="forward"))
    control.refiner = refiner = RecordingRefiner()
    decisions = run_steps(control, 3)
    control.record_steps()
    assert all(d.trainer_action is TrainerAction.RUN for d in decisions)
    assert refiner.seen == [("forward", pytest.approx(0.004))] * 3
