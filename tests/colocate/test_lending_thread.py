"""The lending thread (harvest.sglang.lending_thread.ThreadedMover behind
KvLendingController): the allocator's work runs off the scheduler thread, its results
reach SGLang's free lists only when the scheduler thread applies them, the urgent path
waits for it, the idle integrity check never runs while it moves chunks, a trainer
allocating in a chunk chosen for reclaim is answered by choosing again, errors surface on
the scheduler thread, tensor-parallel ranks stay on the scheduler thread, and closing
joins it with nothing half-done."""

from __future__ import annotations

import threading
import time

import pytest
import torch

from harvest.config import MemoryConfig
from harvest.memory import UnifiedAllocator, VmmInvalidArgument
from harvest.memory.lending import LendingPolicy
from harvest.memory.lent_budget import LentMemoryBudget
from harvest.sglang import hooks
from harvest.sglang.kv_lending import KvLendingController

pytest.importorskip("sglang")
from sglang.srt.mem_cache.allocator.token import TokenToKVPoolAllocator  # noqa: E402

TOKENS_PER_CHUNK = 128
NUM_CHUNKS = 8


class WatchedAllocator:
    """The unified allocator, recording which thread called lend/reclaim/cancel/finish,
    and able to hold a reclaim until released (as a driver call that takes a while)."""

    def __init__(self, allocator):
        self._allocator = allocator
        self.threads: list[tuple[str, str]] = []
        self.reclaim_gate = threading.Event()
        self.reclaim_gate.set()
        self.reclaiming = threading.Event()
        self.before_reclaim = None  # called once with the chunks of the next reclaim

    def __getattr__(self, name):
        return getattr(self._allocator, name)

    def _called(self, name):
        self.threads.append((name, threading.current_thread().name))

    def lend(self, chunks, wait=True):
        self._called("lend")
        return self._allocator.lend(chunks, wait=wait)

    def finish_lends(self):
        self._called("finish_lends")
        return self._allocator.finish_lends()

    def cancel_lends(self, chunks):
        self._called("cancel_lends")
        return self._allocator.cancel_lends(chunks)

    def reclaim(self, chunks):
        self._called("reclaim")
        self.reclaiming.set()
        self.reclaim_gate.wait(30)
        hook, self.before_reclaim = self.before_reclaim, None
        if hook is not None:
            hook(chunks)
        return self._allocator.reclaim(chunks)


@pytest.fixture
def threaded():
    alloc = UnifiedAllocator(num_layers=2, kv_heads=2, head_dim=16, dtype_bytes=4, max_tokens=NUM_CHUNKS * TOKENS_PER_CHUNK,
                             small_pool_bytes=4 * 16384, page_bytes=16384)
    watched = WatchedAllocator(alloc)
    tokens = TokenToKVPoolAllocator(NUM_CHUNKS * TOKENS_PER_CHUNK - 1, torch.float32, "cpu", None, need_sort=True)
    policy = LendingPolicy(tokens_per_chunk=TOKENS_PER_CHUNK, num_chunks=NUM_CHUNKS, reserve_tokens=TOKENS_PER_CHUNK,
                           hysteresis_chunks=0, max_lend_fraction=1.0)
    lending = KvLendingController(tokens, watched, policy, LentMemoryBudget(),
                                  MemoryConfig(urgent_reclaim_wait_s=5.0, lending_thread=True))
    yield tokens, lending, watched
    watched.reclaim_gate.set()
    lending.reclaim_all()
    lending.check_integrity()
    lending.close()
    alloc.close()


def _lend_all(lending) -> int:
    lending.maybe_lend(force=True)
    lending.settle()
    assert lending.num_lent > 2
    return lending.num_lent


