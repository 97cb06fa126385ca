"""The profiling loop with a scripted engine and workload: grid order, co-run blocks,
trimming, resumability after an interruption, and failures that must stop the run."""

from __future__ import annotations

import dataclasses
import json
import math
import threading
import time

import pytest

from harvest.predict.buckets import BatchSizeBuckets
from harvest.predict.calibrate import build_profile
from harvest.ladder import Ladder, Level
from harvest.predict.profiler.corun import CoRunError, UnitLoopWorkload
from harvest.predict.profiler.engines import BaseDecodeEngine
from harvest.predict.profiler.measure import MeasureConfig, MeasurementError, kept_indices, trimmed_mean
from harvest.predict.profiler.partial import PartialRun, PartialRunError, partial_path
from harvest.predict.profiler.runner import plan_points, run_grid
from harvest.predict.profiler.trainer_alone import measure_alone, measure_section
from harvest.predict.schema import Grid
from tests.predict.synthetic import provenance

LADDER = Ladder(100, (Level(40, 60), Level(100, 0)), "green-context")
GRID = Grid((2, 8), (32, 128))
MEASURE = MeasureConfig(warmup_steps=2, timed_steps=5, trim_fraction=0.2)


class ScriptedEngine(BaseDecodeEngine):
    """Latency = b0*bs + c0 + k0*Σctx, slowed by the running workload's phase; one timed
    step in five is a 10x outlier, which trimming must remove."""

    name = "scripted"

    def __init__(self, workload):
        self.workload = workload
        self.prepared: list[tuple[int, int]] = []
        self.batch_size = self.length = 0
        self.steps = 0

    def prepare(self, batch_size, context_length):
        self.prepared.append((batch_size, context_length))
        self.batch_size, self.length = batch_size, context_length

    def begin_step(self):
        return float(self.batch_size * (self.length + 1))

    def step(self):
        # A co-run step lasts until the scripted trainer finished a unit in it: every timed
        # window holds trainer units however the threads are scheduled.
        units = self.workload.units_done
        time.sleep(0.002)
        if self.workload.running_phase is not None:
            self.workload.wait_for_unit_after(units)
        self.length += 1

    def release(self):
        pass

    def latency(self) -> float:
        self.steps += 1
        base = 1e-4 * self.batch_size + 2e-3 + 1e-7 * self.batch_size * self.length
        if self.workload.running_phase is not None:
            base *= {"forward": 1.5, "backward": 1.2}[self.workload.running_phase]
        return base * (10.0 if self.steps % 5 == 0 else 1.0)


class ScriptedTimer:
    name = "scripted"

    def __init__(self, engine, nan_at: int | None = None):
        self.engine, self.nan_at, self.calls = engine, nan_at, 0

    def time(self, step):
        self.calls += 1
        before = self.engine.length
        step()
        assert self.engine.length == before + 1
        if self.calls == self.nan_at:
            return math.nan
        return self.engine.latency()


class ScriptedWorkload(UnitLoopWorkload):
    """Units of 1 ms, always one in flight; an engine step waits for one
    (``wait_for_unit_after``). The thread keeps its priority."""

    name = "scripted"
    description = "scripted units"
    base_model = "none"
    phases = ("forward", "backward")
    nice = 0

    def __init__(self, fail_after: int | None = None):
        super().__init__()
        self.running_phase = None
        self.fail_after = fail_after
        self.started: list[str] = []

    def start(self, phase, stream=None):
        self.started.append(phase)
        super().start(phase, stream)
        self.running_phase = phase

    def stop(self):
        self.running_phase = None
        super().stop()

    @property
    def tokens_per_unit(self) -> float:
        return 96.0

    def run_unit(self, phase):
        if self.fail_after is not None and self.units_done >= self.fail_after:
            raise RuntimeError("trainer exploded")
        time.sleep(0.001)


def _run(engine, workload, timer, done=(), on_record=None):
    records = []

    def keep(record):
        records.append(record)
        if on_record:
            on_record(record)

    return run_grid(engine, workload, LADDER, GRID, MEASURE, timer, list(done), keep), records


def test_trimmed_mean_drops_both_tails():
    values = [1.0, 1.1, 0.9, 50.0, 1.0, 0.01, 1.05, 0.95, 1.0, 1.0]
    assert kept_indices(values, 0.2) == [0, 4, 6, 7, 8, 9]  # 2 cut from each end, order kept
    assert trimmed_mean(values, 0.2) == pytest.approx(1.0, abs=0.02)
    assert trimmed_mean([2.0], 0.4) == 2.0 and trimmed_mean([1.0, 3.0], 0.0) == 2.0


