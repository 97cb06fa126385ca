"""Reclaim ahead and admissions held by lent memory (harvest.sglang.kv_lending's
``before_admission``, harvest.sglang.admission, the ``get_new_batch_prefill`` hook), on
SGLang's real token allocator over a host-backed unified allocator, with the allocator's
work on the scheduler thread and on the lending thread (the ``kv`` fixture's two runs)."""

from __future__ import annotations

import itertools
import types

import pytest

from harvest.sglang import hooks
from harvest.sglang.admission import AdmissionDemand, demand_of, promised_tokens
from tests.colocate.test_kv_lending import TOKENS_PER_CHUNK, HoldingTrainer, kv  # noqa: F401 - the fixture

pytest.importorskip("sglang")


_rids = itertools.count()


def _req(prompt: int, max_new: int, out: int = 0, ignore_eos: bool = True):
    return types.SimpleNamespace(rid=f"r{next(_rids)}", origin_input_ids=[1] * prompt, output_ids=[2] * out,
                                 sampling_params=types.SimpleNamespace(max_new_tokens=max_new, ignore_eos=ignore_eos))


def _batch(*reqs, full: bool = False):
    return types.SimpleNamespace(reqs=list(reqs), batch_is_full=full)


def _scheduler(tokens=None, waiting=(), ratio=0.5, max_running=8, max_prefill=16384, evictable=0):
    return types.SimpleNamespace(token_to_kv_pool_allocator=tokens, waiting_queue=list(waiting), chunked_req=None,
                                 new_token_ratio_tracker=types.SimpleNamespace(current=ratio),
                                 max_running_requests=max_running, max_prefill_tokens=max_prefill,
                                 tree_cache=types.SimpleNamespace(evictable_size=lambda: evictable))


# -- what SGLang's admission sets aside (harvest.sglang.admission) -----------------------------

def test_the_running_requests_promise_is_sglangs_remaining_decode_at_its_ratio():
    running = _batch(_req(10, 100, out=40), _req(10, 50, out=10, ignore_eos=False), _req(10, 8, out=8))
    # 60 left at ratio 1 (ignore_eos), 40 left at SGLang's ratio 0.5, a finished one: nothing.
    assert promised_tokens(running, 0.5) == 60 + 20
    assert promised_tokens(_batch(), 0.5) == 0


def test_the_queue_head_is_priced_as_sglang_prices_an_admission():
    waiting = [_req(400, 8), _req(300, 16), _req(200, 4)]
    want = demand_of(_scheduler(waiting=waiting), _batch(_req(10, 8, out=2)))
    assert want.looked and want.promised_tokens == 6
    assert want.queued_tokens == (400 + 8 + 1) + (300 + 16 + 1) + (200 + 4 + 1)
    # At most as many as SGLang may still run, and within one round's prefill budget (the first always).
    assert demand_of(_scheduler(waiting=waiting, max_running=2), _batch(_req(10, 8))).queued_tokens == 409
    assert demand_of(_scheduler(waiting=waiting, max_prefill=650), _batch()).queued_tokens == 409
    assert demand_of(_scheduler(waiting=waiting, max_prefill=100), _batch()).queued_tokens == 409
    assert demand_of(_scheduler(waiting=waiting, evictable=77), _batch()).evictable_tokens == 77


def test_arrivals_are_the_requests_new_in_the_queue_priced_as_admission_prices_them():
    seen = set()
    first, second = _req(400, 8), _req(100, 16, out=4)
    scheduler = _scheduler(waiting=[first])
    assert demand_of(scheduler, _batch(), seen=seen).arrived_tokens == 409
    scheduler.waiting_queue.append(second)  # one more arrived; the first is still queued (held)
    assert demand_of(scheduler, _batch(), seen=seen).arrived_tokens == 100 + 4 + 12 + 1
    assert demand_of(scheduler, _batch(_req(10, 8), full=True), seen=seen).arrived_tokens == 0  # nothing new
    scheduler.waiting_queue.clear()  # admitted
    assert demand_of(scheduler, _batch(), seen=seen).arrived_tokens == 0 and not seen
    scheduler.waiting_queue.append(first)  # retracted and queued again: it needs its memory again
    assert demand_of(scheduler, _batch(), seen=seen).arrived_tokens == 409
    assert demand_of(scheduler, _batch()).arrived_tokens == 0  # not counted without ``seen``


