"""The cuda backend on a real GPU: the same semantics as the host backend, device
tensors through __cuda_array_interface__, and fences on CUDA streams (the KV fences of a
lend on the decode streams; tests/memory/test_cuda_fences_fake_driver.py checks the
order of the driver calls without a GPU).

Skipped without a GPU (tests/conftest.py); `make test-gpu` runs them."""

from __future__ import annotations

import pytest
import torch

from harvest.memory import ChunkState, UnifiedAllocator
from harvest.memory.fuzz import run_fuzz

pytestmark = pytest.mark.gpu

# 128 bytes per token per layer per K/V: 16384 tokens per 2 MiB chunk slice.
SHAPE = dict(num_layers=2, kv_heads=2, head_dim=16, dtype_bytes=4)


@pytest.fixture
def cuda_alloc():
    alloc = UnifiedAllocator(**SHAPE, max_tokens=4 * 16384, small_pool_bytes=2 << 20, backend="cuda")
    yield alloc
    alloc.check_integrity()
    torch.cuda.synchronize()
    alloc.close()


def test_geometry_uses_the_device_granularity(cuda_alloc):
    g = cuda_alloc.geometry
    assert g.page_bytes >= 2 << 20 and g.page_bytes % (2 << 20) == 0
    assert g.tokens_per_chunk == g.page_bytes // 128
    assert cuda_alloc.counters().create == g.total_pages


def test_kv_and_arena_views_alias_on_the_device(cuda_alloc):
    g = cuda_alloc.geometry
    kv = {(layer, kind): cuda_alloc.kv_tensor(layer, kind, torch.float32, (g.token_capacity, 2, 16))
          for layer in range(2) for kind in ("k", "v")}
    assert all(v.is_cuda for v in kv.values())
    slots = g.chunk_slots(2)
    written = {}
    for i, (key, view) in enumerate(kv.items()):
        view[slots.start:slots.stop] = i + 1.0
        written[key] = view[slots.start:slots.stop].clone()
    untouched = kv[(0, "k")][: slots.start].clone()
    cuda_alloc.lend(2)
    block = cuda_alloc.arena_allocate(g.chunk_bytes)
    arena = block.tensor(torch.float32).view(g.pages_per_chunk, g.tokens_per_chunk, 2, 16)
    for (layer, kind), values in written.items():
        assert torch.equal(arena[g.kv_range_index(layer, kind)], values)
    # The KV slices keep their pages while the chunk is lent: one device page at two
    # addresses, each seeing what a kernel wrote through the other.
    kv[(1, "v")][slots.start] = 5.0
    assert torch.all(arena[g.kv_range_index(1, "v"), 0] == 5.0)
    arena.fill_(-3.0)
    assert torch.all(kv[(1, "v")][slots.start:slots.stop] == -3.0)
    block.free()  # fence on torch's current stream
    cuda_alloc.reclaim(2)
    torch.cuda.synchronize()
    assert torch.all(kv[(0, "k")][slots.start:slots.stop] == -3.0)
    assert torch.equal(kv[(0, "k")][: slots.start], untouched)


def test_lend_call_counts_match_the_host_backend(cuda_alloc):
    pages = cuda_alloc.geometry.pages_per_chunk
    before = cuda_alloc.counters()
    cuda_alloc.lend(1)
    delta = cuda_alloc.counters().minus(before)
    assert (delta.unmap, delta.map, delta.set_access, delta.create) == (0, pages, 1, 0)
    cuda_alloc.reclaim(1)


def test_reclaim_waits_for_the_stream_that_used_the_pages(cuda_alloc):
    cuda_alloc.lend(3)
    block = cuda_alloc.arena_allocate(1 << 20)
    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream):
        torch.cuda._sleep(200_000_000)  # keep the stream busy well past the free
        block.tensor(torch.float32).fill_(1.0)
    block.free(streams=[stream.cuda_stream])
    assert cuda_alloc.chunk_info(3).fence_pending
    cuda_alloc.reclaim(3)  # waits on the event, not the device
    assert stream.query()
    assert cuda_alloc.counters().fence_wait >= 1


def test_a_lend_leaves_the_kv_pages_mapped_until_the_decode_stream_passes_its_event(cuda_alloc):
    assert cuda_alloc.fence_streams == (0,)  # the legacy default stream until told otherwise
    decode = torch.cuda.Stream()
    cuda_alloc.set_fence_streams([decode, None])
    g = cuda_alloc.geometry
    kv = cuda_alloc.kv_tensor(0, "k", torch.float32, (g.token_capacity, 2, 16))
    slots = g.chunk_slots(2)
    with torch.cuda.stream(decode):
        torch.cuda._sleep(500_000_000)  # a decode step still running ...
        kv[slots.start:slots.stop].fill_(4.0)  # ... that writes the chunk's KV after it
    assert cuda_alloc.lend(2, wait=False) is False  # never waits for decode
    assert cuda_alloc.chunk_info(2).state == ChunkState.LENDING and cuda_alloc.chunk_info(2).fence_pending
    assert cuda_alloc.finish_lends() == [] and cuda_alloc.arena_allocate(1) is None
    decode.synchronize()
    assert cuda_alloc.finish_lends() == [2]
    block = cuda_alloc.arena_allocate(g.chunk_bytes)
    arena = block.tensor(torch.float32).view(g.pages_per_chunk, g.tokens_per_chunk, 2, 16)
    assert torch.all(arena[g.kv_range_index(0, "k")] == 4.0)  # the write landed before the unmap
    block.free(streams=[])
    del arena, block
    # A reclaim never waits for decode: the KV side stayed mapped, so a decode step still
    # writing the chunk's KV while the arena side is unmapped is harmless.
    with torch.cuda.stream(decode):
        torch.cuda._sleep(200_000_000)
        kv[slots.start:slots.stop].fill_(7.0)
    cuda_alloc.reclaim(2)
    assert cuda_alloc.chunk_info(2).state == ChunkState.MAPPED
    decode.synchronize()
    assert torch.all(kv[slots.start:slots.stop] == 7.0)
    del kv


def test_a_small_block_freed_on_a_busy_stream_is_not_reused_before_it_passes(cuda_alloc):
    g = cuda_alloc.geometry
    whole = cuda_alloc.small_allocate(g.page_bytes - 1)  # the pool's only page
    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream):
        torch.cuda._sleep(500_000_000)
        whole.tensor().fill_(1)
    whole.free(streams=[stream])
    assert cuda_alloc.small_allocate(1) is None and cuda_alloc.stats().small_pending_frees == 1
    stream.synchronize()
    again = cuda_alloc.small_allocate(g.page_bytes - 1)
    assert again.address == whole.address
    again.free(streams=[])


@pytest.mark.timeout(300)
def test_fuzz_on_the_device(cuda_alloc):
    report = run_fuzz(cuda_alloc, ops=20_000, seed=5)
    assert report.violations == 0, report.first_violation
    assert report.leak_free_at_end


def test_no_driver_call_leaks_on_create_and_destroy():
    for _ in range(3):
        alloc = UnifiedAllocator(**SHAPE, max_tokens=16384, backend="cuda")
        alloc.close()
    free_before, _ = torch.cuda.mem_get_info()
    alloc = UnifiedAllocator(**SHAPE, max_tokens=8 * 16384, backend="cuda")
    free_during, _ = torch.cuda.mem_get_info()
    alloc.close()
    free_after, _ = torch.cuda.mem_get_info()
    assert free_before - free_during >= 8 * 4 * (2 << 20)  # the pages are committed at start-up
    assert abs(free_after - free_before) < (64 << 20)  # ... and released at close
