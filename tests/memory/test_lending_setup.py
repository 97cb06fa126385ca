"""One construction of the lending policy and the auto reserve (harvest.memory.lending_setup):
the server's composition root and the replay's memory model get the same policy and the
same reserve from the same numbers, and the numbers are those the formulas give."""

from __future__ import annotations

import dataclasses
import math

import pytest

from harvest.colocate.assemble import KvPool, demand_reserve, lending_policy
from harvest.config import HarvestConfig, MemoryConfig
from harvest.memory import UnifiedAllocator, lending_setup
from harvest.memory.lend_costs import LendCosts
from harvest.replay.kv_memory import LendingModel, MemorySettings
from harvest.schedule import SchedulerConfig


@pytest.fixture
def allocator():
    alloc = UnifiedAllocator(num_layers=2, kv_heads=2, head_dim=16, dtype_bytes=4, max_tokens=64 * 128,
                             page_bytes=16 * 1024)
    assert alloc.geometry.tokens_per_chunk == 128
    yield alloc
    alloc.close()


def _reserve_fields(reserve):
    return {f.name: getattr(reserve, f.name) for f in dataclasses.fields(reserve) if f.name not in ("demand", "cost_source")} | {
        "window_s": reserve.demand.window_s}


@pytest.mark.parametrize("memory", [
    MemoryConfig(),
    MemoryConfig(reserve_tokens=300, hysteresis_chunks=0, max_lend_fraction=0.5),
    MemoryConfig(reserve_percentile=90.0, reserve_window_s=10.0, reserve_lower_after_s=2.0, hysteresis_chunks=3),
])
@pytest.mark.parametrize("pool_tokens, max_batch, target_ms", [(64 * 128 - 1, 4, 50.0), (5000, 256, 20.0), (900, 4096, 100.0)])
def test_the_server_and_the_replay_build_the_same_policy_and_reserve(allocator, memory, pool_tokens, max_batch, target_ms):
    config = HarvestConfig(qos=SchedulerConfig(target_tpot_ms=target_ms), memory=memory)
    kv = KvPool(allocator=allocator, num_tokens=pool_tokens, max_batch_size=max_batch, lending_controller=None)
    costs = LendCosts(2.0, 3.0, "configured", "x", "x")
    server_policy = lending_policy(config, kv)
    server_reserve = demand_reserve(config, server_policy, kv, costs) if memory.reserve_tokens is None else None
    g = allocator.geometry
    model = LendingModel(pool_tokens, MemorySettings(tokens_per_chunk=g.tokens_per_chunk, reclaim_ms_per_chunk=3.0,
                                                     lend_ms_per_chunk=2.0, config=memory),
                         target_ms, max_batch, g.kv_bytes_per_token)
    assert model.policy == server_policy
    assert (model.reserve is None) == (server_reserve is None) == (memory.reserve_tokens is not None)
    if server_reserve is not None:
        assert _reserve_fields(model.reserve) == _reserve_fields(server_reserve)
        assert server_reserve.reclaim_s_per_chunk == 0.003 and server_reserve.cost_source == "x"


def test_harlis_reserve_is_two_steps_of_the_largest_batch_at_most_a_quarter_of_the_pool():
    assert lending_setup.harli_reserve(100_000, 64, 128 * 1024, 50.0) == 128  # 2 steps x 64 requests
    assert lending_setup.harli_reserve(400, 64, 128 * 1024, 50.0) == 100  # capped at a quarter
    assert lending_setup.harli_reserve(100_000, 0, 128 * 1024, 50.0) == 2  # an engine without a cap: one request


def test_the_pools_chunks_hold_its_slots_and_the_padding_slot():
    assert lending_setup.pool_chunks(1023, 128) == 8 and lending_setup.pool_chunks(1024, 128) == 9
    assert lending_setup.pool_chunks(1024, 128, allocator_chunks=8) == 8


def test_the_auto_reserve_has_harlis_floor_half_the_pool_as_cap_and_the_reclaim_cost_given():
    memory = MemoryConfig(reserve_percentile=95.0, reserve_window_s=30.0, reserve_lower_after_s=5.0)
    policy = lending_setup.lending_policy(tokens_per_chunk=100, num_chunks=11, pool_tokens=1000, max_batch_size=8,
                                          kv_bytes_per_token=1024, target_tpot_ms=40.0, memory=memory)
    assert policy.reserve_tokens == 16 and policy.hysteresis_chunks == 1 and policy.max_lend_fraction == 0.8
    reserve = lending_setup.demand_reserve(policy, pool_tokens=1000, target_tpot_ms=40.0, memory=memory,
                                           reclaim_ms_per_chunk=7.0, cost_source="the default")
    assert (reserve.floor_tokens, reserve.cap_tokens, reserve.ack_s) == (16, 500, 0.04)
    assert math.isclose(reserve.reclaim_s_per_chunk, 0.007) and reserve.percentile == 95.0
    assert reserve.lower_after_s == 5.0 and reserve.demand.window_s == 30.0
    reserve.demand.record(1.0, 300)
    decision = reserve.update(1.0)
    # a step plus 3 chunks of 7 ms; the reason says the figure and where it came from
    assert decision.tokens == 300 and "(61 ms; 7 ms per chunk reclaimed: the default)" in decision.reason
    fixed = dataclasses.replace(memory, reserve_tokens=50)
    assert lending_setup.demand_reserve(policy, pool_tokens=1000, target_tpot_ms=40.0, memory=fixed,
                                        reclaim_ms_per_chunk=7.0) is None