def test_a_full_batch_with_a_queue_is_not_looked_at_and_an_empty_queue_is_nothing_held():
    full = demand_of(_scheduler(waiting=[_req(400, 8)]), _batch(_req(10, 8), full=True))
    assert not full.looked and full.queued_tokens == 0 and full.promised_tokens == 8
    empty = demand_of(_scheduler(), _batch(_req(10, 8)), promised=False)
    assert empty == AdmissionDemand(True, 0, 0)


# -- the controller ------------------------------------------------------------------------------

def _lent(lending) -> int:
    lending.maybe_lend(force=True)
    assert lending.num_lent >= 4
    return lending.num_lent


def test_an_admission_held_by_lent_memory_takes_chunks_back_at_once_counted_once_per_episode(kv):  # noqa: F811
    tokens, lending = kv
    lent = _lent(lending)
    free = tokens.available_size()
    queued = free + 2 * TOKENS_PER_CHUNK  # fits only with two lent chunks back
    assert lending.before_admission(AdmissionDemand(True, queued, 0)) is False
    assert lending.num_lent == lent - 2 and tokens.available_size() >= queued  # back before SGLang looks
    stats = lending.stats()
    assert stats["admissions_held_total"] == 1 and stats["urgent_reclaims_total"] == 1
    assert stats["urgent_reclaim_s_total"] > 0 and stats["free_target_tokens"] >= queued
    # SGLang admitted part of it and holds the rest: the same episode, not counted again.
    lending.before_admission(AdmissionDemand(True, tokens.available_size() + TOKENS_PER_CHUNK, 0))
    assert lending.stats()["admissions_held_total"] == 1 and lending.num_lent == lent - 3
    # The queue fits: the episode ends; the next shortfall is a new one.
    lending.before_admission(AdmissionDemand(True, 10, 0))
    assert lending.held_tokens == 0 and "the reserve" in lending.stats()["free_target_reason"]
    lending.before_admission(AdmissionDemand(True, tokens.available_size() + 1, 0))
    assert lending.stats()["admissions_held_total"] == 2
    lending.check_integrity()


def test_what_sglang_could_evict_or_what_is_free_is_no_admission_held(kv):  # noqa: F811
    tokens, lending = kv
    lent = _lent(lending)
    free = tokens.available_size()
    lending.before_admission(AdmissionDemand(True, free, 0))  # fits as is
    lending.before_admission(AdmissionDemand(True, free + 500, 0, evictable_tokens=600))  # SGLang evicts first
    lending.before_admission(AdmissionDemand(False, 0, 0))  # SGLang does not look this round
    assert lending.num_lent == lent and lending.stats()["admissions_held_total"] == 0


def test_a_held_admission_the_trainer_holds_memory_for_is_followed_up_and_sglang_asked_to_look_again(kv):  # noqa: F811
    tokens, lending = kv
    lent = _lent(lending)
    trainer = HoldingTrainer(lending, responsive=False)  # every lent page is the trainer's
    try:
        queued = tokens.available_size() + TOKENS_PER_CHUNK
        lending.before_admission(AdmissionDemand(True, queued, 0))
        assert lending.num_lent == lent  # nothing unused to take now, and the trainer is not waited for
        assert lending.budget.snapshot.wanted_back_bytes == lending.chunk_bytes
        assert lending.stats()["admissions_held_total"] == 1
        # SGLang's batch is full (it held the request): it does not look; nothing is back yet.
        assert lending.before_admission(AdmissionDemand(False, 0, 0)) is False
        trainer.let_go()  # the trainer's next unit boundary
        lending.after_step()  # the held admission's need is the target: the chunk comes back
        assert lending.num_lent == lent - 1 and tokens.available_size() >= queued
        assert lending.before_admission(AdmissionDemand(False, 0, 0)) is True  # look at the queue again
        lending.before_admission(AdmissionDemand(True, 0, 0))  # admitted: nothing queued
        assert lending.held_tokens == 0 and lending.stats()["admissions_held_total"] == 1
    finally:
        trainer.close()


