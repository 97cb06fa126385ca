"""The profiling loop: every ladder level x (solo, each trainer phase) x batch size x
context length, one grid point at a time, each saved the moment it is measured.

Order: per level, the solo block, then one co-run block per trainer phase with the
workload started once for the whole block (starting it costs a warm-up unit). A grid
point is: prefill ``batch_size`` requests of ``context_length`` tokens (not timed),
``warmup_steps`` decode steps, then ``timed_steps`` timed ones, each on the level's
decode stream while the workload runs on the level's trainer stream.
"""

from __future__ import annotations

import contextlib
import dataclasses
import time
from typing import Any, Callable, Sequence

from harvest.ladder import Ladder
from harvest.logs import get_logger
from harvest.predict.profiler.engines import BaseDecodeEngine
from harvest.predict.profiler.measure import MeasureConfig, check_latency, kept_indices, trimmed_mean
from harvest.predict.profiler.partial import grid_key
from harvest.predict.schema import Grid, GridPointRecord

logger = get_logger(__name__)


@dataclasses.dataclass(frozen=True)
class PointSpec:
    level: int
    stage: str
    phase: str | None
    batch_size: int
    context_length: int


def plan_points(ladder: Ladder, grid: Grid, phases: Sequence[str]) -> list[PointSpec]:
    """Every grid point of every level; co-run blocks only where the trainer has SMs."""
    points = []
    for index, level in enumerate(ladder.levels):
        blocks = [("solo", None)] + ([("corun", phase) for phase in phases] if level.runs_trainer else [])
        for stage, phase in blocks:
            for batch_size in grid.batch_sizes:
                for context_length in grid.context_lengths:
                    points.append(PointSpec(index, stage, phase, batch_size, context_length))
    return points


def _stream_context(stream: Any):
    if stream is None:
        return contextlib.nullcontext()
    import torch

    return torch.cuda.stream(stream)


def measure_point(engine: BaseDecodeEngine, timer, point: PointSpec, measure: MeasureConfig, units_done: Callable[[], int] | None) -> GridPointRecord:
    where = f"level {point.level} {point.stage}{'/' + point.phase if point.phase else ''} bs={point.batch_size} ctx={point.context_length}"
    engine.prepare(point.batch_size, point.context_length)
    try:
        for _ in range(measure.warmup_steps):
            engine.begin_step()
            engine.step()
        units_before = units_done() if units_done else None
        window_started = time.perf_counter()
        latencies, sums = [], []
        for _ in range(measure.timed_steps):
            sums.append(engine.begin_step())
            latencies.append(check_latency(timer.time(engine.step), where))
        units = units_done() - units_before if units_done else None
        # The units were counted over this wall span, the host's work between the steps
        # included: over the steps' summed latencies alone their rate reads high.
        window_s = time.perf_counter() - window_started if units_done else None
    finally:
        engine.release()
    kept = kept_indices(latencies, measure.trim_fraction)
    return GridPointRecord(
        level=point.level,
        stage=point.stage,
        phase=point.phase,
        batch_size=point.batch_size,
        context_length=point.context_length,
        sum_context=sum(sums[i] for i in kept) / len(kept),
        latency_s=trimmed_mean(latencies, measure.trim_fraction),
        step_latencies_s=tuple(latencies),
        step_sum_contexts=tuple(sums),
        trainer_units=units,
        trainer_window_s=window_s,
    )


def run_grid(
    engine: BaseDecodeEngine,
    workload,
    ladder: Ladder,
    grid: Grid,
    measure: MeasureConfig,
    timer,
    done: Sequence[GridPointRecord],
    on_record: Callable[[GridPointRecord], None],
    progress=None,
) -> list[GridPointRecord]:
    """Measure every grid point not in ``done`` on ``ladder``'s streams (the partitioner's
    built ladder); ``on_record`` persists each one."""
    records = {grid_key(r): r for r in done}
    todo = [p for p in plan_points(ladder, grid, workload.phases) if grid_key(p) not in records]
    by_block: dict[tuple, list[PointSpec]] = {}
    for point in todo:
        by_block.setdefault((point.level, point.stage, point.phase), []).append(point)
    for (level_index, stage, phase), points in by_block.items():
        level = ladder.levels[level_index]
        if progress is not None:
            progress.set_description(f"level {level_index} {stage}{'/' + phase if phase else ''}")
        running = stage == "corun"
        if running:
            workload.start(phase, level.trainer_stream)  # its thread enters the trainer stream itself
        try:
            with _stream_context(level.decode_stream):
                for point in points:
                    record = measure_point(engine, timer, point, measure, (lambda: workload.units_done) if running else None)
                    if running and record.trainer_units == 0:
                        logger.warning(
                            "level %d %s bs=%d ctx=%d: no trainer unit finished during the timed steps (units longer "
                            "than %d steps?)", level_index, phase, point.batch_size, point.context_length, measure.timed_steps,
                        )
                    records[grid_key(record)] = record
                    on_record(record)
                    if progress is not None:
                        progress.update(1)
        finally:
            if running:
                workload.stop()
    ordered = plan_points(ladder, grid, workload.phases)
    return [records[grid_key(p)] for p in ordered if grid_key(p) in records]
