"""The small-tensor pool: buddy blocks of 2 KiB * 2^k, always mapped."""

from __future__ import annotations

import random

import torch

from .conftest import PAGE_BYTES, snapshot

BLOCK = 2048


def test_sizes_round_up_to_power_of_two_blocks_aligned_to_their_size(alloc):
    g = alloc.geometry
    for num_bytes, rounded in ((1, BLOCK), (BLOCK, BLOCK), (BLOCK + 1, 2 * BLOCK), (5000, 4 * BLOCK),
                               (PAGE_BYTES - 1, PAGE_BYTES)):
        block = alloc.small_allocate(num_bytes)
        assert (block.address - g.small_base) % rounded == 0
        stats = alloc.stats()
        assert stats.small_used_bytes == rounded and stats.small_requested_bytes == num_bytes
        block.free()
    assert alloc.stats().small_used_bytes == 0


def test_freeing_everything_coalesces_back_to_whole_pages(alloc):
    rng = random.Random(3)
    blocks = []
    while True:
        block = alloc.small_allocate(rng.randint(1, 6000))
        if block is None:
            break
        blocks.append(block)
        alloc.check_integrity()
    assert alloc.stats().small_largest_free_bytes < 8192
    rng.shuffle(blocks)
    for block in blocks:
        block.free()
        alloc.check_integrity()
    stats = alloc.stats()
    assert stats.small_largest_free_bytes == PAGE_BYTES and stats.small_used_bytes == 0
    whole = [alloc.small_allocate(PAGE_BYTES - 1) for _ in range(alloc.geometry.small_pages)]
    assert all(whole) and alloc.small_allocate(1) is None
    for block in whole:
        block.free()


def test_exhaustion_is_a_value_and_changes_nothing(alloc):
    held = [alloc.small_allocate(PAGE_BYTES - 1) for _ in range(alloc.geometry.small_pages)]
    before = snapshot(alloc)
    assert alloc.small_allocate(1) is None
    assert alloc.allocate(100) is None
    assert snapshot(alloc) == before
    for block in held:
        block.free()


def test_blocks_do_not_overlap_in_memory(alloc):
    rng = random.Random(7)
    live = {}
    for step in range(400):
        if live and (rng.random() < 0.45 or len(live) > 20):
            block, value = live.popitem()
            tensor = block.tensor()
            assert torch.all(tensor == value), "another block wrote into this one"
            del tensor
            block.free()
        else:
            block = alloc.small_allocate(rng.randint(1, 9000))
            if block is None:
                continue
            value = step % 251
            block.tensor().fill_(value)
            live[block] = value
    for block in live:
        block.free()


def test_unified_allocate_routes_by_size(alloc):
    alloc.lend(0)
    small = alloc.allocate(PAGE_BYTES - 1)
    large = alloc.allocate(PAGE_BYTES)
    assert (small.pool, large.pool) == ("small", "arena")
    small.free()
    large.free()
