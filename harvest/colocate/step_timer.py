"""Decode step latency: host timer on CPU, CUDA events on the decode stream on a GPU.

On a GPU the step is only *launched* when the engine returns (SGLang's overlap scheduler
returns before the forward finishes), so CUDA events bracket the step on its stream and
are read without blocking at the next step boundary: measurements arrive one step late,
in order. On CPU the forward has finished when the engine returns.
"""

from __future__ import annotations

import collections
import time


class CpuStepTimer:
    measures_late = False  # a step's latency is known when the engine returns

    def __init__(self):
        self._start = 0
        self._pending: float | None = None

    def time(self, stream, run, *args, **kwargs):
        """``run(*args, **kwargs)``, timed (``stream`` is None on a CPU)."""
        self.start(stream)
        result = run(*args, **kwargs)
        self.stop(stream)
        return result

    def start(self, stream=None) -> None:
        self._start = time.perf_counter_ns()

    def stop(self, stream=None) -> None:
        self._pending = (time.perf_counter_ns() - self._start) / 1e9

    def completed(self) -> tuple[float, ...]:
        """Latencies (s) of the steps finished since the last call, oldest first."""
        pending, self._pending = self._pending, None
        return () if pending is None else (pending,)


class CudaStepTimer:
    measures_late = True  # a step's latency arrives at a later step boundary

    def __init__(self, max_pending: int = 64):
        import torch

        self._torch = torch
        self._free = collections.deque(torch.cuda.Event(enable_timing=True) for _ in range(2 * max_pending))
        self._pending: collections.deque = collections.deque()
        self._start_event = None

    def time(self, stream, run, *args, **kwargs):
        """``run(*args, **kwargs)`` on ``stream`` (None: the thread's current stream),
        bracketed by events on it; the latency arrives from :meth:`completed` later."""
        if stream is None:
            self.start(None)
            result = run(*args, **kwargs)
            self.stop(None)
            return result
        with self._torch.cuda.stream(stream):
            self.start(stream)
            result = run(*args, **kwargs)
            self.stop(stream)
        return result

    def start(self, stream=None) -> None:
        if not self._free:  # never block the decode step: drop the oldest measurement
            old_start, old_end = self._pending.popleft()
            self._free.extend((old_start, old_end))
        self._start_event = self._free.popleft()
        self._start_event.record(stream)

    def stop(self, stream=None) -> None:
        end = self._free.popleft()
        end.record(stream)
        self._pending.append((self._start_event, end))

    def completed(self) -> list[float]:
        done = []
        while self._pending and self._pending[0][1].query():
            start, end = self._pending.popleft()
            done.append(start.elapsed_time(end) / 1e3)
            self._free.extend((start, end))
        return done


def make_step_timer(device_type: str):
    return CudaStepTimer() if device_type == "cuda" else CpuStepTimer()
