"""The replay's KV pool (harvest/replay/kv_memory.py): harvest's lending by the server's own
policy code on small hand-made traces, StaticMode's fixed share, what the command reports,
and the profile's lend/reclaim figures (read, defaulted with a warning, refused when bad)."""

from __future__ import annotations

import dataclasses
import json
import random

import numpy as np
import pytest

from harvest.cli import main
from harvest.memory.lending import free_mapped_tokens, plan
from harvest.predict.schema import MemorySection, Profile
from harvest.replay import comparison, kv_memory, profile_source, synthetic, trainer_model
from harvest.replay.policies import HARVEST, STATIC
from harvest.replay.trace import SAMPLE_TRACE

from tests.replay.helpers import make_profile, requests, settings

TPC = 16  # tokens per chunk of the small pools below
CAPACITY = 1600  # slots 1..1600 and the padding slot: 101 chunks, the top one a single slot
RECLAIM_MS = 5.0


def memory_settings(**config) -> kv_memory.MemorySettings:
    return kv_memory.MemorySettings(tokens_per_chunk=TPC, reclaim_ms_per_chunk=RECLAIM_MS, lend_ms_per_chunk=RECLAIM_MS,
                                    config=kv_memory.MemoryConfig(**config))


def flat_profile():
    """Every step 10 ms on every level, co-located or not (stage 2's factor is 1 on all)."""
    return make_profile(solo=(0.0, 0.010, 0.0), corun=(1.0, 1.0))


def two_bursts():
    """Three requests of 200 prompt tokens at 1 s, then nothing until the same again at 10 s
    (the auto reserve lowers only after 30 s, and remembers 60 s)."""
    burst = [(start, 200, 20) for start in (1.0, 10.0) for _ in range(3)]
    return requests(*burst)


def replay(rows, memory, policies=(HARVEST,), kv=CAPACITY, max_batch=8):
    profile = flat_profile()
    return comparison.run(rows, profile, trainer_model.build(profile),
                          settings(max_batch=max_batch, kv=kv, memory=memory, policies=policies))


def lent_at(run, times):
    """Chunks lent just after everything that happened at each of ``times``."""
    memory = run.memory
    return memory.lent_chunks[np.searchsorted(memory.event_s, times, side="right") - 1]


# -- harvest's lending ----------------------------------------------------------------------


def test_a_burst_forces_an_urgent_reclaim_with_a_fixed_reserve_and_none_once_the_auto_reserve_has_seen_one():
    fixed = replay(two_bursts(), memory_settings(reserve_tokens=16)).results[HARVEST]
    auto = replay(two_bursts(), memory_settings()).results[HARVEST]
    # the idle server lent up to its cap (80 of 101 chunks) before the first burst
    assert fixed.run.memory.lent_chunks[0] == 0 and lent_at(fixed.run, [0.5])[0] == 80
    # fixed reserve: each burst's 603 tokens find 320 free (the cap's) and wait for chunks back
    assert fixed.run.memory.urgent_s.tolist() == pytest.approx([1.0, 10.0])
    assert fixed.memory.metrics["urgent_reclaims"] == 2
    # auto reserve: the first burst is news; the second finds the reserve it left
    assert auto.run.memory.urgent_s.tolist() == pytest.approx([1.0])
    assert auto.memory.metrics["reserve_tokens_max"] >= 603
    # reclaim ahead (the default): the reserve follows arrivals, priced with their decode
    assert auto.memory.metrics["reserve_reason"].startswith("p99 of tokens arriving (as admission prices them) "
                                                            "within one reclaim horizon")
    assert auto.memory.metrics["chunks_lent_mean"] < fixed.memory.metrics["chunks_lent_mean"]  # what the reserve costs


