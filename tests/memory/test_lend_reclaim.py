"""Lending whole KV chunks to the general arena and taking them back, on the host
backend, where one memfd page really appears at two virtual addresses."""

from __future__ import annotations

import pytest
import torch

from harvest.memory import ChunkState, VmmInvalidArgument


def kv_views(alloc):
    g = alloc.geometry
    shape = (g.token_capacity, 2, 16)
    return {(layer, kind): alloc.kv_tensor(layer, kind, torch.float32, shape)
            for layer in range(g.num_layers) for kind in ("k", "v")}


def test_kv_of_a_lent_then_reclaimed_chunk_and_the_arena_are_the_same_memory(alloc):
    g = alloc.geometry
    kv = kv_views(alloc)
    chunk = 5
    slots = g.chunk_slots(chunk)
    written = {}
    for i, (key, view) in enumerate(kv.items()):
        view[slots.start:slots.stop] = torch.arange(g.tokens_per_chunk * 32, dtype=torch.float32).view(-1, 2, 16) + i
        written[key] = view[slots.start:slots.stop].clone()
    alloc.lend(chunk)
    block = alloc.arena_allocate(g.chunk_bytes)
    assert block.address == g.arena_base + chunk * g.chunk_bytes  # the only lent chunk
    arena = block.tensor(torch.float32).view(g.pages_per_chunk, g.tokens_per_chunk, 2, 16)
    # KV written before lending is visible through the arena, page by page in range order.
    for (layer, kind), values in written.items():
        assert torch.equal(arena[g.kv_range_index(layer, kind)], values)
    # And what the trainer writes is what the KV cache sees after reclaim.
    arena.copy_(-torch.rand_like(arena))
    expected = arena.clone()
    block.free()
    alloc.reclaim(chunk)
    for (layer, kind), view in kv.items():
        assert torch.equal(view[slots.start:slots.stop], expected[g.kv_range_index(layer, kind)])


def test_kv_of_chunks_never_lent_is_untouched_by_lend_reclaim_cycles(alloc):
    g = alloc.geometry
    kv = kv_views(alloc)
    generator = torch.Generator().manual_seed(0)
    for view in kv.values():
        view.copy_(torch.rand(view.shape, generator=generator))
    reference = {key: view.clone() for key, view in kv.items()}
    cycled = [2, 3, 6]
    for round_ in range(20):
        alloc.lend(cycled if round_ % 2 else cycled[::-1])
        # Every lent page written: chunks 2 and 3 (one contiguous arena run), then 6.
        blocks = [alloc.arena_allocate(2 * g.chunk_bytes), alloc.arena_allocate(g.chunk_bytes)]
        for block in blocks:
            block.tensor(torch.float32).fill_(float(round_))
            block.free()
        alloc.reclaim(cycled)
        alloc.check_integrity()
    untouched = [c for c in range(g.num_chunks) if c not in cycled]
    for key, view in kv.items():
        for chunk in untouched:
            s = g.chunk_slots(chunk)
            assert torch.equal(view[s.start:s.stop], reference[key][s.start:s.stop]), (key, chunk)


def test_a_lent_chunk_is_the_same_memory_at_its_kv_slots_and_in_the_arena(alloc):
    # The KV side never changes: a lent chunk's pages are mapped in the arena as well, so
    # what the trainer writes shows at the chunk's KV slots (nothing serves them: their
    # slots left the free list, and the padded rows of a batch write to slot 0, in chunk
    # 0, which is never lent), and a write at those slots reaches the trainer's tensor.
    g = alloc.geometry
    kv = kv_views(alloc)
    alloc.lend([1, 4])
    block = alloc.arena_allocate(g.page_bytes)  # the first page of the lowest lent chunk
    assert block.address == g.arena_base + 1 * g.chunk_bytes
    trainer = block.tensor(torch.float32)
    trainer.fill_(7.0)
    k0 = kv[(0, "k")]  # range 0's page is the chunk's first arena page
    assert torch.all(k0[g.chunk_slots(1)] == 7.0)
    assert torch.all(k0[g.chunk_slots(4)] != 7.0)  # each lent chunk has pages of its own
    k0[g.chunk_slots(1).start] = 123.0
    assert trainer[0].item() == 123.0
    block.free()
    alloc.check_integrity()


def test_a_lent_chunks_slots_cannot_be_handed_to_decode(alloc):
    g = alloc.geometry
    alloc.lend(3)
    with pytest.raises(VmmInvalidArgument, match="chunk 3, which is lent: its pages are .* the trainer's"):
        alloc.mark_slots_live([g.chunk_slots(3).start])
    alloc.reclaim(3)
    alloc.mark_slots_live([g.chunk_slots(3).start])
    alloc.check_integrity()


