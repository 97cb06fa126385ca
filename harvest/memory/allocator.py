"""UnifiedAllocator: SGLang's KV cache and the trainer's tensors on one page pool.

The Python face of libharvest_vmm (hvmm.h has the design note). Contract: every method is
thread-safe and blocking calls release the GIL; transient exhaustion returns None, bad
input raises VmmInvalidArgument and changes nothing; query first (``can_lend``,
``can_reclaim``), mutate second. Invariants: the KV ranges are mapped once, at start-up,
and never change (a lent chunk's pages are mapped in the arena as well); no page reaches
the arena before the work queued on every fence stream has passed (a
``lend(c, wait=False)`` that must wait leaves the chunk LENDING); a reclaimed chunk's arena
range shows a dummy, never a hole; the allocator is the authority on chunk state, the
serving side (SGLang's free lists) on slot liveness.

Usage and rules: docs/design.md §1, 'The allocator's Python face'.
"""

from __future__ import annotations

import ctypes
import gc
import operator
import weakref
from typing import Any, Iterable, Sequence

import numpy as np

from harvest.memory import _lib
from harvest.memory.errors import VmmInvalidArgument
from harvest.memory.geometry import KvGeometry
from harvest.memory.stats import AllocatorStats, BackendCall, BackendCounters, ChunkInfo, ChunkState

ARENA = "arena"
SMALL = "small"


def _int_array(values: Any, what: str) -> np.ndarray:
    """A contiguous int64 array from a list, numpy array or torch tensor of integers."""
    if hasattr(values, "detach"):  # torch tensor, possibly on a device
        values = values.detach().to("cpu").numpy()
    if isinstance(values, int):
        values = [values]
    array = np.asarray(values)
    if array.size and array.dtype.kind not in "iu":
        raise TypeError(f"{what} must be integers, got dtype {array.dtype}")
    return np.ascontiguousarray(array.reshape(-1), dtype=np.int64)


def _stream_handle(stream: Any) -> int:
    """A CUstream value: None is the legacy default stream (0); a torch stream gives its
    ``cuda_stream``; an int is taken as is."""
    if stream is None:
        return 0
    handle = getattr(stream, "cuda_stream", stream)
    handle = _as_int(handle, "stream")
    if handle < 0:
        raise ValueError(f"stream handle {handle} is negative")
    return handle


def _stream_array(streams: Iterable[Any]) -> np.ndarray:
    return np.ascontiguousarray([_stream_handle(s) for s in streams], dtype=np.uint64)


def _invalid(message: str) -> VmmInvalidArgument:
    """The error the library itself raises for bad input, for checks made in Python."""
    return VmmInvalidArgument(message, _lib.HVMM_ERR_INVALID)


def _as_int(value: Any, field: str) -> int:
    if isinstance(value, bool):
        raise TypeError(f"{field} must be an int, got bool")
    try:
        return operator.index(value)
    except TypeError:
        raise TypeError(f"{field} must be an int, got {type(value).__name__}") from None


class Allocation:
    """A live block of the general arena (whole pages) or of the small pool."""

    def __init__(self, allocator: "UnifiedAllocator", address: int, num_bytes: int, pool: str):
        self.allocator = allocator
        self.address = address
        self.num_bytes = num_bytes
        self.pool = pool
        self.freed = False

    def tensor(self, dtype=None, shape: Sequence[int] | None = None):
        """A tensor view of this block (no copy); uint8 over all of it by default."""
        if self.freed:
            raise _invalid(f"allocation at {self.address:#x} was freed")
        return self.allocator.tensor_view(self.address, self.num_bytes, dtype, shape)

    def free(self, streams: Iterable[Any] | None = None) -> None:
        """Give the block back, fenced on each of `streams` (torch streams or CUstream
        handles; None: torch's current stream on CUDA, none on host): reclaim waits for an
        arena block's fences, and a small block is reused only after its fences pass.
        Tensor views of the block must not be used afterwards (they read and write the
        arena's dummy run once its chunk is reclaimed)."""
        if self.freed:
            raise _invalid(f"allocation at {self.address:#x} is already free (double free)")
        self.allocator.free_address(self.address, self.pool, streams)
        self.freed = True

    def __repr__(self) -> str:
        state = "freed" if self.freed else "live"
        return f"Allocation({self.pool}, {self.address:#x}, {self.num_bytes} bytes, {state})"