def test_the_urgent_reclaim_delays_its_step_by_the_reclaim_time_and_inline_lending_work_the_next_step():
    result = replay(two_bursts(), memory_settings(reserve_tokens=16, lending_thread=False)).results[HARVEST]
    run, memory = result.run, result.run.memory
    urgent_steps = np.searchsorted(run.step_start_s, memory.urgent_s)
    assert run.step_start_s[urgent_steps].tolist() == pytest.approx(memory.urgent_s.tolist())
    # 3 x 201 = 603 tokens against the 320 that 80 chunks lent leave free: ceil(283 / 16) = 18 chunks back, 5 ms each
    assert memory.urgent_chunks.tolist() == [18, 18]
    assert memory.urgent_delay_s.tolist() == pytest.approx([0.090, 0.090])
    extra = run.step_latency_s - 0.010
    assert np.all(extra[urgent_steps] >= memory.urgent_delay_s - 1e-12)
    # Every second of a step over its 10 ms is an urgent reclaim's or the scheduler thread's
    # lending work since the step before (the server lends and reclaims between steps).
    assert extra.sum() == pytest.approx(memory.urgent_delay_s.sum() + memory.scheduled_delay_s_total)
    assert memory.scheduled_delay_s_total <= memory.lend_s_total + memory.reclaim_s_total + 1e-12
    m = result.memory.metrics
    assert m["reclaim_delay_ms_p99"] == pytest.approx(90.0) and m["reclaim_delay_s_total"] == pytest.approx(0.180)
    assert result.metrics["tpot_max_ms"] >= 100.0 - 1e-9  # the delay is decode's: TPOT sees it


def test_with_the_lending_thread_only_urgent_reclaims_delay_steps():
    """lending_thread (auto: on, as on a GPU server): lends and reclaims between steps run
    off the decode thread; their driver time is counted, not added to any step."""
    result = replay(two_bursts(), memory_settings(reserve_tokens=16)).results[HARVEST]
    run, memory = result.run, result.run.memory
    extra = run.step_latency_s - 0.010
    assert memory.urgent_delay_s.tolist() == pytest.approx([0.090, 0.090])  # decode still waits for those
    assert extra.sum() == pytest.approx(memory.urgent_delay_s.sum())
    assert memory.scheduled_delay_s_total == 0.0 and memory.lend_s_total > 0 and memory.reclaim_s_total > 0
    inline = replay(two_bursts(), memory_settings(reserve_tokens=16, lending_thread=False)).results[HARVEST]
    assert inline.run.memory.scheduled_delay_s_total > 0
    assert inline.run.step_latency_s.sum() > run.step_latency_s.sum()


def _lent_model(reclaim_ahead=True, tp_size=1):
    memory = memory_settings(reserve_tokens=16, reclaim_ahead=reclaim_ahead)
    model = kv_memory.LendingModel(CAPACITY, memory, 40.0, 8, 1024, tp_size)
    model.start(0.0)  # an idle server lends up to its cap
    assert model.lent == 80
    return model


def test_reclaim_ahead_keeps_free_what_admission_set_aside_for_the_running_requests_decode():
    """The server's free target (harvest.memory.demand.free_target): the reserve plus what
    admission set aside for the running requests' decode; chunks come back ahead of it."""
    ahead = _lent_model()
    # 100 tokens held, 500 more set aside: 1600 - 80 x 16 - 100 = 220 free, 516 wanted
    ahead.after_step(1.0, held=100, promised=500)
    assert ahead.lent == 80 - 19 and ahead.capacity - ahead.lent * TPC - ahead.held >= 16 + 500
    assert ahead._urgent_s.tolist() == []  # taken back between steps, not by a waiting step
    for fixed in (_lent_model(reclaim_ahead=False), _lent_model(tp_size=2)):  # the reserve alone
        fixed.after_step(1.0, held=100, promised=500)
        assert fixed.lent == 80


