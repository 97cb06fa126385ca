"""The trainer-alone stage: the co-run workload's rate with no decode running.

Replay (``harvest.replay.trainer_model``) turns the co-run points' trainer units into a
fraction of the finetune job's rate on a whole device, which needs that rate and each
level's alone rate as a reference. For each level whose trainer has SMs, and for the
whole device (the level giving the trainer every SM if there is one, else the device
outside the ladder), the workload runs held in each of its phases on that trainer
stream for ``seconds_per_phase``. The window runs from when ``start`` returns (the first
unit, the warm-up, has ended) to the end of the unit in flight when time is up, so it
holds at least one unit however a loaded host schedules the workload's thread: a
whole-device rate of zero would leave the replay nothing to divide by. Not resumable: a
resumed run measures this stage again (seconds per level and phase).
"""

from __future__ import annotations

import time

from harvest.ladder import Ladder
from harvest.predict.profiler.corun import CoRunError
from harvest.predict.schema import TrainerAloneRecord, TrainerSection


def measure_alone(workload, level: int | None, stream, phase: str, seconds: float) -> TrainerAloneRecord:
    workload.start(phase, stream)
    try:
        units_before, start = workload.units_done, time.perf_counter()
        time.sleep(seconds)
        # Counted where a unit ends: the one in flight now, or, if the thread was between
        # units, the next (a loaded host may not have run the thread at all since start).
        ended = workload.wait_for_unit_after(workload.units_done)
        units, elapsed = workload.units_done - units_before, time.perf_counter() - start
    finally:
        workload.stop()  # re-raises the workload's failure, if that is what ended the wait
    if not ended:
        where = "the whole device" if level is None else f"level {level}"
        raise CoRunError(f"{workload.name}: the unit in flight when its {seconds:g} s alone on {where} ({phase}) was up "
                         "did not end within the workload's time limit for a unit")
    return TrainerAloneRecord(level=level, phase=phase, units=units, seconds=elapsed)


def measure_section(workload, ladder: Ladder, seconds_per_phase: float, on_record=None) -> TrainerSection:
    """Measure every trainer level of ``ladder`` (the partitioner's, with its streams) and
    the whole device; ``on_record`` sees each record."""
    if not seconds_per_phase > 0:
        raise ValueError(f"--trainer-alone-s={seconds_per_phase!r}: must be > 0")
    levels = list(enumerate(ladder.levels))
    whole = next((i for i, lv in levels if lv.trainer_sms == ladder.total_sms), None)
    targets = [(i, lv.trainer_stream) for i, lv in levels if lv.runs_trainer]
    if whole is None:
        targets.append((None, None))  # the current stream, outside any partition: the whole device
    records = []
    for level, stream in targets:
        for phase in workload.phases:
            record = measure_alone(workload, level, stream, phase, seconds_per_phase)
            records.append(record)
            if on_record is not None:
                on_record(record)
    return TrainerSection(
        tokens_per_unit=float(workload.tokens_per_unit),
        seconds_per_phase=float(seconds_per_phase),
        whole_device_level=whole,
        alone=tuple(records),
    )
