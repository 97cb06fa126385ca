"""A reserve sized from what decode allocates (pure policy: numpy, no torch).

Harli's reserve (:mod:`harvest.memory.reserve`) covers decode's own growth; arrivals (a
prompt's whole KV at once) empty the free pool faster, so this reserve follows the demand
seen. Every allocation is recorded (time, tokens); the reserve is the chosen percentile,
over the recorded window, of the tokens allocated within one reclaim horizon (the
trainer's acknowledgement plus the driver's reclaim time for the chunks the demand needs),
never below Harli's formula, never above the cap. It rises at once and falls only after
staying lower for ``lower_after_s`` by more than a chunk.

Rules: docs/design.md §1.
"""

from __future__ import annotations

import collections
import dataclasses
import math

import numpy as np


UPDATE_INTERVAL_S = 1.0  # the server and the replay work the reserve out at most this often (a few ms at most)


@dataclasses.dataclass(frozen=True)
class ReserveDecision:
    tokens: int
    reason: str  # one line, for /harvest/status and the log


class AllocationDemand:
    """Allocations of the last ``window_s`` seconds (at most ``max_records``), and the
    tokens allocated within any interval of a given length."""

    def __init__(self, window_s: float = 60.0, max_records: int = 4096):
        if not (window_s > 0 and math.isfinite(window_s)):
            raise ValueError(f"window_s={window_s!r}: must be a positive number of seconds")
        if max_records < 1:
            raise ValueError(f"max_records={max_records!r}: must be >= 1")
        self.window_s = window_s
        self._records: collections.deque[tuple[float, int]] = collections.deque(maxlen=max_records)
        self._arrays = None  # (times, cumulative tokens) of the records, made when first needed

    def record(self, now: float, tokens: int) -> None:
        if tokens > 0:
            self._records.append((now, tokens))
            self._arrays = None

    def __len__(self) -> int:
        return len(self._records)

    def forget_before(self, now: float) -> None:
        while self._records and self._records[0][0] < now - self.window_s:
            self._records.popleft()
            self._arrays = None

    def within(self, span_s: float, percentile: float) -> int:
        """The ``percentile`` (0-100) over the recorded allocations of the tokens allocated
        in ``[t, t + span_s]``, ``t`` each allocation's time (0 when nothing is recorded).
        O(n log n) in numpy: a few milliseconds for a full window."""
        if not self._records:
            return 0
        if self._arrays is None:
            times = np.fromiter((at for at, _ in self._records), dtype=np.float64, count=len(self._records))
            tokens = np.fromiter((n for _, n in self._records), dtype=np.int64, count=len(self._records))
            self._arrays = (times, np.concatenate(([0], np.cumsum(tokens))))
        times, cumulative = self._arrays
        first = np.searchsorted(times, times, side="left")
        end = np.searchsorted(times, times + span_s, side="right")
        sums = np.sort(cumulative[end] - cumulative[first])
        rank = min(len(sums) - 1, max(0, math.ceil(percentile / 100.0 * len(sums)) - 1))
        return int(sums[rank])


