"""When to lend KV chunks to the trainer and when to take them back (pure policy).

Inputs are counts the serving side already has: free token slots per chunk and which
chunks are lent. The rule (Harli (arXiv:2511.11729) §4.4, docs/design.md §1): free mapped
slots stay at or above the reserve (below it, reclaim at once, whatever the trainer is
doing); lend only above ``reserve + hysteresis_chunks`` chunks' worth, whole free chunks,
highest first, never more than ``max_lend_fraction`` of all chunks; chunk 0 (SGLang's
padding slot) is never lendable. No torch, no numpy: the caller computes the per-chunk
counts (one ``bincount``).
"""

from __future__ import annotations

import dataclasses
import math
from typing import Sequence


@dataclasses.dataclass(frozen=True)
class LendingPolicy:
    tokens_per_chunk: int
    num_chunks: int
    reserve_tokens: int
    hysteresis_chunks: int = 1
    max_lend_fraction: float = 0.8

    def __post_init__(self) -> None:
        for name in ("tokens_per_chunk", "num_chunks"):
            if getattr(self, name) <= 0:
                raise ValueError(f"LendingPolicy.{name}={getattr(self, name)}: must be > 0")
        for name in ("reserve_tokens", "hysteresis_chunks"):
            if getattr(self, name) < 0:
                raise ValueError(f"LendingPolicy.{name}={getattr(self, name)}: must be >= 0")
        if not 0.0 <= self.max_lend_fraction <= 1.0:
            raise ValueError(f"LendingPolicy.max_lend_fraction={self.max_lend_fraction}: must be in [0, 1]")

    @property
    def max_lent_chunks(self) -> int:
        return int(self.max_lend_fraction * self.num_chunks)


@dataclasses.dataclass(frozen=True)
class LendingPlan:
    lend: tuple[int, ...] = ()
    reclaim_count: int = 0  # how many lent chunks to take back (the mechanism picks which)
    free_mapped_tokens: int = 0


def free_mapped_tokens(free_per_chunk: Sequence[int], lent: Sequence[bool]) -> int:
    return sum(free for free, is_lent in zip(free_per_chunk, lent) if not is_lent)


def reclaim_count(policy: LendingPolicy, free_mapped: int, num_lent: int) -> int:
    """Lent chunks to take back so that free mapped slots reach the reserve (0 if they do)."""
    shortfall = policy.reserve_tokens - free_mapped
    if shortfall <= 0:
        return 0
    return min(num_lent, math.ceil(shortfall / policy.tokens_per_chunk))


def plan(policy: LendingPolicy, free_per_chunk: Sequence[int], lent: Sequence[bool]) -> LendingPlan:
    """What to do now. ``free_per_chunk[c]``: free slots of chunk c (0 for a lent chunk)."""
    if len(free_per_chunk) != policy.num_chunks or len(lent) != policy.num_chunks:
        raise ValueError(f"plan: expected {policy.num_chunks} chunks, got {len(free_per_chunk)} counts and {len(lent)} flags")
    free_mapped = free_mapped_tokens(free_per_chunk, lent)
    num_lent = sum(lent)
    # Over the cap (an operator lowered max_lend_fraction at run time): the excess comes back.
    to_reclaim = max(reclaim_count(policy, free_mapped, num_lent), num_lent - policy.max_lent_chunks)
    if to_reclaim:
        return LendingPlan(reclaim_count=to_reclaim, free_mapped_tokens=free_mapped)
    floor = policy.reserve_tokens + policy.hysteresis_chunks * policy.tokens_per_chunk
    budget = policy.max_lent_chunks - num_lent
    to_lend = []
    remaining = free_mapped
    for chunk in range(policy.num_chunks - 1, 0, -1):  # chunk 0 holds the padding slot
        if budget <= 0:
            break
        if lent[chunk] or free_per_chunk[chunk] != policy.tokens_per_chunk:
            continue
        if remaining - policy.tokens_per_chunk < floor:
            break
        to_lend.append(chunk)
        remaining -= policy.tokens_per_chunk
        budget -= 1
    return LendingPlan(lend=tuple(to_lend), free_mapped_tokens=free_mapped)
