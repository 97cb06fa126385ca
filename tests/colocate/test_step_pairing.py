"""Measurements stay paired with their step, by construction: a CUDA-event timer that
drops measurements (too many pending) or an engine step that raises costs those steps'
feedback, never the alignment of the steps after them. The CUDA timer runs here on a
fake ``torch.cuda`` that completes events when told to and records the stream calls."""

from __future__ import annotations

import types

import pytest

from harvest.colocate import StepController, StepLoad
from harvest.colocate.colocation import Colocation, NoKvLending
from harvest.colocate.step_timer import CpuStepTimer, CudaStepTimer
from harvest.compute import create_partitioner
from harvest.schedule import QoSController, SchedulerConfig

LOAD = StepLoad(4, 400, True)


class FakeCuda:
    """The slice of torch.cuda the timer uses. Each ``end.record`` notes the step being
    recorded; an event completes when the test says its step finished on the device."""

    def __init__(self):
        self.calls: list[tuple] = []
        self.finished: set[int] = set()  # steps (by recording order) the "device" finished
        self.recording = 0  # the step number being recorded (set by the test's engine)
        self.device_ms: dict[int, float] = {}
        self._current = FakeStream("engine", self)
        self.engine = self._current

    def Event(self, enable_timing=False):  # noqa: N802 - torch's name
        return FakeEvent(self)

    def current_stream(self):
        return self._current

    def stream(self, stream):
        cuda = self

        class _Context:
            def __enter__(self):
                self.previous, cuda._current = cuda._current, stream
                cuda.calls.append(("enter", stream.name))

            def __exit__(self, *exc):
                cuda._current = self.previous
                cuda.calls.append(("exit", stream.name))

        return _Context()


class FakeStream:
    def __init__(self, name, cuda):
        self.name, self.cuda = name, cuda

    def wait_event(self, event):
        self.cuda.calls.append(("wait", self.name, event.recorded_on))


class FakeEvent:
    def __init__(self, cuda):
        self.cuda = cuda
        self.step = None
        self.recorded_on = None

    def record(self, stream=None):
        self.step = self.cuda.recording
        self.recorded_on = (stream or self.cuda.current_stream()).name
        self.cuda.calls.append(("record", self.recorded_on))

    def query(self):
        return self.step in self.cuda.finished

    def elapsed_time(self, end):
        return self.cuda.device_ms[end.step]


def controller():
    partitioner = create_partitioner("cpu")
    qos = QoSController(SchedulerConfig(target_tpot_ms=50.0), partitioner.ladder)
    return StepController(partitioner=partitioner, qos=qos, trainer_host=None, target_tpot_ms=50.0)


def colocation(timer, *, places_forward=False):
    config = types.SimpleNamespace(qos=types.SimpleNamespace(target_tpot_ms=50.0),
                                   trainer=types.SimpleNamespace(cpu_threads=1, nice=2))
    control = controller()
    return Colocation(config=config, partitioner=control.partitioner, step_controller=control, trainer_host=None,
                      lending=NoKvLending(), timer=timer, metrics=None, refiner=None,
                      engine_places_forward=places_forward)


def measured_by_step(colo):
    """{step number (1-based, in order): measured ms} of the recorded steps."""
    return [round(record.measured_ms, 3) for record in colo.step_controller.recent_steps]


def test_a_timer_that_drops_the_oldest_keeps_every_later_step_paired():
    cuda = FakeCuda()
    timer = CudaStepTimer(max_pending=2, cuda=cuda)
    colo = colocation(timer)
    # Steps 1..6 launched while the device finishes none: the timer has events for two
    # pending steps, so it drops the oldest measurement twice... four times.
    for step in range(1, 7):
        cuda.recording = step
        cuda.device_ms[step] = float(step)  # step k took k ms
        colo.run_step(LOAD, lambda: None)
    assert timer.dropped == 4 and timer.outstanding == 2
    cuda.finished.update(range(1, 7))
    colo.on_idle()
    # Only steps 5 and 6 were measured, each with its own latency; 1-4 were given up.
    assert measured_by_step(colo) == [5.0, 6.0]
    assert colo.step_controller.unmeasured_steps == 4
    # And the pairing holds from then on.
    for step in range(7, 10):
        cuda.recording = step
        cuda.device_ms[step] = float(step)
        colo.run_step(LOAD, lambda: None)
        cuda.finished.add(step)
    colo.on_idle()
    assert measured_by_step(colo) == [5.0, 6.0, 7.0, 8.0, 9.0]


