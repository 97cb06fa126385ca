"""Decode step latency: host timer on CPU, CUDA events on the decode stream on a GPU.

Every measurement carries the tag it was taken under (the QoS decision's step number),
so a measurement is paired with its step by construction: a measurement the timer drops
(too many pending) or never takes (the engine raised) costs that one step's feedback,
never the alignment of every step after it.

On a GPU the step is only *launched* when the engine returns (SGLang's overlap scheduler
returns before the forward finishes), so CUDA events bracket the step on its stream and
are read without blocking at a later step boundary: measurements arrive late, in order.
On CPU the forward has finished when the engine returns.
"""

from __future__ import annotations

import collections
import time
from typing import NamedTuple


class Measurement(NamedTuple):
    tag: int  # what the caller passed to time(): the decision's step number
    seconds: float


class CpuStepTimer:
    measures_late = False  # a step's latency is known when the engine returns

    def __init__(self):
        self._pending: Measurement | None = None

    def time(self, tag: int, stream, run, *args, **kwargs):
        """``run(*args, **kwargs)``, timed under ``tag`` (``stream`` is None on a CPU).
        A run that raises is not measured."""
        start = time.perf_counter_ns()
        result = run(*args, **kwargs)
        self._pending = Measurement(tag, (time.perf_counter_ns() - start) / 1e9)
        return result

    @property
    def outstanding(self) -> int:
        """Measurements taken and not yet returned by :meth:`completed`."""
        return int(self._pending is not None)

    def completed(self) -> tuple[Measurement, ...]:
        """The steps finished since the last call, oldest first."""
        pending, self._pending = self._pending, None
        return () if pending is None else (pending,)


class CudaStepTimer:
    """Event pairs on the step's stream, read at later step boundaries.

    ``time`` also orders the step against the thread's current stream both ways: the
    step on a level's stream waits for what the engine queued before it on the current
    stream (its inputs), and the current stream waits for the step (its outputs). Two
    consecutive steps on different levels' streams are thereby ordered too, which the
    CUDA graphs of all levels, sharing one memory pool, rely on.
    """

    measures_late = True  # a step's latency arrives at a later step boundary

    def __init__(self, max_pending: int = 64, *, cuda=None):
        """``cuda``: the ``torch.cuda`` module (tests pass a fake)."""
        if cuda is None:
            import torch

            cuda = torch.cuda
        self._cuda = cuda
        self._free = collections.deque(cuda.Event(enable_timing=True) for _ in range(2 * max_pending))
        self._pending: collections.deque = collections.deque()  # (tag, start event, end event)
        # Made once: the two cross-stream handovers of every step allocate nothing (a
        # stream waits on an event's state at the time of the wait, so reuse is safe).
        self._inputs_ready = cuda.Event()
        self._step_done = cuda.Event()
        self.dropped = 0  # measurements given up to keep the decode step from blocking

    def time(self, tag: int, stream, run, *args, **kwargs):
        """``run(*args, **kwargs)`` on ``stream`` (None: the thread's current stream),
        bracketed by events on it; the latency arrives from :meth:`completed` later. A run
        that raises is not measured."""
        if not self._free:  # never block the decode step: drop the oldest measurement, tag and all
            _, old_start, old_end = self._pending.popleft()
            self._free.extend((old_start, old_end))
            self.dropped += 1
        start, end = self._free.popleft(), self._free.popleft()
        try:
            result = self._run_bracketed(stream, start, end, run, args, kwargs)
        except BaseException:
            self._free.extend((start, end))  # not measured; the events are reused
            raise
        self._pending.append((tag, start, end))
        return result

    def _run_bracketed(self, stream, start, end, run, args, kwargs):
        if stream is None:
            start.record()
            result = run(*args, **kwargs)
            end.record()
            return result
        cuda = self._cuda
        engine_stream = cuda.current_stream()
        self._inputs_ready.record(engine_stream)
        stream.wait_event(self._inputs_ready)
        try:
            with cuda.stream(stream):
                start.record(stream)
                result = run(*args, **kwargs)
                end.record(stream)
        finally:  # whatever the step queued, the engine's stream waits for it
            self._step_done.record(stream)
            engine_stream.wait_event(self._step_done)
        return result

    @property
    def outstanding(self) -> int:
        """Measurements taken and not yet returned by :meth:`completed`."""
        return len(self._pending)

    def completed(self) -> list[Measurement]:
        done = []
        while self._pending and self._pending[0][2].query():
            tag, start, end = self._pending.popleft()
            done.append(Measurement(tag, start.elapsed_time(end) / 1e3))
            self._free.extend((start, end))
        return done


def make_step_timer(device_type: str):
    return CudaStepTimer() if device_type == "cuda" else CpuStepTimer()
