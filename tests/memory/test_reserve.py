"""Harli's reserve formula: (T_swap / QoS) * max_bs * kv_bytes_per_token."""

from __future__ import annotations

import pytest

from harvest.memory import reserve_bytes, reserve_tokens


def test_harli_example_llama3_8b():
    # Llama-3-8B: 32 layers x 2 (K, V) x 8 KV heads x 128 x 2 bytes = 128 KiB per token.
    kv_bytes_per_token = 32 * 2 * 8 * 128 * 2
    # Swapping one layer out in 25 ms at a 50 ms TPOT with batch 64: half a step of
    # 64 new tokens -> 32 tokens' worth.
    assert reserve_bytes(0.025, 0.05, 64, kv_bytes_per_token) == 32 * kv_bytes_per_token
    assert reserve_tokens(0.025, 0.05, 64, kv_bytes_per_token) == 32


def test_rounds_up_and_scales_linearly():
    assert reserve_bytes(0.0, 0.05, 8, 1000) == 0
    assert reserve_bytes(0.01, 0.03, 1, 1000) == 334  # 333.33 -> 334
    assert reserve_bytes(0.1, 0.05, 10, 100) == 2 * reserve_bytes(0.05, 0.05, 10, 100)
    assert reserve_tokens(0.01, 0.03, 1, 1000) == 1


@pytest.mark.parametrize(
    "args, match",
    [
        ((-0.1, 0.05, 8, 100), "t_swap=-0.1 must not be negative"),
        ((0.1, 0.0, 8, 100), "qos=0.0 must be positive"),
        ((0.1, float("nan"), 8, 100), "qos=nan must be a finite number"),
        ((0.1, 0.05, 0, 100), "max_bs=0 must be a positive int"),
        ((0.1, 0.05, 8, -1), "kv_bytes_per_token=-1 must be a positive int"),
        ((0.1, 0.05, 8.5, 100), "max_bs=8.5 must be a positive int"),
        (("1", 0.05, 8, 100), "t_swap='1' must be a finite number"),
    ],
)
def test_bad_arguments_name_the_field(args, match):
    with pytest.raises(ValueError, match=match):
        reserve_bytes(*args)