@pytest.mark.parametrize("kwargs, message", [({"warmup_steps": -1}, "--warmup"), ({"timed_steps": 0}, "--repeats"), ({"trim_fraction": 0.5}, "--trim")])
def test_measure_config_is_validated(kwargs, message):
    with pytest.raises(ValueError, match=message):
        MeasureConfig(**kwargs)


def test_plan_covers_every_level_solo_and_co_run_only_where_the_trainer_has_sms():
    points = plan_points(LADDER, GRID, ("forward", "backward"))
    blocks = [(p.level, p.stage, p.phase) for p in points[::4]]
    assert blocks == [(0, "solo", None), (0, "corun", "forward"), (0, "corun", "backward"), (1, "solo", None)]
    assert len(points) == 16


@pytest.mark.timeout(60)
def test_grid_is_measured_trimmed_and_fits():
    workload = ScriptedWorkload()
    engine = ScriptedEngine(workload)
    result, saved = _run(engine, workload, ScriptedTimer(engine))
    assert len(result) == 16 and saved == result
    assert workload.started == ["forward", "backward"]  # one start per co-run block
    assert len(engine.prepared) == 16
    for record in result:
        assert len(record.step_latencies_s) == 5
        # The 10x outlier steps are trimmed away: the mean is within the clean steps' spread.
        clean = sorted(record.step_latencies_s)[:4]
        assert min(clean) <= record.latency_s <= max(clean)
        assert record.sum_context == pytest.approx(record.batch_size * (record.context_length + 3 + 2.5), rel=0.2)
        if record.stage == "corun":
            assert record.trainer_units is not None and record.trainer_units >= 1  # ran concurrently
            # the units' wall window: the timed steps and the host's work between them
            assert record.trainer_window_s is not None and record.trainer_window_s > 0
        else:
            assert record.trainer_window_s is None
    profile = build_profile(provenance(LADDER), LADDER, BatchSizeBuckets(), GRID, result)
    assert profile.stage1[1].quality.mape < 0.05


@pytest.mark.timeout(60)
def test_trainer_alone_stage_measures_each_trainer_level_and_the_whole_device_in_each_phase():
    workload = ScriptedWorkload()
    seen = []
    section = measure_section(workload, LADDER, 0.05, seen.append)
    # Level 1 gives the trainer no SMs; no level gives it all 100, so the whole device is measured apart.
    assert [(r.level, r.phase) for r in section.alone] == [(0, "forward"), (0, "backward"), (None, "forward"), (None, "backward")]
    assert list(section.alone) == seen and workload.started == ["forward", "backward"] * 2
    assert section.whole_device_level is None and section.tokens_per_unit == 96.0 and section.seconds_per_phase == 0.05
    for record in section.alone:
        assert record.seconds >= 0.05 and record.units >= 1
        # Each unit sleeps 1 ms: the count is of units in the window (all of each but the
        # first, which may have begun before it).
        assert record.units <= record.seconds / 0.001 + 1
    profile = build_profile(provenance(LADDER), LADDER, BatchSizeBuckets(), GRID, _grid(), section)
    assert profile.trainer == section


def test_trainer_alone_stage_uses_the_level_that_gives_the_trainer_every_sm():
    shared = Ladder(1, (Level(1, 1),), "whole-device")
    section = measure_section(ScriptedWorkload(), shared, 0.02)
    assert section.whole_device_level == 0 and [r.level for r in section.alone] == [0, 0]
    with pytest.raises(ValueError, match="--trainer-alone-s=0"):
        measure_section(ScriptedWorkload(), shared, 0)


class _HeldAfterWarmup(threading.Event):
    """The loop's stop flag, whose second check (the one after the warm-up unit) takes
    0.2 s: a thread the host did not run between two units."""

    def __init__(self):
        super().__init__()
        self.checks = 0

    def is_set(self):
        self.checks += 1
        if self.checks == 2:
            time.sleep(0.2)
        return super().is_set()


def test_a_trainer_alone_window_ends_with_a_unit_even_if_the_thread_did_not_run_in_it():
    workload = ScriptedWorkload()
    workload._stop_event = _HeldAfterWarmup()
    record = measure_alone(workload, None, None, "forward", 0.02)
    # Time was up while the thread sat between units; the window waited for the next one.
    # Counting none would give the replay a whole-device rate of zero to divide by.
    assert record.units >= 1 and record.seconds >= 0.02


