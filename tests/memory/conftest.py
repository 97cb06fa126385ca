"""Allocators for the memory tests: the host backend with small pages.

The tiny test models' KV geometry (2 KV heads x 16 head dim x 4 bytes = 128 bytes per
token per layer per K/V) with 16 KiB pages gives 128-token chunks, so a pool of a few
chunks is a few hundred KiB of host memory. Every allocator a test makes is checked
for integrity and closed at the end of the test.
"""

from __future__ import annotations

import pytest

from harvest.memory import UnifiedAllocator, VmmInvalidArgument

TINY_SHAPE = dict(num_layers=2, kv_heads=2, head_dim=16, dtype_bytes=4)
PAGE_BYTES = 16 * 1024


def snapshot(alloc: UnifiedAllocator):
    """Everything observable about an allocator's state, for 'nothing changed' checks."""
    return alloc.stats(), alloc.counters(), alloc.chunk_table()


@pytest.fixture
def make_allocator():
    made: list[UnifiedAllocator] = []

    def make(**overrides) -> UnifiedAllocator:
        kwargs = dict(TINY_SHAPE, max_tokens=8 * 128, small_pool_bytes=4 * PAGE_BYTES, page_bytes=PAGE_BYTES)
        kwargs.update(overrides)
        alloc = UnifiedAllocator(**kwargs)
        made.append(alloc)
        return alloc

    yield make
    for alloc in made:
        if not alloc.closed:
            alloc.check_integrity()
            try:
                alloc.close()
            except VmmInvalidArgument:
                pass  # a failed test's traceback still holds tensor views; GC frees it later


@pytest.fixture
def alloc(make_allocator) -> UnifiedAllocator:
    return make_allocator()
