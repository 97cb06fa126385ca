"""`harvest replay --servers N`: the routers' rules against brute force, a fleet of one
against the single-server replay, conservation of requests and finetune work, balance
on a skewed workload, and the command end to end."""

from __future__ import annotations

import collections
import itertools
import json
import math
import random
from fractions import Fraction

import pytest

from harvest.cli import main
from harvest.replay import comparison, fleet, profile_source, router, synthetic, trainer_model, workload
from harvest.replay.fleet import FleetSettings
from harvest.replay.results import jsonable
from harvest.replay.router import LEAST_LOADED, ROUND_ROBIN, DecodeLoadModel
from harvest.replay.simulator import DecodeLimits
from harvest.replay.trace import SAMPLE_TRACE, TraceRequest, read_trace

from tests.replay.helpers import make_profile, requests, settings


@pytest.fixture(scope="module")
def a100():
    return profile_source.from_profile(synthetic.harli_a100_llama3_8b(), "synthetic-a100")


@pytest.fixture(scope="module")
def sample():
    return read_trace(SAMPLE_TRACE)


@pytest.fixture(scope="module")
def profile_path(tmp_path_factory):
    path = tmp_path_factory.mktemp("profiles") / "a100.json"
    synthetic.harli_a100_llama3_8b().save(path)
    return path


# -- routers ------------------------------------------------------------------------------


def brute_force_least_loaded(reqs, num_servers, model):
    """The rule as stated, in exact arithmetic: each request to the server whose running
    requests (a <= t < a + d·ℓ) add the least Σ (b0 + k0·(c + (t − a)/ℓ)) to a decode
    step; ties to the lowest index."""
    step, per_request, per_token = (Fraction(v) for v in (model.step_s, model.per_request_s, model.per_token_s))
    assigned: list[list[TraceRequest]] = [[] for _ in range(num_servers)]
    out = []
    for request in reqs:
        t = Fraction(request.arrival_s)
        load = [
            sum(
                per_request + per_token * (r.context_tokens + (t - Fraction(r.arrival_s)) / step)
                for r in rs
                if t < Fraction(r.arrival_s) + router.decode_steps(r) * step
            )
            for rs in assigned
        ]
        server = min(range(num_servers), key=lambda s: (load[s], s))
        assigned[server].append(request)
        out.append(server)
    return out


COUNT = DecodeLoadModel(1.0, 1.0, 0.0)  # 1 s steps; the load is the number of running requests
CONTEXT = DecodeLoadModel(1.0, 0.0, 1.0)  # 1 s steps; the load is the context they hold


def test_round_robin_is_i_mod_n():
    for num_servers in range(1, 6):
        for num_requests in range(13):
            assert router.round_robin(num_requests, num_servers).tolist() == [i % num_servers for i in range(num_requests)]


def test_least_loaded_by_hand():
    # Counting: r0 (10 steps) -> 0; r1 (2) -> 1; at t=1 one each: r2 -> 0 (lowest); at t=3
    # r1 is done: r3 -> 1; at t=9 server 0 still runs r0, server 1 nothing: r4 -> 1; at t=20
    # every server is idle: the lowest, 0.
    reqs = requests((0, 100, 11), (0, 100, 3), (1, 100, 5), (3, 100, 3), (9, 100, 2), (20, 100, 2))
    assert router.least_loaded(reqs, 2, COUNT).tolist() == [0, 1, 0, 1, 1, 0]
    assert router.assign(ROUND_ROBIN, reqs, 2, COUNT).tolist() == [0, 1, 0, 1, 0, 1]
    # Context held: at t=5 server 0 holds 100 + 5 tokens, server 1 10 + 5: r2 -> 1, though
    # server 1 has more tokens left to decode (45 against 5); at t=6, 106 against 16 + 201.
    reqs = requests((0, 100, 11), (0, 10, 51), (5, 200, 101), (6, 10, 2))
    assert router.least_loaded(reqs, 2, CONTEXT).tolist() == [0, 1, 1, 0]
    # a request that never decodes adds no load: both go to the idle server 0
    assert router.least_loaded(requests((0, 100, 1), (0, 100, 5)), 2, COUNT).tolist() == [0, 0]


def test_least_loaded_matches_brute_force_exhaustively():
    # every nondecreasing arrival pattern of 4 requests over 3 instants × every size among
    # 0, 1, 3 decode steps, on 1 to 3 servers; dyadic numbers keep the float sums exact
    models = (DecodeLoadModel(0.5, 1.0, 0.0), DecodeLoadModel(0.5, 0.25, 0.125))
    for arrivals in itertools.combinations_with_replacement((0.0, 0.5, 1.5), 4):
        for steps in itertools.product((0, 1, 3), repeat=4):
            reqs = [TraceRequest(a, 2 + s, s + 1) for a, s in zip(arrivals, steps)]
            for num_servers, model in itertools.product((1, 2, 3), models):
                expected = brute_force_least_loaded(reqs, num_servers, model)
                assert router.least_loaded(reqs, num_servers, model).tolist() == expected, (arrivals, steps, num_servers, model)


