"""The auto reserve from the demand seen (harvest.memory.demand): the tokens allocated
within one reclaim horizon at a percentile, Harli's formula as the floor, a cap, up at
once and down only after a while and by more than a chunk."""

from __future__ import annotations

import random

import pytest

from harvest.memory.demand import AllocationDemand, DemandReserve

CHUNK = 100


def _brute_within(records, span, percentile):
    sums = sorted(sum(t for at, t in records if start <= at <= start + span) for start, _ in records)
    import math

    return sums[min(len(sums) - 1, max(0, math.ceil(percentile / 100 * len(sums)) - 1))]


@pytest.mark.parametrize("seed", range(20))
def test_tokens_within_a_span_equal_a_brute_force_count(seed):
    rng = random.Random(seed)
    demand = AllocationDemand(window_s=1000.0)
    at, records = 0.0, []
    for _ in range(rng.randint(1, 60)):
        at += rng.choice([0.0, 0.001, 0.01, 0.2, 1.0]) * rng.random()
        tokens = rng.choice([1, 1, 4, 2000, 8000])
        demand.record(at, tokens)
        records.append((at, tokens))
    for span in (0.0, 0.005, 0.05, 0.5, 5.0):
        for percentile in (50, 90, 99, 100):
            assert demand.within(span, percentile) == _brute_within(records, span, percentile)


def test_an_empty_window_asks_for_nothing_and_old_records_are_forgotten():
    demand = AllocationDemand(window_s=10.0)
    assert demand.within(1.0, 99) == 0
    demand.record(0.0, 500)
    demand.record(0.0, 0)  # nothing allocated: not a record
    assert len(demand) == 1
    demand.forget_before(5.0)
    assert len(demand) == 1
    demand.forget_before(10.5)
    assert len(demand) == 0


def _reserve(**overrides):
    kwargs = dict(floor_tokens=2 * CHUNK, cap_tokens=50 * CHUNK, tokens_per_chunk=CHUNK, ack_s=0.04,
                  reclaim_s_per_chunk=0.005, percentile=99.0, lower_after_s=30.0,
                  demand=AllocationDemand(window_s=60.0))
    kwargs.update(overrides)
    return DemandReserve(**kwargs)


def test_without_demand_the_reserve_is_harlis_formula():
    reserve = _reserve()
    assert reserve.current.tokens == 2 * CHUNK
    decision = reserve.update(0.0)
    assert decision.tokens == 2 * CHUNK and "Harli" in decision.reason


def test_a_burst_of_arrivals_raises_the_reserve_at_once_to_what_arrived_within_the_horizon():
    reserve = _reserve(cap_tokens=10**6)
    for i in range(10):  # ten 2k-token prompts within 20 ms, then steady decode growth
        reserve.demand.record(1.0 + i * 0.002, 2000)
    for i in range(100):
        reserve.demand.record(1.1 + i * 0.04, 32)
    decision = reserve.update(5.0)
    # The horizon (40 ms + 5 ms for each chunk to come back) spans the whole burst, and the
    # decode growth that follows within it.
    # p99 over the windows that start at each allocation: the second-largest here, the
    # one from the burst's second prompt on.
    assert 18000 <= decision.tokens <= 20000 + 32 * 100
    assert "p99" in decision.reason and "horizon" in decision.reason


def test_the_horizon_grows_with_the_chunks_the_demand_needs():
    # A 45 ms horizon holds one 1000-token arrival; the 90 ms that 1000 tokens take to come
    # back (40 ms + 10 chunks x 5 ms) holds the second one too: the fixed point is 2000.
    reserve = _reserve(percentile=100.0, cap_tokens=10**6)
    for at in (0.0, 0.08, 1.0):
        reserve.demand.record(at, 1000)
    assert reserve.horizon_s(1000) == pytest.approx(0.09)
    assert reserve.wanted().tokens == 2000


def test_arrivals_faster_than_reclaims_take_the_cap():
    # 1000 tokens every 50 ms, and 1000 tokens take 50 ms of driver time (+40 ms) to come
    # back: the horizon never stops growing.
    reserve = _reserve(percentile=100.0, cap_tokens=30000)
    for i in range(200):
        reserve.demand.record(i * 0.05, 1000)
    decision = reserve.wanted()
    assert decision.tokens == 30000 and "cannot keep pace" not in decision.reason and "as fast as" in decision.reason


def test_the_reserve_is_capped():
    reserve = _reserve(cap_tokens=5 * CHUNK)
    reserve.demand.record(0.0, 100000)
    decision = reserve.update(0.1)
    assert decision.tokens == 5 * CHUNK and "capped" in decision.reason


def test_it_falls_only_after_lower_after_s_and_by_more_than_a_chunk():
    reserve = _reserve(lower_after_s=30.0, cap_tokens=10**6, demand=AllocationDemand(window_s=10.0))
    reserve.demand.record(0.0, 5000)
    assert reserve.update(0.0).tokens == 5000
    # The burst leaves the window at t = 10: demand falls to the floor, the reserve waits.
    assert reserve.update(11.0).tokens == 5000
    assert reserve.update(40.0).tokens == 5000
    assert reserve.update(41.5).tokens == 2 * CHUNK  # 30 s after it first saw less
    # A new burst raises it at once; a drop of less than a chunk never lowers it.
    reserve.demand.record(42.0, 2 * CHUNK + 50)
    assert reserve.update(42.0).tokens == 2 * CHUNK + 50
    assert reserve.update(100.0).tokens == 2 * CHUNK + 50  # the floor is 50 below
    # A demand that comes back before the wait is over restarts the wait.
    reserve.demand.record(101.0, 9000)
    assert reserve.update(101.0).tokens == 9000
    assert reserve.update(115.0).tokens == 9000  # the 9000 left the window: lower from here on
    reserve.demand.record(120.0, 8000)  # lower by more than a chunk too: the wait goes on
    assert reserve.update(130.0).tokens == 9000
    assert reserve.update(144.0).tokens == 9000
    assert reserve.update(145.5).tokens == 2 * CHUNK  # 30 s after 115


@pytest.mark.parametrize("field, value", [("floor_tokens", -1), ("tokens_per_chunk", 0), ("ack_s", float("nan")),
                                          ("reclaim_s_per_chunk", -0.1), ("percentile", 0.0), ("percentile", 101.0),
                                          ("lower_after_s", float("inf"))])
def test_bad_settings_are_refused_naming_the_field(field, value):
    with pytest.raises(ValueError, match=field):
        _reserve(**{field: value})


def test_a_bad_window_is_refused():
    with pytest.raises(ValueError, match="window_s"):
        AllocationDemand(window_s=0.0)


def test_the_free_target_adds_what_the_engine_promised_its_running_requests_and_covers_a_held_admission():
    from harvest.memory.demand import free_target, free_target_reason

    assert free_target(512) == 512 and free_target_reason(512) == "512 tokens: the reserve"
    # Reclaim ahead: the reserve covers arrivals within a horizon, beside what admission keeps.
    assert free_target(512, promised_tokens=300) == 812
    assert "the reserve (512) plus the 300" in free_target_reason(512, promised_tokens=300)
    # A held admission needs more than that: it is the target until it is admitted.
    assert free_target(512, promised_tokens=300, held_tokens=2000) == 2000
    assert "held back by lent memory" in free_target_reason(512, promised_tokens=300, held_tokens=2000)
    assert free_target(512, promised_tokens=300, held_tokens=700) == 812
    assert free_target(512, promised_tokens=-5) == 512