def test_reclaim_ahead_keeps_sglangs_promise_to_its_running_requests_free(kv):  # noqa: F811
    tokens, lending = kv
    lent = _lent(lending)
    reserve = lending.policy.reserve_tokens
    promise = 3 * TOKENS_PER_CHUNK
    lending.before_admission(AdmissionDemand(True, 0, promise))  # nothing queued: nothing held
    assert lending.free_target() == reserve + promise and lending.stats()["admissions_held_total"] == 0
    lending.after_step()  # below the target: taken back before anyone asks
    assert tokens.available_size() >= reserve + promise and lending.num_lent < lent
    assert "running requests' decode" in lending.stats()["free_target_reason"]
    lent_now = lending.num_lent
    lending.maybe_lend(force=True)
    assert lending.num_lent == lent_now  # nothing lent below the target
    lending.before_admission(AdmissionDemand(True, 0, 0))  # the requests finished
    lending.maybe_lend(force=True)
    assert lending.num_lent == lent  # lent again
    lending.reclaim_ahead = False  # memory.reclaim_ahead: false: the reserve alone
    lending.before_admission(AdmissionDemand(True, 0, promise))
    assert lending.free_target() == reserve and lending.promised_tokens == 0
    lending.check_integrity()


def test_the_prefill_hook_hands_sglangs_admission_to_lending_and_calls_through(kv):  # noqa: F811
    tokens, lending = kv
    lent = _lent(lending)
    calls = []

    def original(scheduler, running_batch):
        calls.append(tokens.available_size())
        return "plan"

    waiting = [_req(tokens.available_size() + TOKENS_PER_CHUNK, 8)]
    scheduler = _scheduler(tokens, waiting=waiting)
    running = _batch()
    assert hooks._new_batch_prefill(original, scheduler, running) == "plan"
    assert lending.num_lent < lent and calls[-1] >= waiting[0].sampling_params.max_new_tokens + len(
        waiting[0].origin_input_ids)  # the memory was back before SGLang looked
    # A round SGLang skips (its batch full) once the memory it was held for is back: look again.
    lending.held_tokens = tokens.available_size()
    full = _batch(_req(10, 8), full=True)
    hooks._new_batch_prefill(original, scheduler, running_batch=full)
    assert full.batch_is_full is False
    # Without a controller, or on tensor-parallel ranks, straight through.
    lending.ranks = object()
    assert not lending.watches_admissions
    lending.ranks = None


def test_the_reserve_says_what_it_is_before_its_first_update(kv):  # noqa: F811
    from harvest.memory.demand import AllocationDemand, DemandReserve

    tokens, lending = kv
    assert lending.stats()["reserve_reason"] == f"memory.reserve_tokens: {TOKENS_PER_CHUNK} tokens, fixed"
    lending.reserve = DemandReserve(floor_tokens=TOKENS_PER_CHUNK, cap_tokens=1024, tokens_per_chunk=TOKENS_PER_CHUNK,
                                    ack_s=0.05, reclaim_s_per_chunk=0.005, demand=AllocationDemand())
    assert lending.stats()["reserve_reason"] == f"Harli's formula ({TOKENS_PER_CHUNK} tokens): no demand seen yet"
    lending.ranks = object()
    assert "tensor-parallel ranks keep the reserve they started with" in lending.stats()["reserve_reason"]
    lending.ranks = None


def test_with_reclaim_ahead_the_auto_reserve_follows_arrivals_not_allocations(kv):  # noqa: F811
    from harvest.memory.demand import AllocationDemand, DemandReserve
    from sglang.srt.mem_cache.allocator.token import TokenToKVPoolAllocator

    tokens, lending = kv
    lending.reserve = DemandReserve(floor_tokens=TOKENS_PER_CHUNK, cap_tokens=1024, tokens_per_chunk=TOKENS_PER_CHUNK,
                                    ack_s=10.0, reclaim_s_per_chunk=0.005, demand=AllocationDemand())
    slots = hooks._token_alloc(TokenToKVPoolAllocator.alloc, tokens, 300)  # an allocation: not the demand here
    tokens.free(slots)
    assert len(lending.reserve.demand) == 0
    scheduler = _scheduler(tokens, waiting=[_req(300, 8), _req(200, 8)])  # a burst arrives
    hooks._new_batch_prefill(lambda scheduler, running_batch: None, scheduler, _batch())
    lending.maybe_lend(force=True)
    assert lending.policy.reserve_tokens == 309 + 209
    assert lending.stats()["reserve_reason"].startswith("p99 of tokens arriving in SGLang's queue")
