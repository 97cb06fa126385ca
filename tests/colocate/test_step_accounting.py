"""The step loop's overhead accounting (``/harvest/status``): the engine's time is left
out, and each part of the control (decide before the step, feedback and lending after it)
is timed on its own, so a slow part shows where it is."""

from __future__ import annotations

import time
import types

from harvest.colocate import StepLoad
from harvest.colocate.colocation import Colocation
from harvest.colocate.status import StatusReporter
from harvest.colocate.step_profiler import HARVEST_PARTS
from harvest.colocate.step_timer import CpuStepTimer
from harvest.ladder import Ladder

# Busy-waits of clearly different lengths (a CPU-time clock counts them too; a sleep it
# would not). The engine takes longer than all of them together: it must not be counted.
DECIDE_S, FEEDBACK_S, LENDING_S, ENGINE_S = 0.002, 0.006, 0.018, 0.060


def _spin(seconds: float) -> None:
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        pass


class _Control:
    decode_stream = None
    unmeasured_steps = 0
    level = types.SimpleNamespace(index=0, decode_sms=1, trainer_sms=1)
    qos = types.SimpleNamespace(stats=lambda: types.SimpleNamespace(to_dict=dict),
                                config=types.SimpleNamespace(target_tpot_ms=40.0))
    recent_steps = ()

    def __init__(self):
        self.loads, self.measured = [], []

    def before_step(self, load):
        self.loads.append(load)
        _spin(DECIDE_S)
        return types.SimpleNamespace(step=len(self.loads))

    def after_step(self, step, measured_s):
        self.measured.append(measured_s)
        _spin(FEEDBACK_S)

    def record_steps(self):
        pass


class _Lending:
    num_lent = 0

    def after_step(self):
        _spin(LENDING_S)

    def maybe_lend(self):
        pass

    def stats(self):
        return {"chunks_total": 4, "fragmentation_bytes": 0}


def _colocation(every: int = 1) -> Colocation:
    config = types.SimpleNamespace(qos=types.SimpleNamespace(target_tpot_ms=40.0),
                                   trainer=types.SimpleNamespace(cpu_threads=1, nice=2))
    partitioner = types.SimpleNamespace(description="cpu", current_index=0, ladder=Ladder.whole_device(1, "CPU device"))
    colocation = Colocation(config=config, partitioner=partitioner,
                            control=_Control(), trainer_host=None, lending=_Lending(), timer=CpuStepTimer(), metrics=None,
                            refiner=None)
    colocation.profiler.every = every  # account every step (7 on a server)
    return colocation


def test_hook_accounting_leaves_the_engine_out_and_times_each_part():
    colocation = _colocation()

    def engine(scheduler, batch):
        _spin(ENGINE_S)
        return "result"

    results = [colocation.run_step(StepLoad(4, 400, True), engine, None, "batch") for _ in range(5)]
    status = StatusReporter(colocation).status()

    assert results == ["result"] * 5 and len(colocation.control.measured) == 5
    assert min(colocation.control.measured) >= ENGINE_S  # the step timer measured the engine
    parts = status["hook_wall_us_median_by_part"]
    assert tuple(parts) == HARVEST_PARTS == ("decide", "feedback", "lending")
    # Each part at least its own busy-wait, and under the next part's (the waits differ 3x).
    assert DECIDE_S * 1e6 <= parts["decide"] < FEEDBACK_S * 1e6 <= parts["feedback"] < LENDING_S * 1e6 <= parts["lending"]
    own = (DECIDE_S + FEEDBACK_S + LENDING_S) * 1e6
    assert own <= status["hook_wall_us_median"] < ENGINE_S * 1e6  # the engine is left out
    assert status["hook_cpu_us_median"] < ENGINE_S * 1e6
    assert status["hook_cpu_us_median"] > 0.5 * own  # busy-waits are CPU time (unless the OS took the CPU away)
    assert status["steps"] == 5


def test_only_every_nth_step_is_sampled_and_a_failed_step_is_not_counted():
    colocation = _colocation(every=3)
    for _ in range(7):
        colocation.run_step(StepLoad(1, 10, True), lambda: None)
    assert colocation.profiler.num_steps == 7 and colocation.profiler.num_sampled == 2

    def failing():
        raise RuntimeError("engine failed")

    colocation.profiler.num_steps = 2  # the next step is sampled
    try:
        colocation.run_step(StepLoad(1, 10, True), failing)
    except RuntimeError:
        pass
    assert colocation.profiler.num_sampled == 2
    # The next sampled step is accounted normally (no marks left over from the failed one).
    for _ in range(3):
        colocation.run_step(StepLoad(1, 10, True), lambda: None)
    assert colocation.profiler.num_sampled == 3


def test_nothing_sampled_reports_zeros():
    status = StatusReporter(_colocation()).status()
    assert status["hook_wall_us_median_by_part"] == {part: 0.0 for part in HARVEST_PARTS}
    assert status["steps"] == 0 and status["hook_overhead_us_per_step"] == 0.0