def test_with_reclaim_ahead_the_auto_reserve_follows_arrivals_not_allocations():
    ahead = kv_memory.LendingModel(CAPACITY, memory_settings(), 40.0, 8, 1024)
    ahead.arrived(1.0, 660)
    ahead.before_step(1.0, held=600)  # the prompts' allocation: not recorded again
    assert list(ahead.reserve.demand._records) == [(1.0, 660)]
    allocations = kv_memory.LendingModel(CAPACITY, memory_settings(reclaim_ahead=False), 40.0, 8, 1024)
    allocations.arrived(1.0, 660)  # not recorded
    allocations.before_step(1.0, held=600)
    assert list(allocations.reserve.demand._records) == [(1.0, 600)]


@pytest.mark.parametrize("reserve", [None, 16, 300])
def test_chunks_lent_never_exceed_the_pool_minus_what_requests_hold(reserve):
    rng = random.Random(7)
    rows, t = [], 0.0
    for _ in range(400):
        t += rng.expovariate(20.0)
        rows.append((t, rng.choice([10, 40, 120, 300]), rng.randint(2, 40)))
    config = {} if reserve is None else {"reserve_tokens": reserve}
    result = replay(requests(*rows), memory_settings(**config), max_batch=16).results[HARVEST]
    run, memory = result.run, result.run.memory
    lent = lent_at(run, run.step_start_s)  # after each step's urgent reclaim, if any
    assert np.all(lent * TPC + run.step_sum_context <= CAPACITY)
    assert lent.max() <= int(0.8 * memory.num_chunks) and memory.lent_chunks.min() >= 0
    assert memory.chunks_lent_total - memory.chunks_reclaimed_total == memory.lent_chunks[-1]
    assert run.num_steps > 500 and memory.chunks_lent_total > 0


def test_skipping_the_plan_when_it_could_not_act_changes_nothing():
    """LendingModel calls plan() only when _could_act(); wherever it says no, plan() would
    have done nothing."""
    rng = random.Random(3)
    checked = 0
    for _ in range(3000):
        tpc = rng.choice([1, 4, 16, 64])
        capacity = rng.randint(1, 40) * tpc + rng.randint(0, tpc)
        config = {"reserve_tokens": rng.randint(0, capacity), "hysteresis_chunks": rng.randint(0, 3),
                  "max_lend_fraction": rng.choice([0.0, 0.3, 0.8, 1.0])}
        memory = kv_memory.MemorySettings(tokens_per_chunk=tpc, config=kv_memory.MemoryConfig(**config))
        model = kv_memory.LendingModel(capacity, memory, 40.0, 8, 1024)
        lendable = max(0, model.highest_lendable)
        model.lent = rng.randint(0, lendable)
        model.held = rng.randint(0, capacity - model.lent * tpc)
        free, lent = model.chunk_view()
        assert len(free) == len(lent) == model.policy.num_chunks and sum(lent) == model.lent
        assert free_mapped_tokens(free, lent) == capacity - model.lent * tpc - model.held
        if not model._could_act():
            decision = plan(model.policy, free, lent)
            assert decision.lend == () and decision.reclaim_count == 0
            checked += 1
    assert checked > 300


def test_static_holds_the_share_decode_does_not_get_and_never_reclaims():
    comparison_ = replay(two_bursts(), memory_settings(), policies=(HARVEST, STATIC, "separate"))
    static = comparison_.results[STATIC].memory.metrics
    # decode gets 60 % of 1600 slots; the other 640 are 40 chunks of 16
    assert static["kind"] == "static" and static["chunks_lent_min"] == static["chunks_lent_max"] == 40
    assert static["urgent_reclaims"] == 0 and static["chunks_reclaimed_total"] == 0
    assert comparison_.results["separate"].memory is None  # it lends nothing


def test_memory_off_replays_exactly_as_before():
    # a reserve of the whole pool: nothing is lent, so no lend, reclaim or wait
    with_memory = replay(two_bursts(), memory_settings(reserve_tokens=CAPACITY)).results[HARVEST]
    without = replay(two_bursts(), None).results[HARVEST]
    assert with_memory.run.memory.urgent_s.size == 0 and without.memory is None
    assert with_memory.run.step_latency_s.tolist() == without.run.step_latency_s.tolist()
    assert with_memory.metrics == without.metrics