def test_least_loaded_matches_brute_force_on_random_traces():
    rng = random.Random(7)
    for _ in range(200):
        t = 0.0
        reqs = []
        for _ in range(rng.randint(1, 40)):
            t += rng.choice((0.0, 0.25, 0.5, 2.0))
            reqs.append(TraceRequest(t, rng.choice((1, 8, 100, 1000)), rng.choice((1, 2, 5, 9, 33))))
        num_servers = rng.randint(1, 6)
        model = DecodeLoadModel(0.25, rng.choice((0.0, 0.5, 2.0)), rng.choice((0.0, 1 / 64, 1.0)) or 1 / 1024)
        assert router.least_loaded(reqs, num_servers, model).tolist() == brute_force_least_loaded(reqs, num_servers, model)


def test_load_model_refuses_what_sees_nothing():
    for bad in ((0.0, 1.0, 0.0), (math.nan, 1.0, 0.0), (1.0, -1.0, 0.0), (1.0, 0.0, math.inf), (1.0, 0.0, 0.0)):
        with pytest.raises(ValueError, match="least-loaded router"):
            DecodeLoadModel(*bad)
    flat = make_profile(solo=(0.0, 0.010, 0.0))  # a step that ignores its batch: count the requests
    assert router.load_model(requests((0, 10, 5)), 2, flat, DecodeLimits(8, 1000)) == DecodeLoadModel(0.010, 1.0, 0.0)


def test_split_partitions_the_requests_in_arrival_order():
    reqs = [TraceRequest(float(i), 10 + i, 5) for i in range(11)]
    assignment = router.assign(ROUND_ROBIN, reqs, 3, 1.0)
    shares = router.split(reqs, assignment, 3)
    assert shares == [reqs[0::3], reqs[1::3], reqs[2::3]]
    assert router.split(reqs[:2], router.assign(ROUND_ROBIN, reqs[:2], 4, 1.0), 4)[3] == []


def test_estimated_step_is_littles_law_fixed_point():
    # step = 1 ms per request + 10 ms; 1001 requests, one every 20 ms over 20 s, 10 decode
    # steps each: 500.5 steps/s. b = 500.5 × (0.010 + 0.001 b) -> b = 10.02: a 20 ms step;
    # on 2 servers b = 3.34: 13 ms; a tenth of the rate: under 1 request, a lone one's 11 ms
    profile = make_profile(solo=(0.001, 0.010, 0.0))
    reqs = [TraceRequest(0.02 * i, 100, 11) for i in range(1001)]
    limits = DecodeLimits(256, 10**9)
    assert router.estimated_step_s(reqs, 1, profile, limits) == pytest.approx(0.020)
    assert router.estimated_step_s(reqs, 2, profile, limits) == pytest.approx(0.013)
    assert router.estimated_step_s(reqs, 20, profile, limits) == pytest.approx(0.011)
    # past what the limits admit, that batch's step: 8 requests (--max-batch-size), or 5 of
    # 111 reserved tokens each (--kv-capacity-tokens 555)
    assert router.estimated_step_s(reqs, 1, profile, DecodeLimits(8, 10**9)) == pytest.approx(0.018)
    assert router.estimated_step_s(reqs, 1, profile, DecodeLimits(256, 5 * 111)) == pytest.approx(0.015)


# -- the fleet ----------------------------------------------------------------------------


def comparable(metrics: dict) -> dict:
    return jsonable(metrics)  # NaN -> None, so equal metrics compare equal


@pytest.mark.parametrize("error_noise, seed", [(0.0, 0), (0.05, 3)])
def test_fleet_of_one_is_the_single_server_replay(a100, sample, error_noise, seed):
    replay_settings = settings(max_batch=256, kv=160_000, error_noise=error_noise)
    trainer = trainer_model.build(a100)
    single = comparison.run(sample, a100, trainer, replay_settings, seed)
    one = fleet.run(sample, a100, trainer, replay_settings, FleetSettings(1), seed)
    assert one.horizon_s == single.horizon_s
    for routed in one.routers.values():
        assert routed.requests_per_server == [len(sample)]
        for name, result in routed.results.items():
            alone = single.results[name]
            assert comparable(result.server_metrics[0]) == comparable(alone.metrics), name
            m = result.metrics
            assert m["finetune_gpu_equivalents"] == alone.metrics["finetune_gpu_equivalents"]
            assert m["finetune_per_gpu"] == alone.metrics["finetune_per_gpu"]
            assert m["tpot_p99_worst_ms"] == alone.metrics["tpot_p99_ms"]
            assert m["step_violation_rate"] == pytest.approx(alone.metrics["step_violation_rate"], rel=1e-12)
            assert m["violation_rate"] == pytest.approx(alone.metrics["violation_rate"], rel=1e-12)
            assert result.gain_vs == alone.gain_vs


