"""KV lending on SGLang's real token allocator (CPU, host-backed unified allocator): the
allocator hooks that take lent chunks back before SGLang would fail an allocation or
retract a decode request, the lent-memory budget between lending and a trainer, and the
idle integrity check that catches SGLang's free lists and the chunk states disagreeing."""

from __future__ import annotations

import dataclasses
import threading
import time
import types

import pytest
import torch

from harvest.config import MemoryConfig
from harvest.memory import UnifiedAllocator, VmmIntegrityError
from harvest.memory.lending import LendingPolicy
from harvest.memory.lent_budget import LentMemoryBudget
from harvest.sglang import hooks
from harvest.sglang.kv_lending import LENDING_ATTR, KvIntegrityError, KvLendingController, lending_of

pytest.importorskip("sglang")
from sglang.srt.mem_cache.allocator.base import BaseTokenToKVPoolAllocator  # noqa: E402
from sglang.srt.mem_cache.allocator.token import TokenToKVPoolAllocator  # noqa: E402

TOKENS_PER_CHUNK = 128
NUM_CHUNKS = 8


def _settling(lending) -> None:
    """With the lending thread, each non-urgent call below returns before the thread has
    moved anything; these tests look at the state the moves leave, so the calls wait for
    the thread's jobs and apply their results (``settle``) before returning."""
    for name in ("maybe_lend", "after_step", "return_all", "lend"):
        call = getattr(lending, name)

        def settled(*args, _call=call, **kwargs):
            result = _call(*args, **kwargs)
            lending.settle()
            return result

        setattr(lending, name, settled)


@pytest.fixture(params=["scheduler thread", "lending thread"])
def kv(request):
    """SGLang's token allocator on a host-backed unified allocator, lent from by a
    controller whose allocator work runs on the scheduler thread or its lending thread."""
    threaded = request.param == "lending thread"
    alloc = UnifiedAllocator(num_layers=2, kv_heads=2, head_dim=16, dtype_bytes=4, max_tokens=NUM_CHUNKS * TOKENS_PER_CHUNK,
                             small_pool_bytes=4 * 16384, page_bytes=16384)
    assert alloc.geometry.tokens_per_chunk == TOKENS_PER_CHUNK
    # SGLang's slot 0 is the padding slot (never free), so chunk 0 is never lendable.
    tokens = TokenToKVPoolAllocator(NUM_CHUNKS * TOKENS_PER_CHUNK - 1, torch.float32, "cpu", None, need_sort=True)
    policy = LendingPolicy(tokens_per_chunk=TOKENS_PER_CHUNK, num_chunks=NUM_CHUNKS, reserve_tokens=TOKENS_PER_CHUNK,
                           hysteresis_chunks=0, max_lend_fraction=1.0)
    lending = KvLendingController(tokens, alloc, policy, LentMemoryBudget(),
                                  MemoryConfig(urgent_reclaim_wait_s=5.0, lending_thread=threaded))
    assert lending_of(tokens) is lending  # the controller lives on the allocator it lends from
    if threaded:
        _settling(lending)
    yield tokens, lending
    lending.reclaim_all()
    lending.check_integrity()
    assert lending.lending_thread is threaded or lending.num_lent_total == 0  # the thread did the work
    lending.close()
    assert not lending.lending_thread
    alloc.close()


def _check(tokens, num_tokens):
    return hooks._check_decode_capacity(BaseTokenToKVPoolAllocator.check_decode_capacity, tokens,
                                        num_tokens=num_tokens, tree_cache=None)


