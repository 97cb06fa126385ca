"""The lending policy and the auto reserve of one KV pool, built one way for the server
(harvest/colocate/assemble.py) and the replay (harvest/replay/kv_memory.py), so the two
cannot drift.

Plain numbers in: the pool's token slots and chunk size, the engine's largest batch, KV
bytes per token, the TPOT target, harvest.yaml's ``memory`` settings and the reclaim cost
per chunk (:mod:`harvest.memory.lend_costs`). Harli's reserve (§4.4) takes T_swap as two
steps (a trainer layer swaps out within a unit boundary; units are shorter than a step):
``2 * max_batch`` tokens, at most a quarter of the pool (SGLang's max_running_requests
default on a CPU is 4096, far above any real decode batch there). The auto reserve has
it as floor and half the pool as cap. Rules: docs/design.md §1.
"""

from __future__ import annotations

import math
from typing import Any

from harvest.memory.demand import AllocationDemand, DemandReserve
from harvest.memory.lending import LendingPolicy
from harvest.memory.reserve import reserve_tokens


def pool_chunks(pool_tokens: int, tokens_per_chunk: int, allocator_chunks: int | None = None) -> int:
    """The chunks holding the pool's slots plus SGLang's padding slot 0 (at most the
    allocator's ``allocator_chunks``, when given)."""
    chunks = math.ceil((pool_tokens + 1) / tokens_per_chunk)
    return chunks if allocator_chunks is None else min(allocator_chunks, chunks)


def harli_reserve(pool_tokens: int, max_batch_size: int, kv_bytes_per_token: int, target_tpot_ms: float) -> int:
    """Harli's reserve in tokens, T_swap two steps, at most a quarter of the pool (module doc)."""
    target_s = target_tpot_ms / 1e3
    return min(reserve_tokens(2 * target_s, target_s, max(1, max_batch_size), kv_bytes_per_token), pool_tokens // 4)


def lending_policy(*, tokens_per_chunk: int, num_chunks: int, pool_tokens: int, max_batch_size: int,
                   kv_bytes_per_token: int, target_tpot_ms: float, memory: Any) -> LendingPolicy:
    """When to lend and reclaim the pool's chunks: ``memory.reserve_tokens`` when fixed,
    else Harli's reserve (where the auto reserve starts). ``memory``: harvest.yaml's
    ``memory`` section (harvest.config.MemoryConfig)."""
    reserve = memory.reserve_tokens
    if reserve is None:
        reserve = harli_reserve(pool_tokens, max_batch_size, kv_bytes_per_token, target_tpot_ms)
    return LendingPolicy(tokens_per_chunk=tokens_per_chunk, num_chunks=num_chunks, reserve_tokens=reserve,
                         hysteresis_chunks=memory.hysteresis_chunks, max_lend_fraction=memory.max_lend_fraction)


def demand_reserve(policy: LendingPolicy, *, pool_tokens: int, target_tpot_ms: float, memory: Any,
                   reclaim_ms_per_chunk: float, cost_source: str = "") -> DemandReserve | None:
    """The auto reserve (harvest.memory.demand) over ``policy``'s pool, None when
    ``memory.reserve_tokens`` is fixed: the demand decode's allocations show over one
    reclaim horizon (the trainer's acknowledgement, at most a step, plus
    ``reclaim_ms_per_chunk`` per chunk), the policy's reserve (Harli's) as floor, half
    the pool as cap. ``cost_source``: where the reclaim cost came from, in words (its
    reasons say it)."""
    if memory.reserve_tokens is not None:
        return None
    floor = policy.reserve_tokens
    return DemandReserve(floor_tokens=floor, cap_tokens=max(floor, pool_tokens // 2),
                         tokens_per_chunk=policy.tokens_per_chunk, ack_s=target_tpot_ms / 1e3,
                         reclaim_s_per_chunk=reclaim_ms_per_chunk / 1e3, percentile=memory.reserve_percentile,
                         lower_after_s=memory.reserve_lower_after_s,
                         demand=AllocationDemand(window_s=memory.reserve_window_s), cost_source=cost_source)
