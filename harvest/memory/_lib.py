"""ctypes binding of the allocator part of libharvest_vmm (csrc/vmm_allocator/hvmm.h).

The structures mirror hvmm.h field for field. ctypes releases the GIL around every call
into a plain C function, so a lend or reclaim that waits on the driver never stalls the
decode thread's Python (the lock order GIL -> allocator mutexes holds by construction:
no C++ code calls back into Python).
"""

from __future__ import annotations

import ctypes
import functools
from types import SimpleNamespace

from harvest import native
from harvest.memory.errors import STATUS_TO_ERROR, VmmError

HVMM_OK = 0
HVMM_ERR_INVALID = 1
HVMM_ERR_EXHAUSTED = 5
BACKENDS = {"host": 0, "cuda": 1}

_i32, _i64, _u64 = ctypes.c_int32, ctypes.c_int64, ctypes.c_uint64


class Config(ctypes.Structure):
    _fields_ = [
        ("backend", _i32),
        ("device_ordinal", _i32),
        ("page_bytes", _i64),
        ("num_layers", _i64),
        ("kv_heads", _i64),
        ("head_dim", _i64),
        ("dtype_bytes", _i64),
        ("max_tokens", _i64),
        ("small_pool_bytes", _i64),
    ]


class Geometry(ctypes.Structure):
    _fields_ = [("backend", _i32), ("device_ordinal", _i32)] + [
        (name, _u64)
        for name in (
            "page_bytes", "num_layers", "bytes_per_token", "tokens_per_chunk", "pages_per_chunk", "num_chunks",
            "token_capacity", "chunk_bytes", "kv_range_bytes", "kv_base", "arena_base", "arena_bytes",
            "small_base", "small_bytes", "small_pages", "total_pages",
        )
    ]


class CChunkInfo(ctypes.Structure):
    _fields_ = [("state", _i32), ("fence_pending", _i32), ("live_slots", _u64), ("used_pages", _u64)]


STATS_FIELDS = (
    "num_chunks", "chunks_mapped", "chunks_lent", "chunks_lent_idle", "chunks_busy", "chunks_broken", "live_slots",
    "pages_kv_mapped", "pages_lent", "pages_lent_used", "bytes_lent", "fragmentation_bytes", "arena_allocations",
    "arena_used_bytes", "arena_largest_free_bytes", "small_pool_bytes", "small_used_bytes", "small_requested_bytes",
    "small_allocations", "small_largest_free_bytes", "fences_pending", "chunks_lending", "small_pending_frees",
    "small_pending_bytes",
)
COUNTER_FIELDS = (
    "reserve", "free_range", "create", "release", "map", "unmap", "set_access", "event_create", "fence_record",
    "fence_query", "fence_wait",
)


class Stats(ctypes.Structure):
    _fields_ = [(name, _u64) for name in STATS_FIELDS]


class Counters(ctypes.Structure):
    _fields_ = [(name, _u64) for name in COUNTER_FIELDS] + [("create_at_init", _u64)]


class CallRecord(ctypes.Structure):
    _fields_ = [("kind", _i32), ("result", _i32), ("address", _u64), ("bytes", _u64), ("stream", _u64),
                ("event", _u64)]


class SmallBench(ctypes.Structure):
    _fields_ = [
        ("pool_ns_per_pair_median", ctypes.c_double),
        ("malloc_ns_per_pair_median", ctypes.c_double),
        ("pairs", _i64),
        ("reps", _i64),
    ]


@functools.lru_cache(maxsize=1)
def lib() -> SimpleNamespace:
    """The bound functions, loaded once per process."""
    so = native.load("vmm")
    h = ctypes.c_void_p
    P = ctypes.POINTER
    c_int = ctypes.c_int
    return SimpleNamespace(
        last_error=native.bind(so, "hvmm_last_error", ctypes.c_char_p),
        create=native.bind(so, "hvmm_create", c_int, P(Config), P(h)),
        destroy=native.bind(so, "hvmm_destroy", c_int, h),
        geometry=native.bind(so, "hvmm_geometry", c_int, h, P(Geometry)),
        mark_slots=native.bind(so, "hvmm_mark_slots", c_int, h, P(_i64), _i64, _i32),
        chunk_info=native.bind(so, "hvmm_chunk_info", c_int, h, _i64, P(CChunkInfo)),
        chunk_table=native.bind(so, "hvmm_chunk_table", c_int, h, P(CChunkInfo), _i64),
        can_lend=native.bind(so, "hvmm_can_lend", c_int, h, _i64, P(_i32)),
        can_reclaim=native.bind(so, "hvmm_can_reclaim", c_int, h, _i64, P(_i32)),
        set_fence_streams=native.bind(so, "hvmm_set_fence_streams", c_int, h, P(_u64), _i64),
        fence_streams=native.bind(so, "hvmm_fence_streams", c_int, h, P(_u64), _i64, P(_i64)),
        lend=native.bind(so, "hvmm_lend", c_int, h, P(_i64), _i64),
        lend_start=native.bind(so, "hvmm_lend_start", c_int, h, P(_i64), _i64, P(_i32)),
        lend_finish=native.bind(so, "hvmm_lend_finish", c_int, h, P(_i64), _i64, P(_i64)),
        lend_cancel=native.bind(so, "hvmm_lend_cancel", c_int, h, P(_i64), _i64),
        reclaim=native.bind(so, "hvmm_reclaim", c_int, h, P(_i64), _i64),
        arena_alloc=native.bind(so, "hvmm_arena_alloc", c_int, h, _i64, P(_u64)),
        arena_free=native.bind(so, "hvmm_arena_free", c_int, h, _u64, P(_u64), _i64),
        small_alloc=native.bind(so, "hvmm_small_alloc", c_int, h, _i64, P(_u64)),
        small_free=native.bind(so, "hvmm_small_free", c_int, h, _u64, P(_u64), _i64),
        small_collect=native.bind(so, "hvmm_small_collect", c_int, h, P(_i64)),
        stats=native.bind(so, "hvmm_stats", c_int, h, P(Stats)),
        counters=native.bind(so, "hvmm_counters", c_int, h, P(Counters)),
        check_integrity=native.bind(so, "hvmm_check_integrity", c_int, h),
        inject_failure=native.bind(so, "hvmm_debug_inject_failure", c_int, h, _i32, _i64),
        record_calls=native.bind(so, "hvmm_debug_record_calls", c_int, h, _i32),
        call_log=native.bind(so, "hvmm_debug_call_log", c_int, h, P(CallRecord), _i64, P(_i64)),
        hold_fences=native.bind(so, "hvmm_debug_hold_fences", c_int, h, _i32),
        backend_call=native.bind(so, "hvmm_debug_backend_call", c_int, h, _i32, _u64, _u64, _i64),
        bench_small_pool=native.bind(
            so, "hvmm_bench_small_pool", c_int, h, _u64, _i64, _i64, _i64, _i64, _i64, P(SmallBench)
        ),
    )


def error_for(status: int) -> VmmError:
    """The exception for a failed call, with the library's message (same thread)."""
    message = (lib().last_error() or b"").decode(errors="replace") or f"hvmm status {status}"
    return STATUS_TO_ERROR.get(status, VmmError)(message, status)


def check(status: int) -> None:
    if status != HVMM_OK:
        raise error_for(status)