@dataclasses.dataclass
class DemandReserve:
    """The reserve in tokens, from the demand seen, with Harli's formula as its floor.

    ``ack_s``: longest wait for the trainer to let go of lent chunks (one unit);
    ``reclaim_s_per_chunk``: the driver's time to reclaim one chunk (harvest.memory.lend_costs);
    ``cap_tokens``: the most the reserve may be (a share of the pool); ``cost_source``:
    where the reclaim figure came from, in words (the reasons name it when given)."""

    floor_tokens: int
    cap_tokens: int
    tokens_per_chunk: int
    ack_s: float
    reclaim_s_per_chunk: float
    percentile: float = 99.0
    lower_after_s: float = 30.0
    demand: AllocationDemand = dataclasses.field(default_factory=AllocationDemand)
    cost_source: str = ""
    # What the records count, in words: allocations, or (SGLang with reclaim ahead) the
    # requests arriving in its queue, priced as its admission sets them aside.
    recorded: str = "tokens allocated"

    def __post_init__(self) -> None:
        for name in ("floor_tokens", "cap_tokens"):
            if getattr(self, name) < 0:
                raise ValueError(f"DemandReserve.{name}={getattr(self, name)}: must be >= 0")
        if self.tokens_per_chunk <= 0:
            raise ValueError(f"DemandReserve.tokens_per_chunk={self.tokens_per_chunk}: must be > 0")
        for name in ("ack_s", "reclaim_s_per_chunk", "lower_after_s"):
            value = getattr(self, name)
            if not (math.isfinite(value) and value >= 0):
                raise ValueError(f"DemandReserve.{name}={value!r}: must be a finite number >= 0")
        if not 0 < self.percentile <= 100:
            raise ValueError(f"DemandReserve.percentile={self.percentile!r}: must be in (0, 100]")
        start = min(self.floor_tokens, self.cap_tokens)
        self.current = ReserveDecision(start, f"Harli's formula ({start} tokens): no demand seen yet")
        self._lower_since: float | None = None

    def horizon_s(self, tokens: int) -> float:
        """How long decode would wait to get ``tokens`` back from the trainer."""
        return self.ack_s + math.ceil(tokens / self.tokens_per_chunk) * self.reclaim_s_per_chunk

    def wanted(self) -> ReserveDecision:
        """The reserve the recorded demand asks for now (no hysteresis)."""
        horizon = self.horizon_s(self.tokens_per_chunk)  # at least one chunk comes back
        demand, converged = 0, False
        for _ in range(8):  # the demand's chunks lengthen the horizon: its least fixed point, from below
            demand = self.demand.within(horizon, self.percentile)
            longer = self.horizon_s(max(demand, self.tokens_per_chunk))
            if longer <= horizon:
                converged = True
                break
            horizon = longer
        if not converged:  # what arrives within a reclaim keeps outgrowing it: reclaims cannot keep pace
            return ReserveDecision(self.cap_tokens, f"allocations arrive about as fast as chunks can be reclaimed "
                                                    f"({demand} tokens within {self._horizon(horizon)} and growing); "
                                                    f"capped at {self.cap_tokens} tokens")
        if demand <= self.floor_tokens:
            tokens, reason = self.floor_tokens, (f"Harli's formula ({self.floor_tokens} tokens) covers the "
                                                 f"p{self.percentile:g} demand within {self._horizon(horizon)} "
                                                 f"({demand} tokens)")
        else:
            tokens, reason = demand, (f"p{self.percentile:g} of {self.recorded} within one reclaim horizon "
                                      f"({self._horizon(horizon)}) over the last {self.demand.window_s:g} s")
        if tokens > self.cap_tokens:
            tokens, reason = self.cap_tokens, f"{reason}; capped at {self.cap_tokens} tokens"
        return ReserveDecision(tokens, reason)

    def _horizon(self, horizon_s: float) -> str:
        """The horizon in words, with the reclaim figure's source when known."""
        if not self.cost_source:
            return f"{horizon_s * 1e3:.0f} ms"
        return f"{horizon_s * 1e3:.0f} ms; {self.reclaim_s_per_chunk * 1e3:.3g} ms per chunk reclaimed: {self.cost_source}"

    def update(self, now: float) -> ReserveDecision:
        """The reserve to apply now: up at once, down only after ``lower_after_s`` below
        the current one by more than a chunk."""
        self.demand.forget_before(now)
        wanted = self.wanted()
        if wanted.tokens >= self.current.tokens:
            self._lower_since = None
            if wanted.tokens > self.current.tokens or wanted.reason != self.current.reason:
                self.current = wanted
        elif self.current.tokens - wanted.tokens <= self.tokens_per_chunk:
            self._lower_since = None
        elif self._lower_since is None:
            self._lower_since = now
        elif now - self._lower_since >= self.lower_after_s:
            self.current, self._lower_since = wanted, None
        return self.current


def free_target(reserve_tokens: int, *, promised_tokens: int = 0, held_tokens: int = 0) -> int:
    """Free mapped slots to keep so that nothing waits for lent memory within the next
    reclaim horizon (the reclaim-ahead rule; docs/design.md §1): the reserve (arrivals
    and growth within one horizon), plus ``promised_tokens``, what the engine's admission
    already sets aside for its running requests (SGLang admits a request only when its
    prompt fits beside that), and at least ``held_tokens``, what an admission that lent
    memory held back needs free. Below it, lent chunks come back before anyone asks;
    above it plus the hysteresis, chunks are lent."""
    return max(reserve_tokens + max(0, promised_tokens), held_tokens)


def with_free_target(policy, *, promised_tokens: int = 0, held_tokens: int = 0):
    """``policy`` (harvest.memory.lending.LendingPolicy) planning against :func:`free_target`
    in place of its reserve: what the lending plan and the reclaim check take, in the
    server and in the replay alike."""
    target = free_target(policy.reserve_tokens, promised_tokens=promised_tokens, held_tokens=held_tokens)
    return policy if target == policy.reserve_tokens else dataclasses.replace(policy, reserve_tokens=target)


def free_target_reason(reserve_tokens: int, *, promised_tokens: int = 0, held_tokens: int = 0) -> str:
    """:func:`free_target` in words (for ``/harvest/status``)."""
    ahead = reserve_tokens + max(0, promised_tokens)
    if held_tokens > ahead:
        return f"{held_tokens} tokens: an admission held back by lent memory needs them free"
    if promised_tokens > 0:
        return (f"{ahead} tokens: the reserve ({reserve_tokens}) plus the {promised_tokens} SGLang sets aside for its "
                f"running requests' decode")
    return f"{reserve_tokens} tokens: the reserve"
