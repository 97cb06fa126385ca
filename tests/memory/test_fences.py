"""KV fences: no lend maps a chunk's pages into the trainer's arena before the work
queued on every registered fence stream (decode's) has passed an event recorded for it,
since that work may still write the chunk's KV slots (issue 18, defect 2). A reclaim
waits for the fences of the trainer's frees in the arena, never for decode's: the KV
slices of a lent chunk never lose their pages.

On the host backend the call log records every backend call in order (the same code
path the cuda backend runs: only do_record_fence / do_fence_passed / do_wait_fence differ),
and hold_fences keeps fences pending as events on a busy GPU stream are, so the
non-blocking lend (finished at a later call) and the blocking one (waits) run on CPU.
"""

from __future__ import annotations

import threading
import time

import pytest
import torch

from harvest.memory import ChunkState, VmmInvalidArgument, VmmOsError

from .conftest import snapshot

STREAMS = (11, 22, 0)  # two stream handles and the legacy default stream


class _TorchLikeStream:
    def __init__(self, handle: int):
        self.cuda_stream = handle


def arena_maps(alloc, log):
    """Indices of the map calls into the general arena (a lend handing pages to the trainer)."""
    g = alloc.geometry
    end = g.arena_base + g.chunk_bytes * g.num_chunks
    return [i for i, call in enumerate(log) if call.kind == "map" and g.arena_base <= call.address < end]


def kv_calls(alloc, log):
    """The mapping calls that hit the KV ranges (none after start-up)."""
    g = alloc.geometry
    end = g.kv_base + g.kv_range_bytes * g.pages_per_chunk
    return [call for call in log if call.kind in ("map", "unmap", "set_access") and g.kv_base <= call.address < end]


def recorded_fences(log):
    """stream -> event of every fence_record in the log."""
    return {call.stream: call.event for call in log if call.kind == "fence_record"}


def first_pass(log, event, kinds=("fence_wait", "fence_query")):
    """Index of the first call that saw `event` passed (a wait that returned, a query that said so)."""
    for i, call in enumerate(log):
        if call.event == event and call.kind in kinds and (call.kind == "fence_wait" or call.passed):
            return i
    return None


def state(alloc, chunk):
    return alloc.chunk_table()[chunk].state


def test_fence_streams_take_torch_streams_ints_and_none_for_the_default_stream(alloc):
    assert alloc.fence_streams == ()  # host: nothing queued anywhere
    alloc.set_fence_streams([_TorchLikeStream(5), None, 5, 9])
    assert alloc.fence_streams == (5, 0, 9)  # duplicates dropped, None is the legacy stream 0
    alloc.set_fence_streams([])
    assert alloc.fence_streams == ()
    with pytest.raises(ValueError, match="negative"):
        alloc.set_fence_streams([-1])
    with pytest.raises(TypeError, match="stream must be an int"):
        alloc.set_fence_streams(["decode"])


def test_a_lend_maps_pages_into_the_arena_only_after_every_fence_stream_passed_its_event(alloc):
    alloc.set_fence_streams(STREAMS)
    alloc.record_calls()
    alloc.lend([3, 4])
    log = alloc.call_log()
    fences = recorded_fences(log)
    assert set(fences) == set(STREAMS)
    maps = arena_maps(alloc, log)
    assert len(maps) == 2 * alloc.geometry.pages_per_chunk  # one per page of chunks 3 and 4
    for stream, event in fences.items():
        passed = first_pass(log, event)
        assert passed is not None and passed < maps[0], f"stream {stream}'s fence passed after an arena map"
    assert all(log.index(call) < maps[0] for call in log if call.kind == "fence_record")
    assert not kv_calls(alloc, log)  # the KV slices keep their pages