def test_the_allocators_work_runs_on_the_lending_thread_and_reaches_the_free_lists_when_applied(threaded):
    tokens, lending, watched = threaded
    lent = _lend_all(lending)
    assert lending.lending_thread
    scheduler = threading.current_thread().name
    assert watched.threads and all(thread != scheduler for _, thread in watched.threads)
    watched.reclaim_gate.clear()  # the driver takes a while
    held = tokens.alloc(tokens.available_size() - TOKENS_PER_CHUNK // 2)  # decode grew into the reserve
    available = tokens.available_size()
    started = time.perf_counter()
    lending.after_step()  # posts the reclaim and goes on
    assert time.perf_counter() - started < 1.0
    assert watched.reclaiming.wait(10)
    assert lending.num_lent == lent and tokens.available_size() == available  # not back yet
    assert lending.maybe_check_integrity() is False  # the thread moves chunks: the check waits
    lending.after_step()  # a job still runs: nothing more is asked
    assert sum(name == "reclaim" for name, _ in watched.threads) == 1
    watched.reclaim_gate.set()
    lending.settle()
    assert lending.num_lent == lent - 1 and tokens.available_size() == available + TOKENS_PER_CHUNK
    assert lending.stats()["urgent_reclaims_total"] == 0 and lending.stats()["reclaims_total"] == 1
    assert lending.maybe_check_integrity() is True
    tokens.free(held)


def test_an_allocation_that_would_fail_waits_for_the_lending_thread(threaded):
    tokens, lending, watched = threaded
    lent = _lend_all(lending)
    need = tokens.available_size() + 1
    out = hooks._token_alloc(TokenToKVPoolAllocator.alloc, tokens, need)
    assert out is not None and len(out) == need and lending.num_lent == lent - 1
    assert ("reclaim", "harvest-kv-lending") in watched.threads
    assert lending.stats()["urgent_reclaims_total"] == 1
    tokens.free(out)


def test_a_reclaim_ahead_that_finished_meanwhile_serves_an_allocation_without_an_urgent_reclaim(threaded):
    tokens, lending, watched = threaded
    lent = _lend_all(lending)
    held = tokens.alloc(tokens.available_size() - TOKENS_PER_CHUNK // 2)
    lending.after_step()  # ahead of need, on the thread
    lending.mover.wait_all()  # finished, not applied yet
    need = tokens.available_size() + 1
    out = hooks._token_alloc(TokenToKVPoolAllocator.alloc, tokens, need)
    assert out is not None and lending.num_lent == lent - 1
    assert lending.stats()["urgent_reclaims_total"] == 0
    tokens.free(out)
    tokens.free(held)


def test_a_chunk_the_trainer_takes_between_choice_and_reclaim_is_replaced_by_another(threaded):
    tokens, lending, watched = threaded
    lent = _lend_all(lending)
    taken = []

    def trainer_allocates(chunks):  # the trainer's window grows into the chunk first chosen
        g = lending.allocator.geometry
        while (block := lending.allocator.arena_allocate(g.page_bytes)) is not None:
            taken.append(block)
            if (block.address - g.arena_base) // g.chunk_bytes == chunks[0]:
                break

    watched.before_reclaim = trainer_allocates
    assert lending.reclaim(1)  # urgent: through the thread
    assert lending.num_lent == lent - 1 and sum(name == "reclaim" for name, _ in watched.threads) == 2
    lending.check_integrity()
    for block in taken:
        block.free()


def test_an_allocator_error_on_the_thread_is_raised_on_the_scheduler_thread(threaded, monkeypatch):
    tokens, lending, watched = threaded
    _lend_all(lending)

    def broken(chunks):
        raise VmmInvalidArgument("driver says no", 1)

    monkeypatch.setattr(watched, "reclaim", broken)
    with pytest.raises(VmmInvalidArgument, match="driver says no"):
        lending.reclaim(1)
    assert lending.mover._thread.is_alive()  # the thread goes on
    monkeypatch.undo()
    lending.check_integrity()


def test_closing_runs_what_was_posted_and_joins_the_thread(threaded):
    tokens, lending, watched = threaded
    lent = _lend_all(lending)
    held = tokens.alloc(tokens.available_size() - TOKENS_PER_CHUNK // 2)
    lending.after_step()
    mover = lending.mover
    lending.close()
    assert not mover._thread.is_alive()
    assert lending.num_lent == lent - 1  # the posted reclaim ran and was applied
    lending.check_integrity()
    with pytest.raises(RuntimeError, match="stopped"):
        mover.submit(None)
    tokens.free(held)
    lending.maybe_lend(force=True)  # a call after closing works on the scheduler thread
    assert not lending.lending_thread and lending.num_lent == lent
    lending.check_integrity()


def test_tensor_parallel_ranks_stay_on_the_scheduler_thread():
    alloc = UnifiedAllocator(num_layers=2, kv_heads=2, head_dim=16, dtype_bytes=4, max_tokens=NUM_CHUNKS * TOKENS_PER_CHUNK,
                             small_pool_bytes=4 * 16384, page_bytes=16384)
    tokens = TokenToKVPoolAllocator(NUM_CHUNKS * TOKENS_PER_CHUNK - 1, torch.float32, "cpu", None, need_sort=True)
    policy = LendingPolicy(tokens_per_chunk=TOKENS_PER_CHUNK, num_chunks=NUM_CHUNKS, reserve_tokens=TOKENS_PER_CHUNK,
                           hysteresis_chunks=0, max_lend_fraction=1.0)
    lending = KvLendingController(tokens, alloc, policy, LentMemoryBudget(), MemoryConfig(lending_thread=True))

    class OneRank:  # harvest.colocate.rank_sync.RankSync of a single rank: its own mask is the agreement
        def all_of(self, mask):
            return mask.clone()

    lending.ranks = OneRank()
    lending.maybe_lend(tick=True)
    assert lending.num_lent > 0 and not lending.lending_thread  # lent at once, on this thread
    lending.reclaim_all()
    assert lending.num_taken == 0 and not lending.lending_thread
    lending.check_integrity()
    lending.close()
    alloc.close()


def test_the_default_is_the_thread_on_a_gpu_only():
    alloc = UnifiedAllocator(num_layers=2, kv_heads=2, head_dim=16, dtype_bytes=4, max_tokens=NUM_CHUNKS * TOKENS_PER_CHUNK,
                             small_pool_bytes=4 * 16384, page_bytes=16384)
    tokens = TokenToKVPoolAllocator(NUM_CHUNKS * TOKENS_PER_CHUNK - 1, torch.float32, "cpu", None, need_sort=True)
    policy = LendingPolicy(tokens_per_chunk=TOKENS_PER_CHUNK, num_chunks=NUM_CHUNKS, reserve_tokens=TOKENS_PER_CHUNK)
    lending = KvLendingController(tokens, alloc, policy, LentMemoryBudget(), MemoryConfig())
    assert lending.wants_thread is False  # the host backend: a lend costs microseconds, no thread
    lending.close()
    alloc.close()