def test_lend_maps_the_pages_into_the_arena_once_and_reclaim_puts_the_dummy_run_there(alloc):
    g = alloc.geometry
    pages = g.pages_per_chunk
    before = alloc.counters()
    alloc.lend(3)
    one = alloc.counters().minus(before)
    assert one.unmap == 0  # the KV slices keep their pages
    assert one.map == pages  # the chunk's pages into its arena run
    assert one.set_access == 1  # over that run
    assert one.mapping_calls == pages + 1
    assert one.create == one.release == one.reserve == 0
    # Adjacent chunks batch: still one access call over their joint arena run.
    before = alloc.counters()
    alloc.lend([5, 6, 7])
    three = alloc.counters().minus(before)
    assert three.unmap == 0 and three.set_access == 1 and three.map == 3 * pages
    before = alloc.counters()
    alloc.reclaim([5, 6, 7])
    back = alloc.counters().minus(before)
    # The arena run out in one unmap; the arena's dummy run once per chunk (one mapping
    # over each chunk's slots); one access call. Nothing on the KV side.
    assert back.unmap == 1 and back.map == 3 and back.set_access == 1
    # Lent again: the arena run's dummy runs go out in one unmap before the pages come in.
    before = alloc.counters()
    alloc.lend([5, 6, 7])
    again = alloc.counters().minus(before)
    assert again.unmap == 1 and again.map == 3 * pages and again.set_access == 1
    alloc.reclaim([5, 6, 7])
    assert alloc.counters().create_calls_after_init == 0


def test_a_lend_and_a_reclaim_of_one_llama_8b_chunk_stay_within_their_call_budget(make_allocator):
    # 32 layers: 64 pages per chunk. A lend maps each page into the arena (one physical
    # allocation per page, and cuMemMap maps an allocation from offset 0 only) plus one
    # access call; a reclaim is the arena's unmap, its dummy run and one access call.
    alloc = make_allocator(num_layers=32, max_tokens=4 * 128, small_pool_bytes=0)
    pages = alloc.geometry.pages_per_chunk
    assert pages == 64
    costs = []
    for move in (alloc.lend, alloc.reclaim, alloc.lend, alloc.reclaim):
        before = alloc.counters()
        move(2)
        costs.append(alloc.counters().minus(before).mapping_calls)
        alloc.check_integrity()
    # First lend; reclaim; lend again (the arena's dummy run goes out first); reclaim.
    assert costs == [pages + 1, 3, pages + 2, 3] == [65, 3, 66, 3]


def test_states_queries_and_slot_ranges(alloc):
    g = alloc.geometry
    alloc.mark_slots_live([0, 1, 130])  # chunks 0 and 1
    assert not alloc.can_lend(0) and not alloc.can_lend(1) and alloc.can_lend(2)
    assert alloc.lendable_chunks() == [2, 3, 4, 5, 6, 7]
    alloc.lend(alloc.lendable_chunks())
    assert alloc.reclaimable_chunks() == [2, 3, 4, 5, 6, 7]
    block = alloc.arena_allocate(1)
    info = alloc.chunk_info(g.arena_address_to_page(block.address)[0])
    assert info.state == ChunkState.LENT and info.used_pages == 1 and not info.fence_pending
    assert not alloc.can_reclaim(info.chunk)
    stats = alloc.stats()
    assert stats.chunks_lent == 6 and stats.chunks_mapped == 2 and stats.live_slots == 3
    assert stats.bytes_lent == 6 * g.chunk_bytes and stats.pages_lent == 24 and stats.pages_lent_used == 1
    assert stats.pages_kv_mapped == 2 * g.pages_per_chunk
    block.free()
    alloc.reclaim(alloc.reclaimable_chunks())
    alloc.mark_slots_free([0, 1, 130])
    assert alloc.stats().chunks_mapped == 8 and alloc.stats().live_slots == 0


def test_slot_liveness_accepts_numpy_and_torch(alloc):
    import numpy as np

    alloc.mark_slots_live(np.array([5, 6], dtype=np.int32))
    alloc.mark_slots_live(torch.tensor([7, 8]))
    alloc.mark_slots_free(range(5, 9))
    assert alloc.stats().live_slots == 0


def test_fences_are_recorded_on_free_and_waited_on_by_reclaim(alloc):
    alloc.lend(0)
    block = alloc.arena_allocate(100)
    before = alloc.counters()
    block.free(streams=[0, 12345])  # host: streams are ignored, fences pass at once
    assert alloc.stats().fences_pending == 2
    alloc.reclaim(0)
    delta = alloc.counters().minus(before)
    assert delta.fence_record == 2 and delta.fence_wait == 2
    assert alloc.stats().fences_pending == 0
    # Events are pooled: another round creates none.
    alloc.lend(0)
    alloc.arena_allocate(100).free(streams=[0, 12345])
    alloc.reclaim(0)
    assert alloc.counters().event_create == 2
