"""Timing decode steps: timers, measurement settings and outlier trimming.

GPU steps are timed with CUDA events on the step's stream (the device's own clock, no
host-side jitter); CPU steps with ``time.perf_counter_ns``. A grid point is the trimmed
mean of its timed steps: the slowest and fastest ``trim_fraction`` are dropped, because
a shared machine (other processes, a page fault, the GIL handed to another thread at
the wrong moment) produces rare steps many times slower than the rest, and one such
step in ten would move a plain mean by tens of percent.
"""

from __future__ import annotations

import dataclasses
import math
import time
from typing import Callable, Sequence


class MeasurementError(RuntimeError):
    """A step could not be timed (non-finite or non-positive duration)."""


@dataclasses.dataclass(frozen=True)
class MeasureConfig:
    warmup_steps: int = 3
    timed_steps: int = 10
    trim_fraction: float = 0.2

    def __post_init__(self) -> None:
        if self.warmup_steps < 0:
            raise ValueError(f"--warmup={self.warmup_steps}: must be >= 0")
        if self.timed_steps < 1:
            raise ValueError(f"--repeats={self.timed_steps}: must be >= 1")
        if not 0.0 <= self.trim_fraction < 0.5:
            raise ValueError(f"--trim={self.trim_fraction}: must be in [0, 0.5)")


def kept_indices(latencies: Sequence[float], trim_fraction: float) -> list[int]:
    """Indices of the steps kept after trimming ``trim_fraction`` from each end."""
    order = sorted(range(len(latencies)), key=latencies.__getitem__)
    cut = int(len(order) * trim_fraction)
    kept = order[cut : len(order) - cut] if len(order) - 2 * cut > 0 else order
    return sorted(kept)


def trimmed_mean(values: Sequence[float], trim_fraction: float) -> float:
    kept = kept_indices(values, trim_fraction)
    return sum(values[i] for i in kept) / len(kept)


def check_latency(seconds: float, where: str) -> float:
    if not (isinstance(seconds, float) and math.isfinite(seconds) and seconds > 0):
        raise MeasurementError(f"{where}: step time {seconds!r} is not a positive finite number")
    return seconds


class PerfCounterTimer:
    """Wall-clock time of a CPU step."""

    name = "perf_counter_ns"

    def time(self, step: Callable[[], object]) -> float:
        """Run ``step``; return its duration in seconds."""
        start = time.perf_counter_ns()
        step()
        return (time.perf_counter_ns() - start) * 1e-9


class CudaEventTimer:
    """Device time between two events recorded on the current stream around ``step``.
    The stream is idle at the start (the previous step was synchronised), so the span
    includes the host-side launch gaps a served step also has."""

    name = "cuda-events"

    def __init__(self) -> None:
        import torch

        self._torch = torch
        self._start = torch.cuda.Event(enable_timing=True)
        self._end = torch.cuda.Event(enable_timing=True)

    def time(self, step: Callable[[], object]) -> float:
        self._torch.cuda.current_stream().synchronize()
        self._start.record()
        step()
        self._end.record()
        self._end.synchronize()
        return self._start.elapsed_time(self._end) * 1e-3


def timer_for(device_kind: str):
    return CudaEventTimer() if device_kind == "cuda" else PerfCounterTimer()
