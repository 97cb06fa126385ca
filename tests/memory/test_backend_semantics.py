"""The host backend refuses what the CUDA driver refuses (cuda.h, group CUDA_VA), so a
call sequence that passes on CPU is one a GPU accepts: set-access and unmap only over
whole adjacent mappings with no hole ("a fully mapped address range"; cuMemUnmap "cannot
unmap a sub-range"), a map only where nothing is mapped, inside a reservation, page
aligned and no longer than its allocation (offset "currently must be zero"). Each call
here goes straight to the backend (debug_backend_call), past the allocator's own checks;
every one is refused and leaves the allocator intact."""

from __future__ import annotations

import pytest

from harvest.memory import VmmOsError

from .conftest import PAGE_BYTES


def refused(alloc, call, address, num_bytes, page=-1, match=None):
    before = alloc.counters()
    with pytest.raises(VmmOsError, match=match) as info:
        alloc.debug_backend_call(call, address, num_bytes, page)
    assert "EINVAL" in str(info.value) and "the CUDA driver refuses this too" in str(info.value)
    assert getattr(alloc.counters().minus(before), call) == 1  # counted as the driver call it stands for
    alloc.check_integrity()
    return str(info.value)


def kv_slot(g, chunk, range_index):
    return g.kv_base + range_index * g.kv_range_bytes + chunk * g.page_bytes


def test_set_access_needs_a_fully_mapped_range(alloc):
    g = alloc.geometry
    never_lent = g.arena_base + 2 * g.chunk_bytes
    message = refused(alloc, "set_access", never_lent, g.page_bytes, match=r"mprotect\(PROT_READ\|PROT_WRITE\)")
    assert "no mapping starts" in message
    alloc.lend(3)
    lent = g.arena_base + 3 * g.chunk_bytes
    # The lent chunk's pages and one page of its never-lent neighbour: a hole at the end.
    message = refused(alloc, "set_access", lent, g.chunk_bytes + g.page_bytes)
    assert "is not fully mapped: nothing is mapped at " + hex(lent + g.chunk_bytes) in message


def test_set_access_may_span_many_adjacent_mappings(alloc):
    g = alloc.geometry
    alloc.lend(4)  # chunk 4's KV slices keep their pages: every KV slot stays mapped
    before = alloc.counters()
    alloc.debug_backend_call("set_access", g.kv_base, g.pages_per_chunk * g.kv_range_bytes)  # every KV range
    assert alloc.counters().minus(before).set_access == 1
    alloc.check_integrity()
    alloc.reclaim(4)


def test_unmap_takes_whole_mappings_only(alloc):
    g = alloc.geometry
    alloc.lend(5)
    alloc.reclaim(5)  # chunk 5's arena slots: the arena's dummy run, one mapping of 4 pages
    run = g.arena_base + 5 * g.chunk_bytes
    assert "no mapping starts at" in refused(alloc, "unmap", run + g.page_bytes, g.page_bytes)
    assert "ends inside the mapping" in refused(alloc, "unmap", run, g.page_bytes)
    assert "no mapping starts at" in refused(alloc, "unmap", g.arena_base, g.page_bytes)  # never mapped
    alloc.lend(5)  # the real move takes the whole run out in one call
    alloc.reclaim(5)


def test_map_only_into_empty_reserved_page_aligned_slots_and_never_past_its_allocation(alloc):
    g = alloc.geometry
    empty = g.arena_base + 2 * g.chunk_bytes  # a never-lent chunk's arena slots hold nothing
    assert "already mapped" in refused(alloc, "map", kv_slot(g, 1, 0), g.page_bytes, page=0)
    assert "of an allocation of" in refused(alloc, "map", empty, 2 * g.page_bytes, page=0)
    assert "multiples of the page" in refused(alloc, "map", empty + 4096, g.page_bytes, page=0)
    assert "not inside one reserved range" in refused(alloc, "map", PAGE_BYTES, g.page_bytes, page=0)
    alloc.lend(2)  # the slots the refused maps aimed at still work
    alloc.reclaim(2)


def test_only_mapping_calls_can_be_made_raw(alloc):
    with pytest.raises(ValueError, match="must be one of"):
        alloc.debug_backend_call("reserve", 0, 0)
    with pytest.raises(ValueError, match="is not a pool page"):
        alloc.debug_backend_call("map", alloc.geometry.arena_base, PAGE_BYTES, page=alloc.geometry.total_pages)