class UnifiedAllocator:
    """One allocator per device: KV arena, general arena and small pool on one page pool."""

    def __init__(
        self,
        *,
        num_layers: int,
        kv_heads: int,
        head_dim: int,
        dtype_bytes: int,
        max_tokens: int,
        small_pool_bytes: int = 0,
        backend: str = "host",
        page_bytes: int = 0,
        device: int = 0,
    ):
        if backend not in _lib.BACKENDS:
            raise ValueError(f"backend={backend!r} is unknown; use one of {sorted(_lib.BACKENDS)}")
        config = _lib.Config(
            backend=_lib.BACKENDS[backend],
            device_ordinal=_as_int(device, "device"),
            page_bytes=_as_int(page_bytes, "page_bytes"),
            num_layers=_as_int(num_layers, "num_layers"),
            kv_heads=_as_int(kv_heads, "kv_heads"),
            head_dim=_as_int(head_dim, "head_dim"),
            dtype_bytes=_as_int(dtype_bytes, "dtype_bytes"),
            max_tokens=_as_int(max_tokens, "max_tokens"),
            small_pool_bytes=_as_int(small_pool_bytes, "small_pool_bytes"),
        )
        self._lib = _lib.lib()
        self._handle = ctypes.c_void_p()
        _lib.check(self._lib.create(ctypes.byref(config), ctypes.byref(self._handle)))
        self._live_views: set[int] = set()  # ids of buffers that tensor views keep alive
        raw = _lib.Geometry()
        _lib.check(self._lib.geometry(self._handle, ctypes.byref(raw)))
        fields = {name: getattr(raw, name) for name, _ in _lib.Geometry._fields_}
        fields["backend"] = backend
        fields["device"] = fields.pop("device_ordinal")
        self.geometry = KvGeometry(**fields)

    # ------------------------------------------------------------------ lifetime
    @property
    def closed(self) -> bool:
        return not self._handle

    def _h(self) -> ctypes.c_void_p:
        if not self._handle:
            raise _invalid("the allocator is closed")
        return self._handle

    def close(self) -> None:
        """Unmap and release everything. Refused while tensor views of its memory live."""
        if not self._handle:
            return
        if self._live_views:
            gc.collect()  # views caught in reference cycles
        if self._live_views:
            raise _invalid(
                f"{len(self._live_views)} tensor views still point into allocator memory; drop them before close()"
            )
        _lib.check(self._lib.destroy(self._handle))
        self._handle = ctypes.c_void_p()

    def __enter__(self) -> "UnifiedAllocator":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __del__(self) -> None:
        # Views hold a reference to the allocator, so none is alive when this runs.
        if getattr(self, "_handle", None):
            self._lib.destroy(self._handle)
            self._handle = ctypes.c_void_p()

    # ------------------------------------------------------------------ views
    def tensor_view(self, address: int, num_bytes: int, dtype=None, shape: Sequence[int] | None = None):
        """A torch tensor over [address, address + num_bytes) of this allocator's memory."""
        import torch

        from harvest.memory import views

        g = self.geometry
        inside = any(
            base <= address and address + num_bytes <= base + size
            for base, size in (
                (g.kv_base, g.kv_range_bytes * g.pages_per_chunk),
                (g.arena_base, g.arena_bytes),
                (g.small_base, g.small_bytes),
            )
        )
        if num_bytes <= 0 or not inside:
            raise _invalid(f"[{address:#x}, +{num_bytes}) is not inside this allocator's memory")
        self._h()
        buffer = views.make_buffer(address, num_bytes, g.backend, g.device, self)
        self._live_views.add(id(buffer))
        weakref.finalize(buffer, self._live_views.discard, id(buffer))
        return views.tensor_from_buffer(buffer, num_bytes, dtype or torch.uint8, shape, g.backend, g.device)

    def kv_tensor(self, layer: int, kind: str, dtype, shape: Sequence[int] | None = None):
        """A layer's whole K or V buffer ([token_capacity, ...] slots) as a tensor."""
        g = self.geometry
        return self.tensor_view(g.kv_range_address(layer, kind), g.kv_range_bytes, dtype, shape)

    # ------------------------------------------------------------------ token slots
    def mark_slots_live(self, slots: Any) -> None:
        """The serving side handed out these token slots (all or nothing)."""
        self._mark(slots, 1)

    def mark_slots_free(self, slots: Any) -> None:
        """The serving side took these token slots back (all or nothing)."""
        self._mark(slots, 0)

    def _mark(self, slots: Any, live: int) -> None:
        array = _int_array(slots, "slots")
        pointer = array.ctypes.data_as(ctypes.POINTER(ctypes.c_int64))
        _lib.check(self._lib.mark_slots(self._h(), pointer, array.size, live))

    # ------------------------------------------------------------------ chunks
    def chunk_info(self, chunk: int) -> ChunkInfo:
        """One chunk's state; queries its fences (fence_pending is exact)."""
        info = _lib.CChunkInfo()
        _lib.check(self._lib.chunk_info(self._h(), _as_int(chunk, "chunk"), ctypes.byref(info)))
        return ChunkInfo.from_c(chunk, info)

    def chunk_table(self) -> list[ChunkInfo]:
        """Every chunk's state in one call (fence_pending: fences not yet seen to pass)."""
        n = self.geometry.num_chunks
        table = (_lib.CChunkInfo * n)()
        _lib.check(self._lib.chunk_table(self._h(), table, n))
        return [ChunkInfo.from_c(i, table[i]) for i in range(n)]

    def can_lend(self, chunk: int) -> bool:
        ok = ctypes.c_int32()
        _lib.check(self._lib.can_lend(self._h(), _as_int(chunk, "chunk"), ctypes.byref(ok)))
        return bool(ok.value)

    def can_reclaim(self, chunk: int) -> bool:
        ok = ctypes.c_int32()
        _lib.check(self._lib.can_reclaim(self._h(), _as_int(chunk, "chunk"), ctypes.byref(ok)))
        return bool(ok.value)

    def lendable_chunks(self) -> list[int]:
        return [c.chunk for c in self.chunk_table() if c.state == ChunkState.MAPPED and c.live_slots == 0]

    def reclaimable_chunks(self) -> list[int]:
        return [c.chunk for c in self.chunk_table() if c.state == ChunkState.LENT and c.used_pages == 0]

    def lending_chunks(self) -> list[int]:
        """Chunks whose lend waits for its KV fences (``lend(..., wait=False)``)."""
        return [c.chunk for c in self.chunk_table() if c.state == ChunkState.LENDING]

    def lend(self, chunks: int | Iterable[int], wait: bool = True) -> bool:
        """Map whole free chunks into the general arena, as one batch (all or none), once
        the work queued so far on every fence stream has finished. Their KV slices keep
        their pages; nothing serves their slots until they are reclaimed.

        ``wait=True`` waits for it (event waits) and returns True. ``wait=False`` never
        blocks: True when the chunks are lent now, False when the fences have not all
        passed and the batch is left LENDING for ``finish_lends`` (or ``cancel_lends``)."""
        if wait:
            self._move(self._lib.lend, chunks)
            return True
        lent_now = ctypes.c_int32()
        array = _int_array(chunks, "chunk ids")
        _lib.check(self._lib.lend_start(self._h(), array.ctypes.data_as(ctypes.POINTER(ctypes.c_int64)), array.size,
                                        ctypes.byref(lent_now)))
        return bool(lent_now.value)

    def finish_lends(self) -> list[int]:
        """Complete every pending lend whose fences have passed (queries, no wait); the
        chunks lent by this call, ascending. On a failure they stay LENDING."""
        n = self.geometry.num_chunks
        out = (ctypes.c_int64 * n)()
        count = ctypes.c_int64()
        _lib.check(self._lib.lend_finish(self._h(), out, n, ctypes.byref(count)))
        return list(out[: count.value])

    def cancel_lends(self, chunks: int | Iterable[int]) -> None:
        """Give LENDING chunks back to the KV cache (nothing was mapped into the arena yet)."""
        self._move(self._lib.lend_cancel, chunks)

    def reclaim(self, chunks: int | Iterable[int]) -> None:
        """Give unused lent chunks back to the KV cache: waits on their arena fences (the
        trainer's frees), then unmaps their arena run. Decode's streams are not waited
        for: its mappings of the pages never left."""
        self._move(self._lib.reclaim, chunks)

    def _move(self, fn, chunks: int | Iterable[int]) -> None:
        array = _int_array(chunks, "chunk ids")
        _lib.check(fn(self._h(), array.ctypes.data_as(ctypes.POINTER(ctypes.c_int64)), array.size))

    # ------------------------------------------------------------------ fences
    def set_fence_streams(self, streams: Iterable[Any]) -> None:
        """The streams whose queued work may touch KV memory: every stream decode may run
        on. Each is a torch stream, a CUstream int, or None for the legacy default stream.
        A lend fences every one of them before it maps pages into the arena. Empty: fence
        nothing (CPU, where work is synchronous). Defaults: the legacy default stream on
        the cuda backend, nothing on host."""
        handles = _stream_array(streams)
        _lib.check(self._lib.set_fence_streams(self._h(), handles.ctypes.data_as(ctypes.POINTER(ctypes.c_uint64)),
                                               handles.size))

    @property
    def fence_streams(self) -> tuple[int, ...]:
        """The CUstream values a lend fences (0: the legacy default stream)."""
        count = ctypes.c_int64()
        _lib.check(self._lib.fence_streams(self._h(), None, 0, ctypes.byref(count)))
        out = (ctypes.c_uint64 * max(1, count.value))()
        _lib.check(self._lib.fence_streams(self._h(), out, count.value, ctypes.byref(count)))
        return tuple(out[: count.value])

    # ------------------------------------------------------------------ allocation
    def allocate(self, num_bytes: int) -> Allocation | None:
        """Under one page from the small pool, else whole pages from the general arena.
        None when that pool has no room right now (transient: back off, lend, retry)."""
        num_bytes = _as_int(num_bytes, "num_bytes")
        if 0 < num_bytes < self.geometry.page_bytes and self.geometry.small_pages:
            return self.small_allocate(num_bytes)
        return self.arena_allocate(num_bytes)

    def arena_allocate(self, num_bytes: int) -> Allocation | None:
        address = ctypes.c_uint64()
        status = self._lib.arena_alloc(self._h(), _as_int(num_bytes, "num_bytes"), ctypes.byref(address))
        if status == _lib.HVMM_ERR_EXHAUSTED:
            return None
        _lib.check(status)
        return Allocation(self, address.value, num_bytes, ARENA)

    def small_allocate(self, num_bytes: int) -> Allocation | None:
        address = ctypes.c_uint64()
        status = self._lib.small_alloc(self._h(), _as_int(num_bytes, "num_bytes"), ctypes.byref(address))
        if status == _lib.HVMM_ERR_EXHAUSTED:
            return None
        _lib.check(status)
        return Allocation(self, address.value, num_bytes, SMALL)

    def free_address(self, address: int, pool: str, streams: Iterable[Any] | None = None) -> None:
        """Free by raw address (Allocation.free is the usual way), fenced on `streams`
        (None: torch's current stream on CUDA, none on host). The library itself rejects
        double frees and unknown pointers."""
        address = _as_int(address, "address")
        if pool not in (ARENA, SMALL):
            raise ValueError(f"pool={pool!r} must be {ARENA!r} or {SMALL!r}")
        handles = _stream_array(self._default_streams() if streams is None else streams)
        pointer = handles.ctypes.data_as(ctypes.POINTER(ctypes.c_uint64))
        free = self._lib.small_free if pool == SMALL else self._lib.arena_free
        _lib.check(free(self._h(), address, pointer, handles.size))

    def collect_small_frees(self) -> int:
        """Make fenced small-pool frees whose fences have passed allocatable now (small
        allocations do this themselves); how many blocks became free."""
        collected = ctypes.c_int64()
        _lib.check(self._lib.small_collect(self._h(), ctypes.byref(collected)))
        return collected.value

    def _default_streams(self) -> list[int]:
        if self.geometry.backend != "cuda":
            return []
        import torch

        return [torch.cuda.current_stream(self.geometry.device).cuda_stream]

    def empty(self, shape: Sequence[int], dtype) -> tuple[Any, Allocation] | None:
        """A new tensor from the pools and the Allocation to free once it is dead, or None."""
        import torch

        itemsize = torch.empty((), dtype=dtype).element_size()
        num_bytes = max(1, itemsize * int(np.prod(shape, dtype=np.int64)))
        block = self.allocate(num_bytes)
        return None if block is None else (block.tensor(dtype, shape), block)

    # ------------------------------------------------------------------ observation
    def stats(self) -> AllocatorStats:
        raw = _lib.Stats()
        _lib.check(self._lib.stats(self._h(), ctypes.byref(raw)))
        return AllocatorStats.from_c(raw)

    def counters(self) -> BackendCounters:
        raw = _lib.Counters()
        _lib.check(self._lib.counters(self._h(), ctypes.byref(raw)))
        return BackendCounters.from_c(raw)

    def check_integrity(self) -> None:
        """Raise VmmIntegrityError naming the first broken invariant, if any."""
        _lib.check(self._lib.check_integrity(self._h()))

    def record_calls(self, on: bool = True) -> None:
        """Tests only: clear the backend call log and record every call from now on (or
        stop, with on=False); read it with ``call_log``."""
        _lib.check(self._lib.record_calls(self._h(), 1 if on else 0))

    def call_log(self) -> list[BackendCall]:
        """Tests only: the backend calls recorded since ``record_calls()``, in order."""
        count = ctypes.c_int64()
        _lib.check(self._lib.call_log(self._h(), None, 0, ctypes.byref(count)))
        records = (_lib.CallRecord * max(1, count.value))()
        _lib.check(self._lib.call_log(self._h(), records, count.value, ctypes.byref(count)))
        return [BackendCall.from_c(records[i]) for i in range(count.value)]

    def hold_fences(self, held: bool = True) -> None:
        """Tests only, host backend: fences recorded while held stay pending (as on a busy
        GPU stream) until ``hold_fences(False)`` passes them all. A wait on a held fence
        (``lend``, ``reclaim``) blocks until then: release it from another thread."""
        _lib.check(self._lib.hold_fences(self._h(), 1 if held else 0))

    def inject_failure(self, call: str, after_calls: int = 0) -> None:
        """Tests only: make the (after_calls + 1)-th next backend call of a kind fail."""
        kinds = _lib.COUNTER_FIELDS
        if call not in kinds:
            raise ValueError(f"call={call!r} must be one of {kinds}")
        _lib.check(self._lib.inject_failure(self._h(), kinds.index(call), after_calls))

    def debug_backend_call(self, call: str, address: int, num_bytes: int, page: int = -1) -> None:
        """Tests only: one raw backend ``map`` (``num_bytes`` of pool page ``page``),
        ``unmap`` or ``set_access`` at ``address``, past every allocator check, to show the
        backend refuses what the CUDA driver refuses (raises its error). One that succeeds
        changes the mappings behind the allocator's back."""
        kinds = ("map", "unmap", "set_access")
        if call not in kinds:
            raise ValueError(f"call={call!r} must be one of {kinds}")
        kind = _lib.COUNTER_FIELDS.index(call)
        _lib.check(self._lib.backend_call(self._h(), kind, _as_int(address, "address"), _as_int(num_bytes, "num_bytes"),
                                          _as_int(page, "page")))

    def __repr__(self) -> str:
        g = self.geometry
        return (
            f"UnifiedAllocator({g.backend}, {g.num_chunks} chunks x {g.tokens_per_chunk} tokens, "
            f"page {g.page_bytes} B{', closed' if self.closed else ''})"
        )