def test_a_lend_never_blocks_a_busy_stream_and_is_finished_by_a_later_call(alloc):
    g = alloc.geometry
    kv = alloc.kv_tensor(0, "k", torch.float32)
    slots = g.chunk_slots(5)
    alloc.set_fence_streams(STREAMS)
    alloc.hold_fences()  # decode's streams are still busy with queued kernels
    alloc.record_calls()
    assert alloc.lend(5, wait=False) is False
    assert state(alloc, 5) == ChunkState.LENDING and alloc.lending_chunks() == [5]
    assert alloc.chunk_info(5).fence_pending
    stats = alloc.stats()
    assert stats.chunks_lending == 1 and stats.chunks_lent == 0 and stats.fences_pending == len(STREAMS)
    # Not in the arena yet: the trainer cannot be handed the chunk before its fences pass.
    assert alloc.arena_allocate(1) is None
    # A kernel queued before the lend still writes the chunk's KV slots.
    kv.view(-1, g.bytes_per_token // 4)[slots.start] = 42.0
    assert alloc.finish_lends() == []  # queried, still busy: nothing moves, nothing waits
    alloc.check_integrity()
    log = alloc.call_log()
    assert not arena_maps(alloc, log) and not any(call.kind == "fence_wait" for call in log)
    assert any(call.kind == "fence_query" and not call.passed for call in log)

    alloc.hold_fences(False)  # decode got past the events
    assert alloc.finish_lends() == [5]
    assert state(alloc, 5) == ChunkState.LENT and alloc.stats().fences_pending == 0
    log = alloc.call_log()
    maps = arena_maps(alloc, log)
    assert maps and not kv_calls(alloc, log)
    for event in recorded_fences(log).values():
        assert first_pass(log, event, ("fence_query",)) < maps[0]
    block = alloc.arena_allocate(g.chunk_bytes)
    assert block is not None
    # The arena shows the chunk's KV pages, with what the kernel wrote before the lend.
    arena = block.tensor(torch.float32).view(g.pages_per_chunk, g.tokens_per_chunk, -1)
    assert arena[g.kv_range_index(0, "k"), 0, 0].item() == 42.0
    del arena
    block.free()
    assert alloc.finish_lends() == []  # nothing pending: no call at all
    alloc.reclaim(5)


def test_a_blocking_lend_waits_for_the_fences_before_it_maps_into_the_arena(alloc):
    alloc.set_fence_streams(STREAMS)
    alloc.hold_fences()
    alloc.record_calls()
    errors = []

    def lend():
        try:
            alloc.lend(2)  # waits (the GIL is released around the call)
        except Exception as exc:  # noqa: BLE001 - reported below
            errors.append(exc)

    lender = threading.Thread(target=lend)
    lender.start()
    try:
        # A call is logged when it returns: the records show up, the blocked wait does not.
        deadline = time.monotonic() + 5
        while len(recorded_fences(alloc.call_log())) < len(STREAMS) and time.monotonic() < deadline:
            time.sleep(0.01)
        time.sleep(0.1)
        assert lender.is_alive()  # blocked on the first event
        assert not any(call.kind == "fence_wait" for call in alloc.call_log())
        assert state(alloc, 2) == ChunkState.LENDING
        assert not arena_maps(alloc, alloc.call_log())
    finally:
        alloc.hold_fences(False)
        lender.join(timeout=10)
    assert not lender.is_alive() and not errors
    assert state(alloc, 2) == ChunkState.LENT
    log = alloc.call_log()
    waits = {call.event: i for i, call in enumerate(log) if call.kind == "fence_wait"}
    assert set(waits) == set(recorded_fences(log).values())
    assert max(waits.values()) < arena_maps(alloc, log)[0]
    alloc.reclaim(2)


def test_a_reclaim_waits_for_the_trainers_frees_before_it_unmaps_the_arena_and_never_for_decode(alloc):
    alloc.set_fence_streams([7])
    alloc.lend(1)
    block = alloc.arena_allocate(alloc.geometry.page_bytes)
    block.free(streams=[9])  # the trainer's stream used it: a fence at the free
    alloc.record_calls()
    alloc.reclaim(1)
    log = alloc.call_log()
    assert 7 not in recorded_fences(log)  # decode's stream: nothing recorded, nothing waited for
    waits = [i for i, call in enumerate(log) if call.kind == "fence_wait"]
    unmaps = [i for i, call in enumerate(log) if call.kind == "unmap"]
    assert len(waits) == 1 and unmaps and waits[0] < unmaps[0]  # the free's fence, then the arena run
    assert not kv_calls(alloc, log)


def test_cancelling_a_pending_lend_gives_the_chunks_back_untouched(alloc):
    g = alloc.geometry
    kv = alloc.kv_tensor(1, "v", torch.float32)
    kv.copy_(torch.arange(kv.numel(), dtype=torch.float32))
    alloc.set_fence_streams(STREAMS)
    alloc.hold_fences()
    before = alloc.counters()
    assert alloc.lend([5, 6], wait=False) is False
    alloc.cancel_lends(5)
    assert state(alloc, 5) == ChunkState.MAPPED and state(alloc, 6) == ChunkState.LENDING
    alloc.check_integrity()
    moved = alloc.counters().minus(before)
    assert moved.map == moved.unmap == moved.set_access == 0  # the pages never moved
    assert torch.equal(kv, torch.arange(kv.numel(), dtype=torch.float32))
    alloc.hold_fences(False)
    assert alloc.finish_lends() == [6]
    with pytest.raises(VmmInvalidArgument, match="pass at least one chunk"):
        alloc.cancel_lends([])
    alloc.reclaim(6)
    assert g.num_chunks == alloc.stats().chunks_mapped


def test_pending_lends_refuse_the_moves_that_do_not_fit_them(alloc):
    alloc.set_fence_streams([3])
    alloc.hold_fences()
    assert alloc.lend(4, wait=False) is False
    before = snapshot(alloc)
    with pytest.raises(VmmInvalidArgument, match="chunk 4 is already being lent"):
        alloc.lend([3, 4])
    with pytest.raises(VmmInvalidArgument, match="chunk 4 is not lent yet .* cancel_lends"):
        alloc.reclaim(4)
    with pytest.raises(VmmInvalidArgument, match="chunk 3 is mapped, not being lent"):
        alloc.cancel_lends([3, 4])
    with pytest.raises(VmmInvalidArgument, match="chunk 4, which is being lent"):
        alloc.mark_slots_live([4 * alloc.geometry.tokens_per_chunk])
    assert not alloc.can_lend(4) and not alloc.can_reclaim(4)
    # Nothing changed, and no call was made (the refusals are bookkeeping only).
    assert snapshot(alloc) == before
    alloc.hold_fences(False)
    assert alloc.finish_lends() == [4]
    alloc.reclaim(4)


def test_pending_lends_finish_together_in_one_batch(alloc):
    g = alloc.geometry
    alloc.set_fence_streams([3])
    alloc.hold_fences()
    assert alloc.lend(5, wait=False) is False
    assert alloc.lend(6, wait=False) is False
    alloc.hold_fences(False)
    before = alloc.counters()
    assert alloc.finish_lends() == [5, 6]
    moved = alloc.counters().minus(before)
    # 5 and 6 are neighbours: one arena run, one access call over it.
    assert moved.map == 2 * g.pages_per_chunk and moved.set_access == 1 and moved.unmap == 0
    block = alloc.arena_allocate(2 * g.chunk_bytes)
    assert block is not None
    block.free()
    alloc.reclaim([5, 6])


def test_a_failed_finish_leaves_the_lends_pending_and_a_later_one_completes_them(alloc):
    alloc.set_fence_streams([3])
    alloc.hold_fences()
    assert alloc.lend([2, 3], wait=False) is False
    alloc.hold_fences(False)
    before = alloc.chunk_table()
    alloc.inject_failure("map", 3)
    with pytest.raises(VmmOsError, match=r"injected failure .* \(rolled back: chunks 2-3 unchanged\)"):
        alloc.finish_lends()
    assert alloc.chunk_table() == before and alloc.lending_chunks() == [2, 3]
    alloc.check_integrity()
    assert alloc.finish_lends() == [2, 3]
    alloc.reclaim([2, 3])


@pytest.mark.parametrize("call", ["fence_record", "fence_wait", "event_create"])
def test_a_failed_fence_call_rolls_the_lend_back(alloc, call):
    alloc.set_fence_streams([3, 4])
    before = snapshot(alloc)
    alloc.inject_failure(call, 1 if call == "fence_record" else 0)
    with pytest.raises(VmmOsError, match=r"host fence failed: injected failure .* \(rolled back: chunks 6 unchanged\)"):
        alloc.lend(6)
    after = snapshot(alloc)
    assert (after[0], after[2]) == (before[0], before[2])  # stats and chunk states
    assert after[1].unmap == before[1].unmap and after[1].map == before[1].map
    alloc.check_integrity()
    alloc.lend(6)
    alloc.reclaim(6)


def test_holding_fences_holds_a_reclaim_until_the_trainers_frees_pass_and_not_for_decode(alloc):
    alloc.set_fence_streams([3])
    alloc.lend([6, 7])
    alloc.hold_fences()  # every stream busy, decode's and the trainer's
    alloc.reclaim(6)  # no arena free fenced: decode's busy stream does not hold it
    assert state(alloc, 6) == ChunkState.MAPPED
    block = alloc.arena_allocate(alloc.geometry.page_bytes)
    block.free(streams=[9])
    done = threading.Event()
    reclaimer = threading.Thread(target=lambda: (alloc.reclaim(7), done.set()))
    reclaimer.start()
    try:
        deadline = time.monotonic() + 30
        while alloc.chunk_table()[7].state != ChunkState.BUSY:  # the reclaimer got as far as the fence
            assert time.monotonic() < deadline and not done.is_set(), alloc.chunk_table()[7].state
            time.sleep(0.01)
        assert not done.wait(0.2)  # the trainer's queued work has not passed its free's event
        assert alloc.chunk_table()[7].state == ChunkState.BUSY
    finally:
        alloc.hold_fences(False)
        reclaimer.join(timeout=10)
    assert done.is_set() and state(alloc, 7) == ChunkState.MAPPED


def test_a_finish_whose_rollback_fails_too_leaves_the_chunk_broken_and_no_longer_pending(alloc):
    alloc.set_fence_streams([3])
    alloc.hold_fences()
    assert alloc.lend(6, wait=False) is False
    alloc.hold_fences(False)
    # The third map into the arena fails; undoing then unmaps the two pages mapped so far.
    alloc.inject_failure("map", 2)
    alloc.inject_failure("unmap", 0)
    with pytest.raises(VmmOsError, match="undoing the move also failed .* chunks 6 are now broken"):
        alloc.finish_lends()
    assert state(alloc, 6) == ChunkState.BROKEN and alloc.lending_chunks() == []
    assert alloc.stats().chunks_lending == 0
    alloc.check_integrity()  # no pending lend names the broken chunk
    assert alloc.finish_lends() == []
