"""Chunk geometry: tokens per chunk from the model shape and page size, and the maps
between token slots, chunks, KV ranges and arena pages."""

from __future__ import annotations

import pytest

from harvest.memory import UnifiedAllocator

from .conftest import PAGE_BYTES, TINY_SHAPE


def test_tiny_model_geometry(alloc):
    g = alloc.geometry
    assert g.bytes_per_token == 2 * 16 * 4 == 128
    assert g.tokens_per_chunk == PAGE_BYTES // 128 == 128
    assert g.pages_per_chunk == 2 * 2  # K and V of each layer
    assert g.num_chunks == 8 and g.token_capacity == 1024
    assert g.chunk_bytes == 4 * PAGE_BYTES
    assert g.kv_range_bytes == 8 * PAGE_BYTES
    assert g.kv_bytes_per_token == 128 * 4
    assert g.small_pages == 4 and g.small_bytes == 4 * PAGE_BYTES
    # KV pages, the small pool, the arena's dummy run (one allocation of 4 pages)
    assert g.total_pages == 8 * 4 + 4 + 1
    assert alloc.counters().create == g.total_pages


def test_max_tokens_rounds_up_to_whole_chunks(make_allocator):
    g = make_allocator(max_tokens=129).geometry
    assert g.num_chunks == 2 and g.token_capacity == 256


def test_default_host_page_is_2mib_and_llama8b_chunk_is_1024_tokens(make_allocator):
    # Llama-3-8B per layer: 8 KV heads x 128 head dim x 2 bytes = 2 KiB per token per K/V.
    # One layer keeps the committed host memory at 2 pages of 2 MiB.
    g = make_allocator(num_layers=1, kv_heads=8, head_dim=128, dtype_bytes=2, max_tokens=1024,
                       small_pool_bytes=0, page_bytes=0).geometry
    assert g.page_bytes == 2 << 20
    assert g.tokens_per_chunk == 1024
    assert g.num_chunks == 1


def test_slot_chunk_and_address_maps(alloc):
    g = alloc.geometry
    assert g.chunk_slots(3) == range(384, 512)
    assert g.slot_to_chunk(383) == 2 and g.slot_to_chunk(384) == 3
    assert g.kv_range_address(0, "k") == g.kv_base
    assert g.kv_range_address(0, "v") == g.kv_base + g.kv_range_bytes
    assert g.kv_range_address(1, "v") == g.kv_base + 3 * g.kv_range_bytes
    assert g.kv_slice_address(5, 1, "k") == g.kv_base + 2 * g.kv_range_bytes + 5 * PAGE_BYTES
    assert g.arena_page_address(2, 3) == g.arena_base + 2 * g.chunk_bytes + 3 * PAGE_BYTES
    assert g.arena_address_to_page(g.arena_page_address(6, 1) + 100) == (6, 1)
    for bad in (lambda: g.chunk_slots(8), lambda: g.slot_to_chunk(1024), lambda: g.kv_range_address(2, "k"),
                lambda: g.kv_range_address(0, "q"), lambda: g.arena_address_to_page(g.arena_base - 1)):
        with pytest.raises(ValueError):
            bad()


def test_ranges_do_not_overlap(alloc):
    g = alloc.geometry
    spans = sorted([(g.kv_base, g.kv_base + g.kv_range_bytes * g.pages_per_chunk),
                    (g.arena_base, g.arena_base + g.arena_bytes),
                    (g.small_base, g.small_base + g.small_bytes)])
    for (_, end), (start, _) in zip(spans, spans[1:]):
        assert end <= start


def test_no_small_pool(make_allocator):
    alloc = make_allocator(small_pool_bytes=0)
    assert alloc.geometry.small_pages == 0
    # allocate() then serves every size from the general arena (whole pages).
    assert alloc.allocate(100) is None  # nothing lent yet
    alloc.lend([0])
    block = alloc.allocate(100)
    assert block.pool == "arena"
    block.free()


def test_repr_and_context_manager():
    with UnifiedAllocator(**TINY_SHAPE, max_tokens=128, page_bytes=PAGE_BYTES) as alloc:
        assert "1 chunks x 128 tokens" in repr(alloc)
    assert alloc.closed and "closed" in repr(alloc)