def test_series_are_time_weighted_means_per_interval():
    t = np.array([0.0, 5.0, 25.0])
    lent = np.array([0, 10, 4])
    assert kv_memory._bucket_means(t, lent, 30.0, 10.0).tolist() == pytest.approx([5.0, 10.0, 7.0])
    assert kv_memory.series_interval(3600.0) == 10.0 and kv_memory.series_interval(10 * 3600.0) == 50.0


# -- the command ----------------------------------------------------------------------------


@pytest.fixture(scope="module")
def profile_data():
    return json.loads(synthetic.harli_a100_llama3_8b().to_json())


def run_cli(capsys, *argv):
    code = main(["replay", "--trace", str(SAMPLE_TRACE), "--no-plots", "--no-progress", *argv])
    captured = capsys.readouterr()
    return code, captured.out, captured.err


def test_the_sample_replay_reports_memory(tmp_path, profile_data, capsys):
    path = tmp_path / "with-memory.json"
    path.write_text(json.dumps({**profile_data, "memory": {"chunk_bytes": 64 * 2**20, "lend_ms_per_chunk": 2.0,
                                                           "reclaim_ms_per_chunk": 3.0}}))
    code, out, err = run_cli(capsys, "--profile", str(path), "--json")
    assert code == 0 and "lend/reclaim" not in err, err  # (the synthetic profile's range warns: not this test's)
    data = json.loads(out)
    memory_settings_ = data["settings"]["memory"]
    # the profile's figures are for 64 MiB; the replay's chunk is 1024 tokens x 128 KiB = 128 MiB
    assert memory_settings_["reclaim_ms_per_chunk"] == 6.0 and memory_settings_["lend_ms_per_chunk"] == 4.0
    assert memory_settings_["figures_from"] == "with-memory.json's memory section, measured for a 64 MiB chunk, scaled to 128 MiB"
    policies = data["runs"][0]["policies"]
    harvest, static = policies["harvest"]["memory"], policies["static"]["memory"]
    assert "memory" not in policies["separate"] and "memory" not in policies["decode-only"]
    for key in ("chunks_lent_mean", "urgent_reclaims", "reclaim_delay_ms_p99", "reclaim_delay_s_total", "window_stages_mean"):
        assert key in harvest and key in static
    series = harvest["series"]
    buckets = -(-data["runs"][0]["horizon_s"] // 10)
    assert series["interval_s"] == 10.0 and len(series["chunks_lent_mean"]) == len(series["window_stages_mean"]) == buckets
    assert max(series["chunks_lent_mean"]) <= 125 and max(series["window_stages_mean"]) <= 34
    code, text, _ = run_cli(capsys, "--profile", str(path))
    assert "KV memory (series per 10 s" in text and "\n  harvest: " in text and "urgent reclaim(s)" in text


def test_a_profile_without_lend_reclaim_figures_warns_naming_the_field_and_uses_the_default(tmp_path, profile_data, capsys):
    path = tmp_path / "plain.json"
    path.write_text(json.dumps(profile_data))
    code, out, err = run_cli(capsys, "--profile", str(path), "--json", "--max-requests", "40")
    assert code == 0
    warnings = [line for line in err.splitlines() if "lend/reclaim" in line]
    assert len(warnings) == 1
    assert warnings[0].startswith("harvest replay: warning: plain.json has no lend/reclaim figures (profile.memory.reclaim_ms_per_chunk")
    assert json.loads(out)["settings"]["memory"]["reclaim_ms_per_chunk"] == 7.0
    # given on the command line, or harvest not replayed: nothing to warn about
    for extra in (["--memory", "reclaim_ms_per_chunk=9"], ["--policies", "static,separate"]):
        code, out, err = run_cli(capsys, "--profile", str(path), "--json", "--max-requests", "40", *extra)
        assert code == 0 and "lend/reclaim" not in err, err


@pytest.mark.parametrize(
    "memory, message",
    [
        ({"chunk_bytes": 2**27, "lend_ms_per_chunk": 7.0, "reclaim_ms_per_chunk": -1.0}, "profile.memory.reclaim_ms_per_chunk=-1.0: must be a finite number of ms >= 0"),
        ({"chunk_bytes": 2**27, "lend_ms_per_chunk": -0.5, "reclaim_ms_per_chunk": 7.0}, "profile.memory.lend_ms_per_chunk=-0.5: must be"),
        ({"chunk_bytes": 0, "lend_ms_per_chunk": 7.0, "reclaim_ms_per_chunk": 7.0}, "profile.memory.chunk_bytes=0: must be >= 1"),
        ({"chunk_bytes": 2**27, "lend_ms_per_chunk": 7.0, "reclaim_ms_per_chunk": "INF"}, "profile.memory.reclaim_ms_per_chunk: Infinity is not valid JSON"),
        ({"chunk_bytes": 2**27, "reclaim_ms_per_chunk": 7.0}, "profile.memory: missing field(s) lend_ms_per_chunk"),
        ({"chunk_bytes": 2**27, "lend_ms_per_chunk": 7.0, "reclaim_ms_per_chunk": 7.0, "unmap_ms": 1}, "profile.memory: unknown field(s) unmap_ms"),
    ],
)
def test_bad_lend_reclaim_figures_are_refused_naming_the_file_and_field(tmp_path, profile_data, capsys, memory, message):
    path = tmp_path / "bad-memory.json"
    path.write_text(json.dumps({**profile_data, "memory": memory}).replace('"INF"', "Infinity"))
    code, out, err = run_cli(capsys, "--profile", str(path))
    assert code == 2 and out == ""
    assert err.startswith(f"harvest replay: {path}: {message}") and len(err.strip().splitlines()) == 1, err


def test_the_memory_section_round_trips_and_a_profile_without_it_is_written_as_before(tmp_path):
    profile = synthetic.harli_a100_llama3_8b()
    assert "memory" not in profile.to_dict()
    measured = dataclasses.replace(profile, memory=MemorySection(2**27, 5.2, 7.0))
    path = tmp_path / "m.json"
    measured.save(path)
    assert json.loads(path.read_text())["memory"] == {"chunk_bytes": 2**27, "lend_ms_per_chunk": 5.2, "reclaim_ms_per_chunk": 7.0}
    assert Profile.load(path) == measured and profile_source.load(path).memory == measured.memory
    with pytest.raises(ValueError, match=r"profile.memory.reclaim_ms_per_chunk=nan"):
        MemorySection(2**27, 5.0, float("nan"))


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--memory", "bogus=1"], "--memory: unknown key(s) bogus"),
        (["--memory", "max_lend_fraction=2"], "--memory: max_lend_fraction"),
        (["--memory", "reclaim_ms_per_chunk=-3"], "--memory: reclaim_ms_per_chunk"),
        (["--memory", "reclaim_ms_per_chunk=nan"], "--memory: reclaim_ms_per_chunk='nan': expected 'auto' or a finite number >= 0"),
        (["--memory", "reclaim_ms_per_chunk=inf"], "--memory: reclaim_ms_per_chunk='inf': expected 'auto' or a finite number >= 0"),
        (["--kv-chunk-tokens", "0"], "--kv-chunk-tokens=0: must be an integer >= 1"),
        (["--trainer-stage-mib", "0"], "--trainer-stage-mib=0.0: must be a number of MiB > 0"),
        (["--trainer-stages", "0"], "--trainer-stages=0: must be an integer >= 1"),
    ],
)
def test_bad_memory_options_exit_2_naming_the_option(capsys, argv, message):
    code, out, err = run_cli(capsys, "--profile", "synthetic-a100", *argv)
    assert code == 2 and out == "" and message in err, err
