"""KV lending on SGLang's real token allocator (CPU, host-backed unified allocator), and
the allocator hooks that take lent chunks back before SGLang would fail an allocation or
retract a decode request."""

from __future__ import annotations

import pytest
import torch

from harvest.memory import UnifiedAllocator
from harvest.memory.lending import LendingPolicy
from harvest.sglang import hooks
from harvest.sglang.kv_lending import KvLendingController

pytest.importorskip("sglang")
from sglang.srt.mem_cache.allocator.base import BaseTokenToKVPoolAllocator  # noqa: E402
from sglang.srt.mem_cache.allocator.token import TokenToKVPoolAllocator  # noqa: E402

TOKENS_PER_CHUNK = 128
NUM_CHUNKS = 8


@pytest.fixture
def kv():
    alloc = UnifiedAllocator(num_layers=2, kv_heads=2, head_dim=16, dtype_bytes=4, max_tokens=NUM_CHUNKS * TOKENS_PER_CHUNK,
                             small_pool_bytes=4 * 16384, page_bytes=16384)
    assert alloc.geometry.tokens_per_chunk == TOKENS_PER_CHUNK
    # SGLang's slot 0 is the padding slot (never free), so chunk 0 is never lendable.
    tokens = TokenToKVPoolAllocator(NUM_CHUNKS * TOKENS_PER_CHUNK - 1, torch.float32, "cpu", None, need_sort=True)
    policy = LendingPolicy(tokens_per_chunk=TOKENS_PER_CHUNK, num_chunks=NUM_CHUNKS, reserve_tokens=TOKENS_PER_CHUNK,
                           hysteresis_chunks=0, max_lend_fraction=1.0)
    lending = KvLendingController(tokens, alloc, policy)
    hooks.register_lending(tokens, lending)
    yield tokens, lending
    hooks._lending_by_allocator.pop(id(tokens), None)
    lending.reclaim_all()
    alloc.check_integrity()
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
    lent_chunks = {c for c in range(NUM_CHUNKS) if lending.lent[c]}
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


def test_without_lending_registered_the_hooks_call_through(kv):
    tokens, lending = kv
    hooks._lending_by_allocator.pop(id(tokens))
    lending.maybe_lend(force=True)
    assert _check(tokens, tokens.available_size() + 1) is False
    hooks.register_lending(tokens, lending)


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