def test_fleet_conserves_requests_and_finetune_work(a100, sample):
    scaled = workload.prepare(sample, workload.TraceWindow(rate_scale=3.0, resample_sizes=True), seed=1)
    replay_settings = settings(max_batch=256, kv=160_000)
    trainer = trainer_model.build(a100)
    three = fleet.run(scaled, a100, trainer, replay_settings, FleetSettings(3), seed=1)
    model = router.load_model(scaled, 3, a100, replay_settings.limits)
    assert three.load_model == model
    for name, routed in three.routers.items():
        shares = router.split(scaled, router.assign(name, scaled, 3, model), 3)
        assert collections.Counter(r for share in shares for r in share) == collections.Counter(scaled)  # each once
        assert routed.requests_per_server == [len(share) for share in shares]
        for result in routed.results.values():
            per_server = result.server_metrics
            served = sum(m["requests_finished"] + m["requests_dropped"] + m["requests_prefill_only"] for m in per_server)
            assert served == len(scaled) == result.metrics["requests_finished"] + result.metrics["requests_prefill_only"]
            total = math.fsum(m["finetune_gpu_equivalents"] for m in per_server)
            assert result.metrics["finetune_gpu_equivalents"] == pytest.approx(total, rel=1e-12)
            assert result.metrics["decode_steps"] == sum(m["decode_steps"] for m in per_server)
            assert result.num_gpus == 3 * (2 if result.name == "separate" else 1)
            assert result.metrics["finetune_per_gpu"] == pytest.approx(total / result.num_gpus)
            assert all(m["end_s"] <= three.horizon_s for m in per_server)


def test_least_loaded_balances_a_skewed_workload_better_than_round_robin():
    # long-context (4000 tokens) and short-context (100) requests alternate, 100 tokens out
    # each: round-robin puts every long context on server 0, which falls behind; least-
    # loaded sends each to the server holding less context
    profile = make_profile(solo=(0.0005, 0.010, 1e-6))
    reqs = [TraceRequest(0.2 * i, 4000 if i % 2 == 0 else 100, 101) for i in range(400)]
    replay_settings = settings(max_batch=256, kv=10**7, policies=("decode-only",))
    two = fleet.run(reqs, profile, trainer_model.build(profile), replay_settings, FleetSettings(2), seed=0)
    held = {name: [m["kv_held_mean_tokens"] for m in routed.results["decode-only"].server_metrics] for name, routed in two.routers.items()}
    p99 = {name: routed.results["decode-only"].metrics["tpot_p99_worst_ms"] for name, routed in two.routers.items()}
    assert max(held[ROUND_ROBIN]) / min(held[ROUND_ROBIN]) > 100
    assert max(held[LEAST_LOADED]) / min(held[LEAST_LOADED]) < 1.1
    assert p99[LEAST_LOADED] < p99[ROUND_ROBIN] / 5
    assert two.routers[LEAST_LOADED].results["decode-only"].metrics["servers_violating"] == 0
    assert two.routers[ROUND_ROBIN].results["decode-only"].metrics["servers_violating"] == 1


def test_rate_scale_copies_give_round_robin_every_request_on_every_server(sample):
    """Why --rate-scale-sizes resample: copies arrive back to back, one per server."""
    copied = workload.prepare(sample, workload.TraceWindow(rate_scale=4.0), seed=0)
    resampled = workload.prepare(sample, workload.TraceWindow(rate_scale=4.0, resample_sizes=True), seed=0)
    sizes = collections.Counter((r.context_tokens, r.generated_tokens) for r in sample)
    for share in router.split(copied, router.round_robin(len(copied), 4), 4):
        assert collections.Counter((r.context_tokens, r.generated_tokens) for r in share) == sizes
    assert len(resampled) == len(copied) and {(r.context_tokens, r.generated_tokens) for r in resampled} <= set(sizes)
    shares = router.split(resampled, router.round_robin(len(resampled), 4), 4)
    assert any(collections.Counter((r.context_tokens, r.generated_tokens) for r in share) != sizes for share in shares)
    assert workload.prepare(sample, workload.TraceWindow(rate_scale=0.5, resample_sizes=True), seed=0) == workload.prepare(
        sample, workload.TraceWindow(rate_scale=0.5), seed=0
    )  # thinning adds no copies