def test_a_step_that_raises_is_not_measured_and_does_not_shift_the_others():
    cuda = FakeCuda()
    colo = colocation(CudaStepTimer(max_pending=8, cuda=cuda))

    def engine(fail):
        if fail:
            raise RuntimeError("engine step failed")

    for step, fail in enumerate([False, True, False, True, False], start=1):
        cuda.recording = step
        cuda.device_ms[step] = float(step)
        if fail:
            with pytest.raises(RuntimeError):
                colo.run_step(LOAD, engine, fail)
        else:
            colo.run_step(LOAD, engine, fail)
        cuda.finished.add(step)
    colo.on_idle()
    assert measured_by_step(colo) == [1.0, 3.0, 5.0]
    assert colo.step_controller.unmeasured_steps == 2


def test_the_cpu_timer_pairs_the_same_way_when_the_engine_raises():
    colo = colocation(CpuStepTimer())
    calls = []

    def engine(fail):
        calls.append(fail)
        if fail:
            raise ValueError("bad batch")

    for fail in [False, True, True, False]:
        if fail:
            with pytest.raises(ValueError):
                colo.run_step(LOAD, engine, fail)
        else:
            colo.run_step(LOAD, engine, fail)
    colo.on_idle()
    records = colo.step_controller.recent_steps
    assert len(records) == 2 and colo.step_controller.unmeasured_steps == 2
    assert colo.step_controller.qos.stats().num_measurements == 2  # each the latest decision's


def test_the_step_runs_on_the_level_stream_ordered_both_ways_with_the_engine_stream():
    cuda = FakeCuda()
    timer = CudaStepTimer(max_pending=4, cuda=cuda)
    level_stream = FakeStream("level", cuda)
    cuda.calls.clear()
    timer.time(1, level_stream, lambda: cuda.calls.append(("kernel", cuda.current_stream().name)))
    assert cuda.calls == [
        ("record", "engine"), ("wait", "level", "engine"),  # inputs queued on the engine stream first
        ("enter", "level"), ("record", "level"), ("kernel", "level"), ("record", "level"), ("exit", "level"),
        ("record", "level"), ("wait", "engine", "level"),  # the engine stream waits for the step
    ]
    # A step that raises still hands its queued work back to the engine stream.
    cuda.calls.clear()
    with pytest.raises(KeyError):
        timer.time(2, level_stream, lambda: {}["missing"])
    assert cuda.calls[-2:] == [("record", "level"), ("wait", "engine", "level")]
    assert timer.outstanding == 1  # only step 1's measurement


def test_an_engine_that_places_the_forward_times_only_the_steps_forward():
    cuda = FakeCuda()
    colo = colocation(CudaStepTimer(max_pending=4, cuda=cuda), places_forward=True)
    forwards = []

    def forward(n):
        forwards.append((n, colo.forward_pending))

    def scheduler_step(step):
        colo.run_forward(forward, "before-step?")  # never inside: the step has not begun
        cuda.recording = step
        cuda.device_ms[step] = 2.0 * step
        return colo.run_step(LOAD, lambda: (colo.run_forward(forward, "first"), colo.run_forward(forward, "second")))

    for step in (1, 2, 3):
        scheduler_step(step)
        cuda.finished.add(step)
    colo.on_idle()
    assert measured_by_step(colo) == [2.0, 4.0, 6.0]  # one measurement per step: its first forward
    assert colo.forward_pending is False
    assert [n for n, _ in forwards][:3] == ["before-step?", "first", "second"]


def test_a_controller_never_holds_more_than_its_bound_of_unmeasured_decisions():
    control = controller()
    for _ in range(control.MAX_UNMEASURED + 10):
        control.before_step(LOAD)
    assert len(control._pending) == control.MAX_UNMEASURED and control.unmeasured_steps == 10
    control.forget_unmeasured()
    assert control.unmeasured_steps == control.MAX_UNMEASURED + 10
