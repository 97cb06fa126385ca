"""What harvest's per-step control costs the decode thread, part by part.

The step loop marks the end of each of its parts in order (``PARTS``: decide, engine,
feedback, lending) with ``lap(name)`` inside ``with profiler as lap:``; the engine's part
is not harvest's time and is left out. Only every ``every``-th step is measured (a prime,
so the sample does not alias with the controller's bookkeeping); on the others ``lap`` is
a no-op and nothing is allocated. Thread CPU time and wall time are both recorded; both
clocks are parameters (``wall_ns``, ``cpu_ns``) for a test's fake clock.

Figures and reasons: docs/measurements.md, 'The decode step's hook'.
"""

from __future__ import annotations

import collections
import statistics
import time
from typing import Callable

PARTS = ("decide", "engine", "feedback", "lending")
HARVEST_PARTS = tuple(part for part in PARTS if part != "engine")


def _no_lap(part: str) -> None:
    pass


class StepProfiler:
    def __init__(self, every: int = 7, keep: int = 2048, *, wall_ns: Callable[[], int] = time.perf_counter_ns,
                 cpu_ns: Callable[[], int] = time.thread_time_ns):
        self.every = every
        self._wall_ns, self._thread_cpu_ns = wall_ns, cpu_ns
        self.num_steps = 0
        self.num_sampled = 0
        self.wall_ns_total = 0
        self.cpu_ns_total = 0
        # Per sampled step: (thread CPU, wall, then the wall time of each harvest part), ns.
        self.recent: collections.deque = collections.deque(maxlen=keep)
        self._marks: list[int] = []
        self._cpu_ns = 0

    # -- the step loop ---------------------------------------------------------------------
    def __enter__(self):
        self.num_steps += 1
        if self.num_steps % self.every:
            return _no_lap
        self._cpu_ns = -self._thread_cpu_ns()
        self._marks = [self._wall_ns()]
        return self._lap

    def _lap(self, part: str) -> None:
        marks = self._marks
        if len(marks) == 1:  # harvest's decision ends, the engine's step starts
            marks.append(self._wall_ns())
            self._cpu_ns += self._thread_cpu_ns()
        elif len(marks) == 2:  # the engine's step ends: harvest's clock runs again
            self._cpu_ns -= self._thread_cpu_ns()
            marks.append(self._wall_ns())
        else:
            marks.append(self._wall_ns())

    def __exit__(self, exc_type, exc, tb) -> bool:
        marks = self._marks
        if len(marks) == len(PARTS) + 1 and exc_type is None:
            cpu_ns = self._cpu_ns + self._thread_cpu_ns()
            decide, feedback, lending = marks[1] - marks[0], marks[3] - marks[2], marks[4] - marks[3]
            wall_ns = decide + feedback + lending
            self.recent.append((cpu_ns, wall_ns, decide, feedback, lending))
            self.num_sampled += 1
            self.wall_ns_total += wall_ns
            self.cpu_ns_total += cpu_ns
        self._marks = []
        return False

    # -- reading it ------------------------------------------------------------------------
    def summary(self) -> dict:
        """Means over every sampled step (the rare step that reclaims KV chunks or is
        preempted mid-hook included) and medians over the last ones (the typical step)."""
        recent = list(self.recent)
        sampled = self.num_sampled
        return {
            "hook_overhead_us_per_step": self.wall_ns_total / sampled / 1e3 if sampled else 0.0,
            "hook_cpu_us_per_step": self.cpu_ns_total / sampled / 1e3 if sampled else 0.0,
            "hook_cpu_us_median": _median_us(recent, 0),
            "hook_wall_us_median": _median_us(recent, 1),
            # decide: predict + QoS decision + partition and gate (with a late timer, the
            # earlier steps' feedback too); feedback: the measurement back to the
            # scheduler; lending: the KV reserve check and the lending plan.
            "hook_wall_us_median_by_part": {part: _median_us(recent, index)
                                            for index, part in enumerate(HARVEST_PARTS, start=2)},
        }


def _median_us(samples: list, index: int) -> float:
    return statistics.median(s[index] for s in samples) / 1e3 if samples else 0.0
