"""Read-only snapshots of the allocator: chunk states, statistics, backend call counts."""

from __future__ import annotations

import dataclasses
import enum

from harvest.memory import _lib


class ChunkState(enum.IntEnum):
    MAPPED = 0  # backs its KV slots
    LENT = 1  # mapped into the general arena
    BUSY = 2  # a lend or reclaim is moving it right now
    BROKEN = 3  # a driver failure left it unusable
    LENDING = 4  # lend started: its KV pages wait for the KV streams' fences (finish_lends)


@dataclasses.dataclass(frozen=True)
class ChunkInfo:
    chunk: int
    state: ChunkState
    live_slots: int
    used_pages: int
    fence_pending: bool

    @classmethod
    def from_c(cls, chunk: int, info: _lib.CChunkInfo) -> "ChunkInfo":
        return cls(chunk, ChunkState(info.state), info.live_slots, info.used_pages, bool(info.fence_pending))


@dataclasses.dataclass(frozen=True)
class AllocatorStats:
    """Pages per state, bytes lent, fragmentation; field meanings as in hvmm_stats_t."""

    num_chunks: int
    chunks_mapped: int
    chunks_lent: int
    chunks_lent_idle: int
    chunks_busy: int
    chunks_broken: int
    live_slots: int
    pages_kv_mapped: int
    pages_lent: int
    pages_lent_used: int
    bytes_lent: int
    fragmentation_bytes: int  # free pages of partly used lent chunks
    arena_allocations: int
    arena_used_bytes: int
    arena_largest_free_bytes: int
    small_pool_bytes: int
    small_used_bytes: int
    small_requested_bytes: int
    small_allocations: int
    small_largest_free_bytes: int
    fences_pending: int
    chunks_lending: int  # lends waiting for their KV fences
    small_pending_frees: int  # small blocks freed with fences not yet seen to pass
    small_pending_bytes: int

    @classmethod
    def from_c(cls, stats: _lib.Stats) -> "AllocatorStats":
        return cls(**{name: getattr(stats, name) for name in _lib.STATS_FIELDS})


@dataclasses.dataclass(frozen=True)
class BackendCall:
    """One backend call from the call log (UnifiedAllocator.call_log): what ran, in order."""

    kind: str  # "map", "unmap", "fence_record", "fence_query", "fence_wait", ...
    address: int  # reserve, free_range, map, unmap, set_access
    bytes: int
    stream: int  # fence_record
    event: int  # event_create, fence_record, fence_query, fence_wait
    passed: bool  # fence_query: whether the fence had passed

    @classmethod
    def from_c(cls, record: _lib.CallRecord) -> "BackendCall":
        return cls(_lib.COUNTER_FIELDS[record.kind], record.address, record.bytes, record.stream, record.event,
                   bool(record.result))


@dataclasses.dataclass(frozen=True)
class BackendCounters:
    """Backend calls by kind since the allocator was created."""

    reserve: int
    free_range: int
    create: int
    release: int
    map: int
    unmap: int
    set_access: int
    event_create: int
    fence_record: int
    fence_query: int
    fence_wait: int
    create_at_init: int

    @property
    def create_calls_after_init(self) -> int:
        return self.create - self.create_at_init

    @property
    def mapping_calls(self) -> int:
        """The VMM driver calls that move pages: map + unmap + set_access (what a lend or
        reclaim is counted in; its fence calls are the other fields)."""
        return self.map + self.unmap + self.set_access

    def minus(self, earlier: "BackendCounters") -> "BackendCounters":
        """Calls made since `earlier` was taken."""
        return BackendCounters(
            **{f.name: getattr(self, f.name) - getattr(earlier, f.name) for f in dataclasses.fields(self)}
        )

    @classmethod
    def from_c(cls, counters: _lib.Counters) -> "BackendCounters":
        return cls(**{name: getattr(counters, name) for name in (*_lib.COUNTER_FIELDS, "create_at_init")})
