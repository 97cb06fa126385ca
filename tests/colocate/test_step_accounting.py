"""The step loop's overhead accounting (``/harvest/status``): the engine's time is left
out, and each part of the control (decide before the step, feedback and lending after it)
is timed on its own, so a slow part shows where it is."""

from __future__ import annotations

import time
import types

from harvest.colocate import StepLoad
from harvest.colocate.colocation import Colocation
from harvest.colocate.status import StatusReporter
from harvest.colocate.step_profiler import HARVEST_PARTS, StepProfiler
from harvest.colocate.step_timer import CpuStepTimer
from harvest.ladder import Ladder

# What each part costs on the profiler's (fake) clocks, µs: (wall, thread CPU). Every
# figure differs, and the engine costs more than the rest together: it must not be counted.
DECIDE_US, FEEDBACK_US, LENDING_US, ENGINE_US = (2000, 1500), (6000, 5000), (18000, 17000), (60000, 60000)
ENGINE_SLEEP_S = 0.005  # the engine's real time too, for the step timer (it reads the real clock)


class _Clock:
    """The step profiler's wall and thread-CPU clocks, advanced only by the doubles."""

    def __init__(self):
        self.wall, self.cpu = 10**12, 10**9

    def wall_ns(self) -> int:
        return self.wall

    def cpu_ns(self) -> int:
        return self.cpu

    def spend(self, cost_us: tuple[int, int]) -> None:
        wall_us, cpu_us = cost_us
        self.wall += wall_us * 1000
        self.cpu += cpu_us * 1000


class _Control:
    unmeasured_steps = 0
    level = types.SimpleNamespace(index=0, decode_sms=1, trainer_sms=1)
    qos = types.SimpleNamespace(stats=lambda: types.SimpleNamespace(to_dict=dict),
                                config=types.SimpleNamespace(target_tpot_ms=40.0))
    recent_steps = ()

    def __init__(self, clock: _Clock):
        self.clock = clock
        self.loads, self.measured = [], []

    def before_step(self, load):
        self.loads.append(load)
        self.clock.spend(DECIDE_US)
        return types.SimpleNamespace(step=len(self.loads), level=0, stream=None)

    def after_step(self, step, measured_s):
        self.measured.append(measured_s)
        self.clock.spend(FEEDBACK_US)

    def record_steps(self):
        pass


class _Lending:
    num_lent = 0

    def __init__(self, clock: _Clock):
        self.clock = clock

    def after_step(self):
        self.clock.spend(LENDING_US)

    def maybe_lend(self):
        pass

    def stats(self):
        return {"chunks_total": 4, "fragmentation_bytes": 0}


def _colocation(every: int = 1) -> Colocation:
    config = types.SimpleNamespace(qos=types.SimpleNamespace(target_tpot_ms=40.0),
                                   trainer=types.SimpleNamespace(cpu_threads=1, nice=2))
    partitioner = types.SimpleNamespace(description="cpu", current_index=0, ladder=Ladder.whole_device(1, "CPU device"))
    clock = _Clock()
    colocation = Colocation(config=config, partitioner=partitioner,
                            step_controller=_Control(clock), trainer_host=None, lending=_Lending(clock), timer=CpuStepTimer(),
                            metrics=None, refiner=None)
    # Account every step (7 on a server), on the doubles' clocks.
    colocation.profiler = StepProfiler(every=every, wall_ns=clock.wall_ns, cpu_ns=clock.cpu_ns)
    return colocation


def test_hook_accounting_leaves_the_engine_out_and_times_each_part():
    colocation = _colocation()
    clock = colocation.step_controller.clock

    def engine(scheduler, batch):
        clock.spend(ENGINE_US)
        time.sleep(ENGINE_SLEEP_S)
        return "result"

    results = [colocation.run_step(StepLoad(4, 400, True), engine, None, "batch") for _ in range(5)]
    status = StatusReporter(colocation).status()

    assert results == ["result"] * 5 and len(colocation.step_controller.measured) == 5
    assert min(colocation.step_controller.measured) >= ENGINE_SLEEP_S  # the step timer measured the engine
    # Each part's wall time in its own bucket; the engine's time (wall and CPU) in none.
    parts = status["hook_wall_us_median_by_part"]
    assert tuple(parts) == HARVEST_PARTS == ("decide", "feedback", "lending")
    assert parts == {"decide": DECIDE_US[0], "feedback": FEEDBACK_US[0], "lending": LENDING_US[0]}
    wall_us = DECIDE_US[0] + FEEDBACK_US[0] + LENDING_US[0]
    cpu_us = DECIDE_US[1] + FEEDBACK_US[1] + LENDING_US[1]
    assert status["hook_wall_us_median"] == status["hook_overhead_us_per_step"] == wall_us
    assert status["hook_cpu_us_median"] == status["hook_cpu_us_per_step"] == cpu_us
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
