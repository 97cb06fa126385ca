"""A failing backend call (injected) surfaces as an exception naming the call and its
error code, and the move it interrupted is rolled back: nothing changes."""

from __future__ import annotations

import pytest
import torch

from harvest.memory import ChunkState, VmmOsError

from .conftest import PAGE_BYTES


def state(alloc):
    return alloc.stats(), alloc.chunk_table()


# A lend's calls: the arena's maps (one per page: chunks 2-3 are 8 pages), one set_access
# over the arena run; the KV side makes none.
@pytest.mark.parametrize("call, after", [("map", 0), ("map", 5), ("map", 7), ("set_access", 0)])
def test_a_failed_lend_is_rolled_back(alloc, call, after):
    kv = alloc.kv_tensor(1, "v", torch.float32)
    kv.copy_(torch.arange(kv.numel(), dtype=torch.float32))
    before = state(alloc)
    alloc.inject_failure(call, after)
    with pytest.raises(VmmOsError, match=r"failed: injected failure .* \(rolled back: chunks 2-3 unchanged\)"):
        alloc.lend([2, 3])
    assert state(alloc) == before
    alloc.check_integrity()
    assert torch.equal(kv, torch.arange(kv.numel(), dtype=torch.float32))  # the KV cache untouched
    alloc.lend([2, 3])  # and the chunks still work
    alloc.reclaim([2, 3])


# Lent before, a lend first unmaps the arena's dummy run from the chunk's arena slots.
@pytest.mark.parametrize("call, after", [("unmap", 0), ("map", 0), ("map", 3), ("set_access", 0)])
def test_a_failed_lend_of_a_chunk_lent_before_is_rolled_back_to_the_dummy_run(alloc, call, after):
    alloc.lend(5)
    alloc.reclaim(5)
    before = state(alloc)
    alloc.inject_failure(call, after)
    with pytest.raises(VmmOsError, match=r"rolled back: chunks 5 unchanged"):
        alloc.lend(5)
    assert state(alloc) == before
    alloc.check_integrity()  # the arena slots hold the dummy run again
    alloc.lend(5)
    alloc.reclaim(5)


# A reclaim's calls: the wait for the arena frees' fences, the arena's unmap, the map of
# its dummy run, one set_access; the KV side makes none.
@pytest.mark.parametrize("call, after", [("unmap", 0), ("map", 0), ("set_access", 0), ("fence_wait", 0)])
def test_a_failed_reclaim_is_rolled_back(alloc, call, after):
    alloc.lend([4])
    block = alloc.arena_allocate(PAGE_BYTES)
    block.tensor().fill_(5)
    block.free(streams=[1])
    before = state(alloc)
    alloc.inject_failure(call, after)
    with pytest.raises(VmmOsError, match="rolled back: chunks 4 unchanged"):
        alloc.reclaim(4)
    assert state(alloc) == before
    alloc.check_integrity()
    again = alloc.arena_allocate(PAGE_BYTES)  # still lent and usable
    assert int(again.tensor()[0]) == 5
    again.free()
    alloc.reclaim(4)


def test_errors_name_the_syscall_and_errno_code(alloc):
    alloc.inject_failure("map")
    with pytest.raises(VmmOsError) as info:
        alloc.lend(0)
    assert "mmap(MAP_SHARED|MAP_FIXED memfd page) failed" in str(info.value)
    assert info.value.status == 4  # HVMM_ERR_OS


def test_a_failed_rollback_marks_the_chunk_broken_and_the_rest_keeps_working(alloc):
    # The lend's third map into the arena fails; undoing it then unmaps the two pages
    # mapped so far (one call over their run): make that unmap fail too.
    kv = alloc.kv_tensor(0, "k", torch.float32)
    kv.fill_(3.0)
    alloc.inject_failure("map", 2)
    alloc.inject_failure("unmap", 0)
    with pytest.raises(VmmOsError, match="undoing the move also failed .* chunks 6 are now broken"):
        alloc.lend(6)
    info = alloc.chunk_info(6)
    assert info.state == ChunkState.BROKEN
    assert alloc.stats().chunks_broken == 1
    with pytest.raises(ValueError, match="chunk 6 is broken"):
        alloc.lend(6)
    alloc.check_integrity()  # the broken chunk's arena slots are excluded, the rest is consistent
    assert torch.all(kv == 3.0)  # its KV slices, like every other, were never touched
    before = alloc.counters()
    alloc.lend([0, 1])
    assert alloc.counters().minus(before).set_access == 1  # one arena run, nothing on the KV side
    block = alloc.arena_allocate(2 * alloc.geometry.chunk_bytes)
    block.free()
    alloc.reclaim([0, 1])


def test_injection_kind_must_exist(alloc):
    with pytest.raises(ValueError, match="call='mmap' must be one of"):
        alloc.inject_failure("mmap")