def test_lending_takes_whole_free_chunks_above_the_reserve_out_of_the_free_list(kv):
    tokens, lending = kv
    held = tokens.alloc(200)  # low slots first: chunks 0 and 1 in use
    lending.maybe_lend(force=True)
    assert lending.num_lent > 0
    assert tokens.available_size() >= TOKENS_PER_CHUNK  # the reserve stays free
    free = torch.cat((tokens.free_pages, tokens.release_pages))
    lent_chunks = set(lending.lent_chunks())
    assert len(lent_chunks) == lending.num_lent
    assert 0 not in lent_chunks and 1 not in lent_chunks  # chunks with used slots are never lent
    assert not any(int(slot) // TOKENS_PER_CHUNK in lent_chunks for slot in free)  # SGLang cannot hand them out
    tokens.free(held)


def test_decode_capacity_check_takes_lent_chunks_back_instead_of_retracting(kv):
    tokens, lending = kv
    lending.maybe_lend(force=True)
    lent = lending.num_lent
    available = tokens.available_size()
    assert lent > 0 and available < 3 * TOKENS_PER_CHUNK
    # Enough free slots: SGLang's own answer, nothing reclaimed.
    assert _check(tokens, available) is True and lending.num_lent == lent
    # Short: without harvest SGLang would retract; with it the lent chunks come back.
    need = available + TOKENS_PER_CHUNK + 1
    assert BaseTokenToKVPoolAllocator.check_decode_capacity(tokens, num_tokens=need, tree_cache=None) is False
    assert _check(tokens, need) is True
    assert lending.num_lent == lent - 2 and tokens.available_size() >= need
    # More than the whole pool: still False (SGLang retracts), everything lent came back.
    assert _check(tokens, NUM_CHUNKS * TOKENS_PER_CHUNK) is False and lending.num_lent == 0


def test_an_allocation_that_would_fail_reclaims_first(kv):
    tokens, lending = kv
    lending.maybe_lend(force=True)
    lent = lending.num_lent
    fits = hooks._token_alloc(TokenToKVPoolAllocator.alloc, tokens, 3)
    assert fits is not None and len(fits) == 3 and lending.num_lent == lent  # it fits: nothing comes back
    tokens.free(fits)
    assert lending.ensure_available(3) is False and lending.num_lent == lent  # enough free: nothing comes back
    need = tokens.available_size() + 1
    assert TokenToKVPoolAllocator.alloc(tokens, need) is None  # SGLang alone would fail
    out = hooks._token_alloc(TokenToKVPoolAllocator.alloc, tokens, need)
    assert out is not None and len(out) == need and lending.num_lent < lent


def test_without_a_lending_controller_the_hooks_call_through(kv, monkeypatch):
    tokens, lending = kv
    lending.maybe_lend(force=True)
    monkeypatch.delattr(tokens, LENDING_ATTR)
    assert _check(tokens, tokens.available_size() + 1) is False
    assert hooks._token_alloc(TokenToKVPoolAllocator.alloc, tokens, tokens.available_size() + 1) is None


def test_after_a_step_free_slots_under_the_reserve_bring_lent_chunks_back(kv):
    tokens, lending = kv
    lending.maybe_lend(force=True)
    lent = lending.num_lent
    lending.after_step()  # free slots at or above the reserve: nothing to do
    assert lending.num_lent == lent
    held = tokens.alloc(tokens.available_size() - TOKENS_PER_CHUNK // 2)  # decode grew into the reserve
    lending.after_step()
    assert lending.num_lent == lent - 1 and tokens.available_size() >= TOKENS_PER_CHUNK
    tokens.free(held)


class HoldingTrainer:
    """Stands in for the trainer's window: holds every lent page of the general arena and
    follows the lending budget. When ``responsive``, a wake-up makes its own thread let go
    of everything and acknowledge, as the trainer does at its next unit boundary."""

    def __init__(self, lending, responsive: bool):
        self.budget = lending.budget
        self.blocks = []
        page = lending.allocator.geometry.page_bytes
        while (block := lending.allocator.arena_allocate(page)) is not None:
            self.blocks.append(block)
        self.num_wakes = 0
        self._woken = threading.Event()
        self._done = False
        self.unfollow = self.budget.follow(self._wake)
        self._thread = threading.Thread(target=self._follow, daemon=True) if responsive else None
        if self._thread is not None:
            self._thread.start()

    def _wake(self) -> None:
        self.num_wakes += 1
        self._woken.set()

    def _follow(self) -> None:
        while self._woken.wait() and not self._done:
            self._woken.clear()
            self.let_go()

    def let_go(self) -> None:
        snapshot = self.budget.snapshot
        if snapshot.wanted_back_bytes:
            for block in self.blocks:
                block.free()
            self.blocks = []
        self.budget.acknowledge(snapshot.generation)

    def close(self) -> None:
        self._done = True
        self._woken.set()
        if self._thread is not None:
            self._thread.join(5)
        for block in self.blocks:
            block.free()
        self.unfollow()


@pytest.fixture
def holding_trainer():
    made = []

    def make(lending, responsive: bool) -> HoldingTrainer:
        made.append(HoldingTrainer(lending, responsive))
        assert made[-1].blocks, "the trainer holds lent pages"
        return made[-1]

    yield make
    for trainer in made:
        trainer.close()


@pytest.fixture
def lent_kv(kv):
    """``kv`` with every chunk above the reserve lent: (tokens, lending, chunks lent)."""
    tokens, lending = kv
    lending.maybe_lend(force=True)
    return tokens, lending, lending.num_lent


@pytest.mark.timeout(60)
def test_the_non_urgent_path_asks_the_trainer_and_never_waits(lent_kv, holding_trainer):
    tokens, lending, lent = lent_kv
    chunk_bytes = lending.chunk_bytes
    trainer = holding_trainer(lending, responsive=False)
    held = tokens.alloc(tokens.available_size() - TOKENS_PER_CHUNK // 2)  # decode grew into the reserve
    waits = []
    wait_acknowledged = lending.budget.wait_acknowledged
    lending.budget.wait_acknowledged = lambda *args: waits.append(args) or wait_acknowledged(*args)
    lending.after_step()
    assert waits == []  # the trainer never answered, and was not waited for
    assert lending.num_lent == lent  # every lent page is the trainer's: nothing to take yet
    snapshot = lending.budget.snapshot
    assert (snapshot.lent_bytes, snapshot.wanted_back_bytes) == (lent * chunk_bytes, chunk_bytes)
    assert trainer.num_wakes == 1
    lending.after_step()  # the same request again: no new wake-up
    assert trainer.num_wakes == 1 and lending.num_lent == lent
    trainer.let_go()  # the trainer's next unit boundary
    lending.after_step()
    assert lending.num_lent == lent - 1 and tokens.available_size() >= TOKENS_PER_CHUNK
    snapshot = lending.budget.snapshot
    assert (snapshot.lent_bytes, snapshot.wanted_back_bytes) == ((lent - 1) * chunk_bytes, 0)  # request withdrawn
    lending.check_integrity()
    tokens.free(held)


@pytest.mark.timeout(60)
def test_the_urgent_path_waits_for_the_trainer_and_gets_its_chunks(lent_kv, holding_trainer):
    tokens, lending, lent = lent_kv
    trainer = holding_trainer(lending, responsive=True)
    need = tokens.available_size() + 1
    assert TokenToKVPoolAllocator.alloc(tokens, need) is None  # SGLang alone would fail
    out = hooks._token_alloc(TokenToKVPoolAllocator.alloc, tokens, need)
    assert out is not None and len(out) == need
    assert trainer.num_wakes >= 1 and lending.num_lent == lent - 1
    assert lending.budget.snapshot.wanted_back_bytes == 0
    lending.check_integrity()
    tokens.free(out)


@pytest.mark.timeout(60)
def test_an_urgent_wait_for_a_trainer_that_never_answers_is_bounded(lent_kv, holding_trainer):
    tokens, lending, lent = lent_kv
    holding_trainer(lending, responsive=False)
    lending.urgent_wait_s = 0.2
    waits = []
    wait_acknowledged = lending.budget.wait_acknowledged
    lending.budget.wait_acknowledged = lambda generation, timeout: waits.append(timeout) or wait_acknowledged(
        generation, timeout)
    started = time.monotonic()
    assert lending.ensure_available(tokens.available_size() + 1) is False
    assert time.monotonic() - started >= 0.2  # it did wait for the trainer ...
    assert waits and sum(waits) <= 0.2 + 1e-9  # ... for urgent_wait_s in all, not longer
    assert lending.num_lent == lent


def test_sglangs_leak_check_counts_lent_slots_as_accounted_for(kv):
    from sglang.srt.managers.scheduler_components.pool_stats_observer import PoolStats

    tokens, lending = kv
    lending.maybe_lend(force=True)
    assert lending.num_lent
    checker = types.SimpleNamespace(token_to_kv_pool_allocator=tokens)
    stats = PoolStats(full_num_used=0, full_token_usage=0.0, full_available_size=tokens.available_size(),
                      full_evictable_size=0)
    seen = hooks._full_pool_invariant(lambda checker, ps, uncached=0: ps, checker, stats, uncached=0)
    assert seen.full_available_size == tokens.available_size() + lending.num_lent * TOKENS_PER_CHUNK
    assert dataclasses.replace(seen, full_available_size=stats.full_available_size) == stats  # nothing else changed


def test_integrity_check_passes_on_a_consistent_state_and_is_rate_limited(kv):
    tokens, lending = kv
    held = tokens.alloc(200)
    lending.maybe_lend(force=True)
    assert lending.num_lent
    assert lending.maybe_check_integrity() is True
    assert lending.maybe_check_integrity() is False  # again within integrity_interval_s
    tokens.free(held)
    lending.check_integrity()
    assert lending.stats()["integrity_checks_total"] == 2


def test_integrity_check_catches_a_lent_slot_back_in_sglangs_free_list(kv):
    tokens, lending = kv
    lending.maybe_lend(force=True)
    chunk = lending.lent_chunks()[0]
    tokens.release_pages = torch.cat((tokens.release_pages, torch.tensor([chunk * TOKENS_PER_CHUNK + 5])))
    with pytest.raises(KvIntegrityError, match=f"1 slot\\(s\\) of chunk {chunk}, which is lent"):
        lending.check_integrity()
    tokens.release_pages = tokens.release_pages[:-1]
    lending.check_integrity()


def test_integrity_check_catches_a_chunk_state_flipped_in_the_allocator(kv):
    tokens, lending = kv
    lending.maybe_lend(force=True)
    lent = lending.lent_chunks()
    lending.allocator.reclaim([lent[0]])  # behind the controller's back: mapped, its slots in no free list
    with pytest.raises(KvIntegrityError, match="lent chunks: the allocator has"):
        lending.check_integrity()
    lending.allocator.lend([lent[0]])
    lending.check_integrity()
    free_mapped = next(c for c in range(1, NUM_CHUNKS) if c not in lent)  # all its slots are SGLang's free ones
    lending.allocator.lend([free_mapped])  # lent behind SGLang's back: SGLang could hand its slots out
    with pytest.raises(KvIntegrityError, match="lent chunks: the allocator has"):
        lending.check_integrity()
    lending.allocator.reclaim([free_mapped])
    lending.check_integrity()


def test_integrity_check_catches_a_slot_free_twice_and_slots_marked_live(kv):
    tokens, lending = kv
    lending.maybe_lend(force=True)
    tokens.release_pages = torch.cat((tokens.release_pages, tokens.free_pages[:1]))
    with pytest.raises(KvIntegrityError, match=f"slot {int(tokens.free_pages[0])} more than once"):
        lending.check_integrity()
    tokens.release_pages = tokens.release_pages[:-1]
    lending.allocator.mark_slots_live([3])  # the live-slot rule is not used for SGLang's slots
    with pytest.raises(KvIntegrityError, match="count live slots"):
        lending.check_integrity()
    lending.allocator.mark_slots_free([3])
    lending.check_integrity()


def test_integrity_check_runs_the_allocators_own_check(kv, monkeypatch):
    tokens, lending = kv

    def broken():
        raise VmmIntegrityError("page 7 mapped twice", 6)

    monkeypatch.setattr(lending.allocator, "check_integrity", broken)
    with pytest.raises(VmmIntegrityError, match="page 7 mapped twice"):
        lending.check_integrity()


def test_the_idle_tick_catches_a_corrupted_state_and_stops_lending_and_the_trainer(kv):
    """Through the runtime's idle path: the check runs there (rate-limited), and a
    disagreement stops lending and the trainer at once instead of surfacing later."""
    import types

    from harvest.colocate.colocation import Colocation

    tokens, lending = kv
    stops = []
    host = types.SimpleNamespace(operator_stop=lambda: stops.append(True), on_unit=None, on_fault=None)
    from harvest.colocate.step_timer import CpuStepTimer

    control = types.SimpleNamespace(on_idle=lambda: None, record_steps=lambda: None, forget_unmeasured=lambda: None)
    colocation = Colocation(config=None, partitioner=None, step_controller=control, trainer_host=host, lending=lending,
                            timer=CpuStepTimer(), metrics=None, refiner=None)
    lending.integrity_interval_s = 0.0  # every idle tick
    colocation.on_idle()
    assert lending.num_lent and colocation.integrity_error is None and not stops
    chunk = lending.lent_chunks()[0]
    tokens.release_pages = torch.cat((tokens.release_pages, torch.tensor([chunk * TOKENS_PER_CHUNK + 5])))
    colocation.on_idle()
    assert colocation.integrity_error.startswith("KvIntegrityError") and f"chunk {chunk}" in colocation.integrity_error
    assert stops == [True] and lending.enabled is False
    lent = lending.num_lent
    lending.maybe_lend(force=True)
    assert lending.num_lent == lent  # nothing more is lent
    colocation.on_idle()
    assert stops == [True]  # reported once
    tokens.release_pages = tokens.release_pages[:-1]  # the fixture's teardown reclaims


@pytest.fixture
def busy_decode(kv):
    """``kv`` with decode's stream registered for the allocator's fences and still busy
    (the host backend holds the fences until the test lets decode get past them)."""
    tokens, lending = kv
    lending.allocator.set_fence_streams([1])
    lending.allocator.hold_fences()
    yield tokens, lending
    lending.allocator.hold_fences(False)  # before the teardown's reclaim waits on fences


def _free_slots_of(tokens, chunks) -> int:
    free = torch.cat((tokens.free_pages, tokens.release_pages))
    return int(torch.isin(torch.div(free, TOKENS_PER_CHUNK, rounding_mode="floor"), torch.tensor(sorted(chunks))).sum())


def test_a_lend_waiting_for_decode_is_finished_by_a_later_maybe_lend_without_blocking(busy_decode):
    tokens, lending = busy_decode
    lending.maybe_lend(force=True)  # returns although decode's fences are held: not waited for
    pending = lending.num_lending
    assert pending > 0 and lending.num_lent == 0
    chunks = sorted(lending.allocator.lending_chunks())
    assert _free_slots_of(tokens, chunks) == 0  # out of SGLang's free lists: never handed out again
    assert lending.budget.snapshot.lent_bytes == 0  # the trainer gets nothing before the unmap
    assert lending.allocator.arena_allocate(1) is None
    lending.check_integrity()
    lending.maybe_lend()  # decode still busy: the lend stays pending, nothing lost
    assert lending.num_lending == pending and lending.num_lent == 0
    lending.allocator.hold_fences(False)  # decode got past the lend's events
    lending.maybe_lend()  # the next step or idle tick (inside the lend interval: finishing only)
    deadline = time.monotonic() + 10
    while lending.lending_thread and lending.num_lending and time.monotonic() < deadline:
        time.sleep(0.005)  # the lending thread finishes it at its next query (every few ms) ...
        lending.maybe_lend()  # ... and a later step or tick applies that
    assert lending.num_lending == 0 and lending.num_lent == pending
    assert sorted(lending.lent_chunks()) == chunks
    assert lending.budget.snapshot.lent_bytes == pending * lending.chunk_bytes
    assert lending.stats()["chunks_lending"] == 0 and lending.stats()["lends_total"] == pending
    lending.check_integrity()


def test_decode_short_of_slots_cancels_pending_lends_first(busy_decode):
    tokens, lending = busy_decode
    lending.maybe_lend(force=True)
    pending = lending.num_lending
    assert pending >= 2
    available = tokens.available_size()
    assert lending.ensure_available(available + 1) is True  # an allocation that would fail
    assert lending.num_lending == pending - 1 and lending.num_reclaimed_total == 0  # cancelled, not reclaimed
    assert tokens.available_size() == available + TOKENS_PER_CHUNK  # its slots are SGLang's again
    assert lending.stats()["lends_cancelled_total"] == 1
    lending.check_integrity()
    lending.reclaim_all()  # a trainer fault: every pending lend goes back too
    assert lending.num_lending == 0 and lending.num_lent == 0
    assert tokens.available_size() == available + pending * TOKENS_PER_CHUNK
    lending.check_integrity()


def test_integrity_check_catches_a_pending_lend_cancelled_behind_the_controllers_back(busy_decode):
    tokens, lending = busy_decode
    lending.maybe_lend(force=True)
    chunk = max(lending.allocator.lending_chunks())
    lending.allocator.cancel_lends([chunk])  # mapped again, but its slots are in no free list
    with pytest.raises(KvIntegrityError, match="chunks being lent: the allocator has"):
        lending.check_integrity()
    lending.allocator.lend([chunk], wait=False)
    lending.check_integrity()


def test_sglangs_leak_check_counts_the_slots_of_pending_lends_as_accounted_for(busy_decode):
    from sglang.srt.managers.scheduler_components.pool_stats_observer import PoolStats

    tokens, lending = busy_decode
    lending.maybe_lend(force=True)
    assert lending.num_lending and not lending.num_lent
    checker = types.SimpleNamespace(token_to_kv_pool_allocator=tokens)
    stats = PoolStats(full_num_used=0, full_token_usage=0.0, full_available_size=tokens.available_size(),
                      full_evictable_size=0)
    seen = hooks._full_pool_invariant(lambda checker, ps, uncached=0: ps, checker, stats, uncached=0)
    assert seen.full_available_size == tokens.available_size() + lending.num_lending * TOKENS_PER_CHUNK


def test_sglang_clearing_its_pool_keeps_the_lent_chunks_out_of_the_free_list(kv):
    """``/flush_cache`` (Scheduler.flush_cache -> TokenToKVPoolAllocator.clear) while chunks
    are lent: without the hook every lent slot would be free again (SGLang would hand out
    the trainer's pages, and its leak check would kill the server)."""
    tokens, lending = kv
    held = tokens.alloc(200)
    lending.maybe_lend(force=True)
    lent = lending.num_lent
    assert lent > 0
    size = tokens.size
    hooks._token_clear(TokenToKVPoolAllocator.clear, tokens)
    # Everything SGLang held is free again (held's slots too), except what is lent.
    assert tokens.available_size() == size - lent * TOKENS_PER_CHUNK
    assert lending.num_lent == lent
    free_chunks = {int(slot) // TOKENS_PER_CHUNK for slot in torch.cat((tokens.free_pages, tokens.release_pages))}
    assert not free_chunks & set(lending.lent_chunks())
    lending.check_integrity()  # SGLang's free lists, the allocator and the cache agree
    # SGLang's own leak check holds: free + lent slots == the pool.
    assert tokens.available_size() + lending.num_lent * TOKENS_PER_CHUNK == size
    # And without a lending controller, clear() is SGLang's.
    del held
    setattr(tokens, LENDING_ATTR, None)
    hooks._token_clear(TokenToKVPoolAllocator.clear, tokens)
    assert tokens.available_size() == size
    setattr(tokens, LENDING_ATTR, lending)
    lending.after_pool_cleared()  # the fixture's teardown reclaims into a consistent pool


def test_returning_lends_nothing_and_takes_every_chunk_back_until_resumed(kv):
    """An operator's pause or stop (Colocation.operator -> return_all on the engine thread)."""
    tokens, lending = kv
    lending.maybe_lend(force=True)
    assert lending.num_lent > 0
    lending.return_all()  # no trainer holds them: they come back at once, nothing waits
    assert lending.num_taken == 0 and lending.returning
    lending.maybe_lend(force=True)
    lending.after_step()
    assert lending.num_lent == 0  # nothing lent while returning
    lending.resume_lending()
    lending.maybe_lend(force=True)
    assert lending.num_lent > 0
    lending.check_integrity()


def test_returning_takes_back_what_a_trainer_lets_go_of_later(kv):
    tokens, lending = kv
    lending.maybe_lend(force=True)
    lent = lending.num_lent
    held = lending.allocator.allocate(lending.chunk_bytes)  # a trainer buffer in lent memory
    lending.return_all()
    assert 0 < lending.num_lent < lent  # the chunk under the buffer stays lent, the rest is back
    assert lending.budget.snapshot.wanted_back_bytes > 0  # and the trainer is asked for it
    held.free()
    lending.maybe_lend(force=True)  # the next tick takes it
    assert lending.num_lent == 0


def test_an_urgent_reclaim_is_counted_and_timed(kv):
    tokens, lending = kv
    lending.maybe_lend(force=True)
    assert lending.num_lent > 0 and lending.stats()["urgent_reclaims_total"] == 0
    fits = hooks._token_alloc(TokenToKVPoolAllocator.alloc, tokens, 3)
    assert lending.stats()["urgent_reclaims_total"] == 0  # it fitted: decode did not wait
    tokens.free(fits)
    out = hooks._token_alloc(TokenToKVPoolAllocator.alloc, tokens, tokens.available_size() + 1)
    stats = lending.stats()
    assert out is not None and stats["urgent_reclaims_total"] == 1 and stats["urgent_reclaim_s_total"] > 0


def test_the_auto_reserve_follows_the_allocations_seen_and_lends_less_after_a_burst(kv):
    from harvest.memory.demand import AllocationDemand, DemandReserve

    tokens, lending = kv
    lending.reclaim_ahead = False  # without reclaim ahead the reserve follows allocations (with it: arrivals)
    lending.reserve = DemandReserve(floor_tokens=TOKENS_PER_CHUNK, cap_tokens=NUM_CHUNKS * TOKENS_PER_CHUNK,
                                    # a horizon of 10 s: the burst below lies within it however slow the machine
                                    tokens_per_chunk=TOKENS_PER_CHUNK, ack_s=10.0, reclaim_s_per_chunk=0.005,
                                    demand=AllocationDemand(window_s=60.0))
    lending.maybe_lend(force=True)  # no demand seen: Harli's formula, and as much lent as before
    assert lending.policy.reserve_tokens == TOKENS_PER_CHUNK and "Harli" in lending.stats()["reserve_reason"]
    lent_before = lending.num_lent
    lending.reclaim(lending.num_lent, wait=False)
    # A burst: three prompts of 150 tokens within a few milliseconds (through SGLang's alloc hook).
    burst = [hooks._token_alloc(TokenToKVPoolAllocator.alloc, tokens, 150) for _ in range(3)]
    for slots in burst:
        tokens.free(slots)
    lending._reserve_updated = -float("inf")  # a second later
    lending.maybe_lend(force=True)
    assert lending.policy.reserve_tokens == 450
    assert "p99" in lending.stats()["reserve_reason"]
    assert tokens.available_size() >= 450 and lending.num_lent < lent_before