def test_resampled_sizes_come_from_requests_within_the_resample_window():
    # request i arrives at 2i s with context i + 1: a copy's context says where it was drawn
    window = [TraceRequest(2.0 * i, i + 1, 5) for i in range(300)]
    scaled = workload.prepare(window, workload.TraceWindow(rate_scale=3.0, resample_sizes=True), seed=2)
    assert len(scaled) == 900 and all(b.arrival_s >= a.arrival_s for a, b in zip(scaled, scaled[1:]))
    sources = [2.0 * (r.context_tokens - 1) for r in scaled]
    gap = 2.0  # a copy arrives in its request's gap: at most one gap after it
    assert all(abs(t - r.arrival_s) <= workload.RESAMPLE_WINDOW_S + gap for t, r in zip(sources, scaled))
    assert len(set(sources)) > 250 and sum(t != math.floor(r.arrival_s / 2) * 2 for t, r in zip(sources, scaled)) > 500


# -- the command --------------------------------------------------------------------------


def last_json(capsys) -> dict:
    return json.loads(capsys.readouterr().out.strip().splitlines()[-1])


def test_cli_four_servers_json_on_the_sample(profile_path, capsys):
    code = main(["replay", "--trace", str(SAMPLE_TRACE), "--profile", str(profile_path), "--no-plots", "--no-progress",
                 "--json", "--servers", "4", "--rate-scale", "4", "--rate-scale-sizes", "resample"])
    assert code == 0
    data = last_json(capsys)
    assert "runs" not in data and data["settings"]["policies"] == ["harvest", "separate", "static", "decode-only"]
    run = data["fleet"]["runs"][0]
    assert data["fleet"]["num_servers"] == run["num_servers"] == 4 and data["fleet"]["routers"] == [ROUND_ROBIN, LEAST_LOADED]
    assert "x1 the trace window's request rate" in data["fleet"]["load"]
    for routed in run["routers"].values():
        assert sum(routed["requests_per_server"]) == run["num_requests"] == 1200
        harvest = routed["policies"]["harvest"]
        assert harvest["num_gpus"] == 4 and len(harvest["per_server"]["finetune_gpu_equivalents"]) == 4
        assert harvest["metrics"]["finetune_gpu_equivalents"] == pytest.approx(sum(harvest["per_server"]["finetune_gpu_equivalents"]))
        assert 0 <= harvest["metrics"]["servers_violating"] <= 4
        assert routed["policies"]["separate"]["num_gpus"] == 8


def test_cli_text_report_and_plot(profile_path, tmp_path, capsys):
    code = main(["replay", "--trace", str(SAMPLE_TRACE), "--profile", str(profile_path), "--no-progress", "--out-dir", str(tmp_path),
                 "--servers", "3", "--router", "least-loaded", "--policies", "harvest,static"])
    text = capsys.readouterr().out
    assert code == 0
    assert "a fleet of 3 decode servers" in text and "least-loaded: requests per server" in text and "round-robin:" not in text
    assert (tmp_path / "fleet.png").read_bytes().startswith(b"\x89PNG") and not (tmp_path / "sm_split.png").exists()
    assert json.loads((tmp_path / "replay.json").read_text())["fleet"]["routers"] == [LEAST_LOADED]


def test_cli_one_server_is_the_single_server_output(profile_path, capsys):
    base = ["replay", "--trace", str(SAMPLE_TRACE), "--profile", str(profile_path), "--no-plots", "--no-progress", "--json",
            "--max-requests", "60"]
    outputs = []
    for extra in ([], ["--servers", "1"], ["--servers", "1", "--router", "least-loaded"]):
        assert main(base + extra) == 0
        data = last_json(capsys)
        for run in data["runs"]:
            run.pop("wall_s")
        outputs.append(data)
    assert outputs[0] == outputs[1] == outputs[2] and "fleet" not in outputs[0]


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--servers", "0"], "--servers=0: must be an integer >= 1"),
        (["--servers", "-3"], "--servers=-3: must be an integer >= 1"),
        (["--servers", "2", "--router", "random"], "--router 'random': choose distinct ones of round-robin, least-loaded"),
        (["--servers", "2", "--router", "least-loaded,least-loaded"], "choose distinct ones"),
        (["--router", "fifo"], "--router 'fifo'"),
    ],
)
def test_bad_fleet_options_exit_2_naming_the_option(profile_path, capsys, argv, message):
    code = main(["replay", "--trace", str(SAMPLE_TRACE), "--profile", str(profile_path), "--no-plots", *argv])
    captured = capsys.readouterr()
    assert code == 2 and captured.out == ""
    assert captured.err.startswith("harvest replay: ") and message in captured.err
