"""The server configurations harvest refuses at start-up (harvest.sglang.refusals), on
SGLang's real token allocators: each refusal names the flag that causes it, and the
configuration harvest runs on is refused nothing. (The refusal through SGLang's real
launcher: tests/test_sglang_plugin.py.)"""

from __future__ import annotations

import types

import pytest
import torch

from harvest.sglang import refusals

pytest.importorskip("sglang")
from sglang.srt.mem_cache.allocator.paged import PagedTokenToKVPoolAllocator  # noqa: E402
from sglang.srt.mem_cache.allocator.token import TokenToKVPoolAllocator  # noqa: E402

POOL_TOKENS = 1024


def _server_args(**changes):
    defaults = dict(tp_size=1, pp_size=1, dp_size=1, enable_dp_attention=False)
    defaults.update({field: (None if field == "radix_cache_backend" else False) for field, _, _ in refusals.REFUSED_FLAGS})
    defaults.update(changes)
    return types.SimpleNamespace(**defaults)


def _hf_config(heads=32, kv_heads=8):
    return types.SimpleNamespace(num_attention_heads=heads, num_key_value_heads=kv_heads, intermediate_size=14336,
                                 vocab_size=128256)


def _scheduler(server_args=None, token_allocator=None, speculative=False, hf_config=None):
    pool = types.SimpleNamespace(post_capture_active=False)
    if token_allocator is None:
        token_allocator = TokenToKVPoolAllocator(POOL_TOKENS, torch.float32, "cpu", pool, need_sort=False)
    return types.SimpleNamespace(server_args=server_args or _server_args(), token_to_kv_pool_allocator=token_allocator,
                                 spec_algorithm=types.SimpleNamespace(is_none=lambda: not speculative),
                                 model_config=types.SimpleNamespace(hf_config=hf_config or _hf_config()))


def test_the_supported_configuration_is_refused_nothing():
    assert refusals.problems(_scheduler()) == []


@pytest.mark.parametrize("field, flag, why", refusals.REFUSED_FLAGS, ids=[flag for _, flag, _ in refusals.REFUSED_FLAGS])
def test_each_refused_flag_is_named_with_its_reason(field, flag, why):
    value = "custom_cache" if field == "radix_cache_backend" else True
    found = refusals.problems(_scheduler(_server_args(**{field: value})))
    assert len(found) == 1 and found[0].startswith(flag) and why in found[0] and found[0].endswith(f"run without {flag}")


def test_a_paged_allocator_is_refused_naming_the_page_size_flag():
    pool = types.SimpleNamespace(post_capture_active=False)
    paged = PagedTokenToKVPoolAllocator(POOL_TOKENS, 16, torch.float32, "cpu", pool, need_sort=False)
    (found,) = refusals.problems(_scheduler(token_allocator=paged))
    assert "KV page size 16 (PagedTokenToKVPoolAllocator" in found and "--page-size 1" in found


def test_another_allocator_class_is_refused_even_with_pages_of_one_token():
    # A subclass may override the methods harvest hooks on TokenToKVPoolAllocator itself.
    class HybridAllocator(TokenToKVPoolAllocator):
        pass

    pool = types.SimpleNamespace(post_capture_active=False)
    (found,) = refusals.problems(_scheduler(token_allocator=HybridAllocator(POOL_TOKENS, torch.float32, "cpu", pool,
                                                                            need_sort=False)))
    assert "token allocator is HybridAllocator" in found


def test_post_capture_kv_sizing_is_refused_naming_its_variable():
    scheduler = _scheduler()
    scheduler.token_to_kv_pool_allocator.get_kvcache().post_capture_active = True
    (found,) = refusals.problems(scheduler)
    assert "SGLANG_ENABLE_POST_CAPTURE_KV_SIZING" in found


@pytest.mark.parametrize("tp_size", [2, 4, 8])
def test_tensor_parallelism_runs_when_the_model_splits_evenly(tp_size):
    assert refusals.problems(_scheduler(_server_args(tp_size=tp_size))) == []


def test_tensor_parallelism_is_refused_where_sglang_would_replicate_kv_heads():
    (found,) = refusals.problems(_scheduler(_server_args(tp_size=4), hf_config=_hf_config(kv_heads=2)))
    assert found.startswith("--tp 4: 2 key/value heads do not split over 4")


def test_dp_attention_is_refused_by_its_flag():
    (found,) = refusals.problems(_scheduler(_server_args(tp_size=2, enable_dp_attention=True)))
    assert found.startswith("--enable-dp-attention")


def test_every_problem_is_reported_at_once():
    found = refusals.problems(_scheduler(_server_args(pp_size=2, enable_hierarchical_cache=True), speculative=True))
    assert len(found) == 3 and "pp_size" in found[0] and "speculative" in found[1]
    assert found[2].startswith("--enable-hierarchical-cache")


def test_every_server_args_field_read_exists_in_this_sglang():
    from harvest.sglang.plugin import unresolvable_targets

    assert unresolvable_targets(refusals.SGLANG_ATTRIBUTES) == []
