"""The requests a replay feeds the decode instance: a window of the trace, stretched in
time and thinned or multiplied in rate.

The window is the requests arriving in ``[start_s, start_s + duration_s)`` (at most
``max_requests``), re-based to its start; ``time_scale`` multiplies every arrival time;
``rate_scale`` keeps the time base and keeps each request ``floor(r)`` times plus once more
with probability ``r − floor(r)`` (seeded), extra copies at uniform times before the next
request, so the load curve keeps its shape. With ``resample_sizes`` the copies take the
sizes of a request within RESAMPLE_WINDOW_S of it, and the original's arrival is drawn in
its gap like theirs: why a fleet needs that, docs/fleet.md, 'Load per server'.
"""

from __future__ import annotations

import bisect
import dataclasses
import math
import random
from typing import Sequence

from harvest.replay.trace import TraceRequest

# The Azure conversation trace's size mix drifts over its hour; a minute either side holds
# about 650 of its requests: the mix of the moment, and far more than one request's copies.
RESAMPLE_WINDOW_S = 60.0


@dataclasses.dataclass(frozen=True)
class TraceWindow:
    start_s: float = 0.0
    duration_s: float | None = None
    max_requests: int | None = None
    time_scale: float = 1.0
    rate_scale: float = 1.0
    resample_sizes: bool = False  # extra copies' sizes drawn from requests near them (module doc)

    def __post_init__(self) -> None:
        _check(self.start_s, "--start-s", "seconds into the trace, >= 0", low=0.0)
        if self.duration_s is not None:
            _check(self.duration_s, "--duration-s", "seconds of trace to replay, > 0", low=0.0, open_low=True)
        if self.max_requests is not None and (isinstance(self.max_requests, bool) or not isinstance(self.max_requests, int) or self.max_requests < 1):
            raise ValueError(f"--max-requests={self.max_requests!r}: must be an integer >= 1")
        _check(self.time_scale, "--time-scale", "a factor on arrival times, > 0 (2 = half the rate)", low=0.0, open_low=True)
        _check(self.rate_scale, "--rate-scale", "a factor on the number of requests, > 0 (2 = twice the rate)", low=0.0, open_low=True)
        if not isinstance(self.resample_sizes, bool):
            raise ValueError(f"--rate-scale-sizes: resample_sizes={self.resample_sizes!r} must be True or False")

    @property
    def is_random(self) -> bool:
        """Whether the seed changes the requests (fractional rate scaling draws)."""
        return self.rate_scale != 1.0

    def describe(self) -> str:
        end = "end" if self.duration_s is None else f"{self.start_s + self.duration_s:g} s"
        parts = [f"trace window {self.start_s:g} s .. {end}"]
        if self.max_requests is not None:
            parts.append(f"at most {self.max_requests} requests")
        if self.time_scale != 1.0:
            parts.append(f"time x{self.time_scale:g}")
        if self.rate_scale != 1.0:
            parts.append(f"rate x{self.rate_scale:g}" + (", extra requests' sizes resampled" if self.resample_sizes and self.rate_scale > 1 else ""))
        return ", ".join(parts)


def _check(value, flag: str, fix: str, *, low: float, open_low: bool = False) -> None:
    number = isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
    if not number or (value <= low if open_low else value < low):
        raise ValueError(f"{flag}={value!r}: must be {fix}")


def window_requests(requests: Sequence[TraceRequest], window: TraceWindow) -> list[TraceRequest]:
    """The requests of ``requests`` (sorted by arrival) in the window, before any scaling
    (every request a replay runs has the sizes of one of them); raises ValueError if the
    window holds no request."""
    end = math.inf if window.duration_s is None else window.start_s + window.duration_s
    chosen = [r for r in requests if window.start_s <= r.arrival_s < end]
    if window.max_requests is not None:
        chosen = chosen[: window.max_requests]
    if not chosen:
        last = requests[-1].arrival_s if requests else 0.0
        raise ValueError(f"{window.describe()}: no request arrives in it (the trace spans 0 .. {last:g} s); move or widen the window")
    return chosen


def prepare(requests: Sequence[TraceRequest], window: TraceWindow, seed: int = 0) -> list[TraceRequest]:
    """The window of ``requests`` (sorted by arrival) after time and rate scaling, sorted
    by arrival; raises ValueError if the window holds no request."""
    scaled = _rate_scaled(window_requests(requests, window), window.rate_scale, window.resample_sizes, random.Random(seed))
    return [
        TraceRequest((r.arrival_s - window.start_s) * window.time_scale, r.context_tokens, r.generated_tokens, r.line)
        for r in scaled
    ]


def _rate_scaled(requests: list[TraceRequest], rate: float, resample_sizes: bool, rng: random.Random) -> list[TraceRequest]:
    if rate == 1.0:
        return list(requests)
    whole, fraction = int(rate), rate - int(rate)
    arrivals = [r.arrival_s for r in requests]
    out: list[TraceRequest] = []
    for index, request in enumerate(requests):
        copies = whole + (1 if rng.random() < fraction else 0)
        if copies == 0:
            continue
        gap = requests[index + 1].arrival_s - request.arrival_s if index + 1 < len(requests) else 0.0
        if resample_sizes and copies > 1:
            out.append(dataclasses.replace(request, arrival_s=request.arrival_s + rng.random() * gap))
            low = bisect.bisect_left(arrivals, request.arrival_s - RESAMPLE_WINDOW_S)
            high = bisect.bisect_right(arrivals, request.arrival_s + RESAMPLE_WINDOW_S)
            for _ in range(copies - 1):
                source = requests[rng.randrange(low, high)]
                out.append(dataclasses.replace(source, arrival_s=request.arrival_s + rng.random() * gap))
            continue
        out.append(request)
        for _ in range(copies - 1):
            out.append(dataclasses.replace(request, arrival_s=request.arrival_s + rng.random() * gap))
    out.sort(key=lambda r: r.arrival_s)
    if not out:
        raise ValueError(f"--rate-scale={rate:g} kept none of the window's {len(requests)} requests; raise it or widen the window")
    return out
