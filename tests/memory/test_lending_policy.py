"""The lending rule: reserve first, hysteresis, whole free chunks high-first, the cap."""

from __future__ import annotations

import random

import pytest

from harvest.memory.lending import LendingPolicy, plan, reclaim_count

T = 100  # tokens per chunk


def policy(**kw):
    base = dict(tokens_per_chunk=T, num_chunks=10, reserve_tokens=250, hysteresis_chunks=1, max_lend_fraction=0.8)
    base.update(kw)
    return LendingPolicy(**base)


def test_lends_whole_free_chunks_highest_first_above_reserve_plus_hysteresis():
    free = [99] + [T] * 9  # chunk 0 holds the padding slot
    result = plan(policy(), free, [False] * 10)
    # free mapped 999; floor = 250 + 100 = 350 -> may lend while remaining - 100 >= 350: 6 chunks
    assert result.lend == (9, 8, 7, 6, 5, 4)
    assert result.reclaim_count == 0 and result.free_mapped_tokens == 999


def test_partly_used_chunks_and_chunk_zero_are_never_lent():
    free = [T, 50, T, 0, T, T, 10, T, T, 99]
    result = plan(policy(reserve_tokens=0, hysteresis_chunks=0), free, [False] * 10)
    assert 0 not in result.lend and set(result.lend) == {8, 7, 5, 4, 2}


def test_cap_on_lent_fraction():
    free = [0] + [T] * 9
    result = plan(policy(reserve_tokens=0, hysteresis_chunks=0, max_lend_fraction=0.3), free, [False] * 10)
    assert result.lend == (9, 8, 7)
    lent = [False] * 7 + [True] * 3
    assert plan(policy(reserve_tokens=0, hysteresis_chunks=0, max_lend_fraction=0.3), [0] + [T] * 6 + [0] * 3, lent).lend == ()


def test_a_cap_lowered_below_what_is_lent_takes_the_excess_back():
    lent = [False] * 4 + [True] * 6  # an operator lowered max_lend_fraction from 0.8 to 0.2 at run time
    free = [0] + [T] * 3 + [0] * 6
    result = plan(policy(reserve_tokens=0, hysteresis_chunks=0, max_lend_fraction=0.2), free, lent)
    assert result.reclaim_count == 4 and result.lend == ()
    # Short of the reserve as well: the larger of the two counts.
    result = plan(policy(reserve_tokens=700, hysteresis_chunks=0, max_lend_fraction=0.2), free, lent)
    assert result.reclaim_count == 4


def test_below_reserve_reclaims_enough_and_lends_nothing():
    lent = [False] * 5 + [True] * 5
    free = [0, 20, 30, 40, 10] + [0] * 5  # free mapped 100 < reserve 250
    result = plan(policy(), free, lent)
    assert result.lend == () and result.reclaim_count == 2  # ceil(150 / 100)
    assert reclaim_count(policy(), free_mapped=0, num_lent=1) == 1  # never more than lent


def test_hysteresis_band_neither_lends_nor_reclaims():
    # free mapped 300: above the reserve (250), under reserve + hysteresis + a chunk (450).
    free = [0, T, T, T] + [0] * 6
    result = plan(policy(), free, [False] * 10)
    assert result == type(result)(free_mapped_tokens=300)


@pytest.mark.parametrize("field, value", [("tokens_per_chunk", 0), ("num_chunks", -1), ("reserve_tokens", -5), ("max_lend_fraction", 1.5)])
def test_bad_policy_values(field, value):
    with pytest.raises(ValueError, match=f"LendingPolicy.{field}"):
        policy(**{field: value})


def test_wrong_lengths():
    with pytest.raises(ValueError, match="expected 10 chunks"):
        plan(policy(), [T] * 9, [False] * 10)


def test_randomized_invariants():
    rng = random.Random(7)
    for _ in range(2000):
        n = rng.randint(2, 40)
        p = LendingPolicy(tokens_per_chunk=T, num_chunks=n, reserve_tokens=rng.randint(0, 8 * T),
                          hysteresis_chunks=rng.randint(0, 3), max_lend_fraction=rng.random())
        lent = [c > 0 and rng.random() < 0.3 for c in range(n)]
        free = [0 if lent[c] else rng.choice([0, T, T, rng.randint(0, T)]) for c in range(n)]
        free[0] = min(free[0], T - 1)
        result = plan(p, free, lent)
        mapped_free = sum(f for f, l in zip(free, lent) if not l)
        if mapped_free < p.reserve_tokens and any(lent):
            assert result.reclaim_count > 0 and not result.lend
        for chunk in result.lend:
            assert chunk != 0 and not lent[chunk] and free[chunk] == T
        assert sum(lent) + len(result.lend) <= max(p.max_lent_chunks, sum(lent))
        if result.lend:
            assert mapped_free - len(result.lend) * T >= p.reserve_tokens + p.hysteresis_chunks * T