def test_a_unit_that_fails_after_the_trainer_alone_window_fails_the_stage():
    shared = Ladder(1, (Level(1, 1),), "whole-device")
    with pytest.raises(CoRunError, match="trainer exploded"):
        measure_section(ScriptedWorkload(fail_after=1), shared, 0.02)


def _grid():
    workload = ScriptedWorkload()
    engine = ScriptedEngine(workload)
    return _run(engine, workload, ScriptedTimer(engine))[0]


def _write_partial(path, identity, records) -> None:
    """An interrupted run's file holding ``records``."""
    run = PartialRun(path, identity)
    run.open()
    for record in records:
        run.append(record)
    run.close()


@pytest.mark.timeout(60)
def test_interrupted_run_resumes_without_remeasuring(tmp_path):
    path = partial_path(tmp_path / "p.json")
    identity = {"model": "m", "grid": [[2, 8], [32, 128]]}
    run = PartialRun(path, identity)
    assert run.open() == []
    workload = ScriptedWorkload()
    engine = ScriptedEngine(workload)

    class Interrupt(BaseException):
        pass

    def persist_then_die(record):
        run.append(record)
        if len(engine.prepared) == 6:
            raise Interrupt

    with pytest.raises(Interrupt):
        _run(engine, workload, ScriptedTimer(engine), on_record=persist_then_die)
    run.close()
    assert workload.running_phase is None and workload._thread is None  # the co-run thread was stopped

    resumed = PartialRun(path, {"grid": [[2, 8], [32, 128]], "model": "m"})  # same identity, other key order
    done = resumed.open()
    assert len(done) == 6
    workload2 = ScriptedWorkload()
    engine2 = ScriptedEngine(workload2)
    result, _ = _run(engine2, workload2, ScriptedTimer(engine2), done=done, on_record=resumed.append)
    assert len(engine2.prepared) == 10 and len(result) == 16
    assert result[:6] == done
    resumed.finish()
    assert not path.exists()


def test_an_interrupted_run_written_before_an_optional_field_resumes(tmp_path):
    """A partial file of an older harvest (its co-run lines without trainer_window_s) is
    resumed, the field read as not recorded, not refused."""
    path = tmp_path / "p.partial.jsonl"
    corun = [r for r in _grid() if r.stage == "corun"][:2]
    _write_partial(path, {"k": 1}, corun)
    lines = path.read_text().splitlines()
    older = [lines[0]] + [json.dumps({k: v for k, v in json.loads(line).items() if k != "trainer_window_s"})
                          for line in lines[1:]]
    path.write_text("\n".join(older) + "\n")
    done = PartialRun(path, {"k": 1}).open()
    assert [dataclasses.replace(r, trainer_window_s=None) for r in corun] == done


def test_partial_file_from_other_settings_is_refused_naming_them(tmp_path):
    path = tmp_path / "p.partial.jsonl"
    PartialRun(path, {"model": "a", "repeats": 10, "grid": [1]}).open()
    with pytest.raises(PartialRunError, match=r"different settings \(model, repeats\).*--restart"):
        PartialRun(path, {"model": "b", "repeats": 5, "grid": [1]}).open()
    assert PartialRun(path, {"model": "b", "repeats": 5, "grid": [1]}).open(restart=True) == []


def test_partial_file_tolerates_only_a_torn_last_line(tmp_path):
    path = tmp_path / "p.partial.jsonl"
    _write_partial(path, {"k": 1}, _grid()[:3])
    text = path.read_text()
    path.write_text(text + text.splitlines()[1][:40])  # a kill in the middle of a write
    assert len(PartialRun(path, {"k": 1}).open()) == 3
    lines = path.read_text().splitlines()
    assert len(lines) == 4 and json.loads(lines[-1])["level"] == 0  # the torn line was dropped
    path.write_text("\n".join([lines[0], "{broken", lines[1]]) + "\n")
    with pytest.raises(PartialRunError, match="line 2"):
        PartialRun(path, {"k": 1}).open()


@pytest.mark.timeout(60)
def test_nan_step_time_stops_the_run_naming_the_point():
    workload = ScriptedWorkload()
    engine = ScriptedEngine(workload)
    with pytest.raises(MeasurementError, match=r"level 0 solo bs=2 ctx=128: step time nan"):
        _run(engine, workload, ScriptedTimer(engine, nan_at=7))


@pytest.mark.timeout(60)
def test_a_failing_workload_stops_the_run():
    workload = ScriptedWorkload(fail_after=3)
    engine = ScriptedEngine(workload)
    with pytest.raises(CoRunError, match="trainer exploded"):
        _run(engine, workload, ScriptedTimer(engine))
    assert workload._thread is None
