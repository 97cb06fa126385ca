"""The small-tensor pool: buddy blocks of 2 KiB * 2^k, always mapped; a block freed with
streams is reused only after their fences pass (issue 18, defect 6)."""

from __future__ import annotations

import random

import pytest
import torch

from harvest.memory import VmmInvalidArgument, VmmOsError

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


def test_a_block_freed_with_streams_is_reused_only_after_their_fences_pass(alloc):
    # Fill the pool with whole-page blocks; free one on two streams whose work is still queued.
    whole = [alloc.small_allocate(PAGE_BYTES - 1) for _ in range(alloc.geometry.small_pages)]
    alloc.hold_fences()
    alloc.record_calls()
    whole[1].free(streams=[5, 6])
    stats = alloc.stats()
    assert (stats.small_pending_frees, stats.small_pending_bytes) == (1, PAGE_BYTES)
    assert stats.small_used_bytes == (len(whole) - 1) * PAGE_BYTES and stats.small_allocations == len(whole) - 1
    assert alloc.small_allocate(1) is None  # not reused while a stream may still use it
    assert alloc.collect_small_frees() == 0
    alloc.check_integrity()
    with pytest.raises(VmmInvalidArgument, match="already free .* waits for the fences"):
        whole[1].allocator.free_address(whole[1].address, "small", [])
    alloc.hold_fences(False)
    reused = alloc.small_allocate(PAGE_BYTES - 1)  # collected first, then handed out
    assert reused.address == whole[1].address and alloc.stats().small_pending_frees == 0
    log = alloc.call_log()
    records = [i for i, call in enumerate(log) if call.kind == "fence_record"]
    assert sorted(log[i].stream for i in records) == [5, 6]
    queries = [call for call in log if call.kind == "fence_query"]
    assert not queries[0].passed and queries[-1].passed
    for block in (whole[0], reused, *whole[2:]):
        block.free()


def test_fenced_frees_are_collected_oldest_first_and_merge_with_their_buddies(alloc):
    blocks = [alloc.small_allocate(2048) for _ in range(4)]  # the first 8 KiB of page 0
    alloc.hold_fences()
    for block in blocks:
        block.free(streams=[3])
    assert alloc.stats().small_pending_frees == 4
    alloc.hold_fences(False)
    assert alloc.collect_small_frees() == 4
    stats = alloc.stats()
    assert stats.small_pending_frees == stats.small_used_bytes == 0
    assert stats.small_largest_free_bytes == PAGE_BYTES  # merged back into whole pages
    alloc.check_integrity()


def test_a_failed_fence_record_frees_nothing(alloc):
    block = alloc.small_allocate(100)
    before = snapshot(alloc)
    alloc.inject_failure("fence_record", 1)
    with pytest.raises(VmmOsError, match="host fence failed: injected failure"):
        block.free(streams=[1, 2])
    after = snapshot(alloc)
    assert (after[0], after[2]) == (before[0], before[2])  # still allocated, nothing pending
    block.free(streams=[1, 2])
    assert alloc.collect_small_frees() == 1
