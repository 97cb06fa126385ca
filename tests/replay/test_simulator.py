"""The decode-instance simulation against hand-computed and brute-force expectations."""

from __future__ import annotations

import math
import random

import numpy as np
import pytest

from harvest.replay import trainer_model
from harvest.replay.policies import DecodeOnlyPolicy, LatencyErrors
from harvest.replay.simulator import DecodeLimits, simulate

from tests.replay.helpers import make_profile, requests


def decode_only(profile=None):
    profile = profile or make_profile()
    return DecodeOnlyPolicy(profile, trainer_model.build(profile), LatencyErrors())


def test_single_request_by_hand():
    # Arrives at 1 s with 100 context tokens and 5 output tokens: prefill made the first,
    # decode makes 4, each a 10 ms step; KV holds 101..104 tokens, 105 reserved.
    run = simulate(requests((1.0, 100, 5)), decode_only(), DecodeLimits(8, 1000))
    assert run.num_steps == 4
    assert np.allclose(run.step_latency_s, 0.010)
    assert np.allclose(run.step_start_s, [1.00, 1.01, 1.02, 1.03])
    assert run.step_sum_context.tolist() == [101, 102, 103, 104]
    assert run.step_reserved_tokens.tolist() == [105] * 4
    assert run.step_batch_size.tolist() == [1] * 4
    assert run.admitted_s[0] == 1.0 and run.finished_s[0] == pytest.approx(1.04)
    assert run.end_s == pytest.approx(1.04) and run.idle_s == pytest.approx(1.0)


def test_latency_follows_stage1_of_the_whole_gpu_level():
    # Level 2 (whole GPU): 1 ms per request + 2 ms + 1 µs per context token.
    profile = make_profile(solo=[(0.0, 0.05, 0.0), (0.0, 0.05, 0.0), (0.001, 0.002, 1e-6)])
    run = simulate(requests((0.0, 1000, 3), (0.0, 2000, 2)), decode_only(profile), DecodeLimits(8, 10_000))
    # step 0: bs 2, Σ = 1001 + 2001; step 1: bs 1, Σ = 1002.
    assert run.step_sum_context.tolist() == [3002, 1002]
    assert run.step_latency_s.tolist() == pytest.approx([0.002 + 0.002 + 3002e-6, 0.001 + 0.002 + 1002e-6])


def test_max_batch_size_holds_the_third_request_back():
    run = simulate(requests((0.0, 10, 3), (0.0, 10, 3), (0.0, 10, 3)), decode_only(), DecodeLimits(2, 1000))
    assert run.step_batch_size.tolist() == [2, 2, 1, 1]
    assert run.admitted_s.tolist() == pytest.approx([0.0, 0.0, 0.02])
    assert run.finished_s.tolist() == pytest.approx([0.02, 0.02, 0.04])


def test_kv_capacity_blocks_admission_in_fifo_order():
    # Footprints 150, 150, 50 against 250 tokens: the second waits for the first to
    # leave (9 steps), and the small third may not pass it (FIFO, head-of-line).
    run = simulate(requests((0.0, 140, 10), (0.0, 140, 10), (0.0, 40, 10)), decode_only(), DecodeLimits(8, 250))
    assert run.admitted_s.tolist() == pytest.approx([0.0, 0.09, 0.09])
    assert run.step_reserved_tokens.max() <= 250
    assert run.step_batch_size.tolist() == [1] * 9 + [2] * 9


def test_requests_too_large_for_the_kv_are_dropped_and_prefill_only_ones_counted():
    run = simulate(requests((0.0, 900, 200), (0.0, 10, 1), (0.1, 10, 2)), decode_only(), DecodeLimits(8, 1000))
    assert run.num_dropped == 1 and run.num_prefill_only == 1
    assert math.isnan(run.admitted_s[0]) and run.finished_s[1] == 0.0
    assert run.num_steps == 1 and run.finished_s[2] == pytest.approx(0.11)


def test_policy_kv_fraction_shrinks_the_capacity():
    policy = decode_only()
    policy.kv_fraction = 0.6
    run = simulate(requests((0.0, 150, 10), (0.0, 150, 10)), policy, DecodeLimits(8, 500))  # 2 × 160 > 300
    assert run.kv_capacity_tokens == 300
    assert run.admitted_s[1] == pytest.approx(0.09)


def _brute_force(rows, latency_of, max_batch, capacity):
    """Reference simulation: every request's sequence length tracked explicitly."""
    waiting, running, t, steps = [], [], 0.0, []
    pending = list(enumerate(rows))
    while pending or waiting or running:
        while pending and pending[0][1][0] <= t:
            waiting.append(pending.pop(0))
        while waiting and len(running) < max_batch and sum(c + g for _, (_, c, g), _ in running) + sum(waiting[0][1][1:]) <= capacity:
            i, row = waiting.pop(0)
            running.append([i, row, 0])
        if not running:
            t = pending[0][1][0]
            continue
        for r in running:
            r[2] += 1
        total = sum(row[1] + done for _, row, done in running)
        latency = latency_of(len(running), total)
        steps.append((t, len(running), total))
        t += latency
        running = [r for r in running if r[2] < r[1][2] - 1]
    return steps


@pytest.mark.parametrize("seed", range(5))
def test_constant_time_context_sum_matches_brute_force(seed):
    rng = random.Random(seed)
    rows, t = [], 0.0
    for _ in range(60):
        t += rng.expovariate(40.0)
        rows.append((t, rng.randint(1, 300), rng.randint(2, 40)))
    profile = make_profile(solo=(2e-4, 1e-3, 2e-6))
    run = simulate(requests(*rows), decode_only(profile), DecodeLimits(6, 2000))
    expected = _brute_force(rows, lambda bs, total: profile.solo[2].predict(bs, total), 6, 2000)
    assert run.step_batch_size.tolist() == [bs for _, bs, _ in expected]
    assert run.step_sum_context.tolist() == [total for _, _, total in expected]
    assert run.step_start_s.tolist() == pytest.approx([start for start, _, _ in expected])
    assert np.all(np.isfinite(run.finished_s))
