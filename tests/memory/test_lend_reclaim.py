"""Lending whole KV chunks to the general arena and taking them back, on the host
backend, where one memfd page really appears at two virtual addresses."""

from __future__ import annotations

import torch

from harvest.memory import ChunkState


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
        block = alloc.arena_allocate(2 * g.chunk_bytes)  # spans chunks 2 and 3
        block.tensor(torch.float32).fill_(float(round_))
        for chunk in cycled:  # stray writes into lent chunks' KV land in the dummy page
            for view in kv.values():
                view[g.chunk_slots(chunk).start] = 1e9
        block.free()
        alloc.reclaim(cycled)
        alloc.check_integrity()
    untouched = [c for c in range(g.num_chunks) if c not in cycled]
    for key, view in kv.items():
        for chunk in untouched:
            s = g.chunk_slots(chunk)
            assert torch.equal(view[s.start:s.stop], reference[key][s.start:s.stop]), (key, chunk)


def test_lent_chunk_shows_the_dummy_page_and_stray_writes_do_not_reach_the_trainer(alloc):
    g = alloc.geometry
    kv = kv_views(alloc)
    alloc.lend([1, 4])
    block = alloc.arena_allocate(g.page_bytes)
    trainer = block.tensor(torch.uint8)
    trainer.fill_(7)
    k0 = kv[(0, "k")]
    k0[g.chunk_slots(1).start] = 123.0  # a padded batch writing into a lent chunk
    # Every lent slice is the one dummy page: the write shows in the other lent chunk too.
    assert k0[g.chunk_slots(4).start, 0, 0].item() == 123.0
    assert torch.all(trainer == 7)
    block.free()


def test_lend_costs_one_unmap_per_kv_range_one_map_per_page_and_two_access_calls(alloc):
    g = alloc.geometry
    before = alloc.counters()
    alloc.lend(3)
    one = alloc.counters().minus(before)
    pages = g.pages_per_chunk
    assert one.unmap == pages  # each KV range's page: one contiguous run
    assert one.map == 2 * pages  # the dummy into the KV slot, the page into the arena
    # One over the KV side (a fully mapped span across the ranges), one for the arena run.
    assert one.set_access == 2
    assert one.mapping_calls == 3 * pages + 2
    assert one.create == one.release == one.reserve == 0
    # Adjacent chunks batch: still one unmap per KV range and two access calls.
    before = alloc.counters()
    alloc.lend([5, 6, 7])
    three = alloc.counters().minus(before)
    assert three.unmap == pages and three.set_access == 2 and three.map == 3 * 2 * pages
    before = alloc.counters()
    alloc.reclaim([5, 6, 7])
    back = alloc.counters().minus(before)
    assert back.unmap == 1 + pages  # the arena run, then the dummy out of each KV range
    # The pages into the KV ranges; the arena's dummy run once per chunk (one mapping over
    # each chunk's slots); one access call each side.
    assert back.map == 3 * pages + 3 and back.set_access == 2
    # Lent again: the arena run's dummy runs go out in one unmap before the pages come in.
    before = alloc.counters()
    alloc.lend([5, 6, 7])
    again = alloc.counters().minus(before)
    assert again.unmap == pages + 1 and again.map == 3 * 2 * pages and again.set_access == 2
    alloc.reclaim([5, 6, 7])
    assert alloc.counters().create_calls_after_init == 0


def test_a_lend_and_a_reclaim_of_one_llama_8b_chunk_stay_within_their_call_budget(make_allocator):
    # 32 layers: 64 pages per chunk. A lend can make no fewer than 3 calls per page (the
    # KV slice out, the dummy in, the page into the arena: each a separate mapping) plus
    # access; a reclaim no fewer than 2 per page plus the arena's unmap, dummy and access.
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
    assert costs == [3 * pages + 2, 2 * pages + 4, 3 * pages + 3, 2 * pages + 4] == [194, 132, 195, 132]


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
