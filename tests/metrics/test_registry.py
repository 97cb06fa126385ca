"""harvest's Prometheus metrics: names, types, conventions, and that values move.

Invariants: counters only grow (across job instances and resumes), a gauge without a
value is absent (never 0 or NaN), every sample carries the constant labels, and the full
exposition passes ``promtool check metrics``."""

from __future__ import annotations

import os
import random
import shutil
import subprocess
import sys
import types
from pathlib import Path

import pytest

from harvest.metrics.gpu_telemetry import GpuSample, NvmlSampler
from harvest.metrics.registry import JOB_STATES, OWN_LABEL_NAMES, HarvestMetrics
from harvest.schedule import TrainerState
from tests.metrics.populated import families, fleet, has, job, populated, samples, value

EXPECTED = {
    "harvest_build_info": "gauge",
    "harvest_decode_step_seconds": "histogram",
    "harvest_predicted_step_seconds": "gauge",
    "harvest_prediction_error_ratio": "gauge",
    "harvest_prediction_drift": "gauge",
    "harvest_qos_target_seconds": "gauge",
    "harvest_kv_max_lend_fraction": "gauge",
    "harvest_qos_violations": "counter",
    "harvest_sm_level_decode_sms": "gauge",
    "harvest_sm_level_trainer_sms": "gauge",
    "harvest_partition_changes": "counter",
    "harvest_trainer_state": "gauge",
    "harvest_trainer_tokens": "counter",
    "harvest_trainer_samples": "counter",
    "harvest_trainer_steps": "counter",
    "harvest_job_trainer_seconds": "counter",
    "harvest_trainer_loss": "gauge",
    "harvest_trainer_eval_loss": "gauge",
    "harvest_job_progress_ratio": "gauge",
    "harvest_job_eta_seconds": "gauge",
    "harvest_job_weight": "gauge",
    "harvest_job_fair_share_deficit_seconds": "gauge",
    "harvest_job_state": "gauge",
    "harvest_fleet_tokens_contributed": "counter",
    "harvest_fleet_rounds": "counter",
    "harvest_fleet_rounds_failed": "counter",
    "harvest_fleet_members": "gauge",
    "harvest_fleet_round": "gauge",
    "harvest_fleet_staleness_seconds": "gauge",
    "harvest_fleet_committed_steps": "gauge",
    "harvest_trainer_window_layers": "gauge",
    "harvest_trainer_resident_bytes": "gauge",
    "harvest_trainer_faults": "counter",
    "harvest_kv_chunks": "gauge",
    "harvest_kv_lends": "counter",
    "harvest_kv_reclaims": "counter",
    "harvest_kv_reclaim_seconds": "histogram",
    "harvest_kv_urgent_reclaims": "counter",
    "harvest_kv_urgent_reclaim_seconds": "histogram",
    "harvest_kv_admissions_held": "counter",
    "harvest_kv_reserve_tokens": "gauge",
    "harvest_allocator_fragmentation_bytes": "gauge",
    "harvest_gpu_busy_ratio": "gauge",
    "harvest_gpu_memory_busy_ratio": "gauge",
    "harvest_gpu_memory_used_bytes": "gauge",
}
PER_JOB = ("harvest_trainer_tokens_total", "harvest_trainer_samples_total", "harvest_trainer_steps_total",
           "harvest_job_trainer_seconds_total", "harvest_trainer_loss", "harvest_trainer_eval_loss",
           "harvest_job_progress_ratio", "harvest_job_eta_seconds", "harvest_job_weight",
           "harvest_job_fair_share_deficit_seconds", "harvest_job_state")
FLEET_COUNTERS = ("harvest_fleet_tokens_contributed_total", "harvest_fleet_rounds_total",
                  "harvest_fleet_rounds_failed_total")
FLEET_GAUGES = ("harvest_fleet_members", "harvest_fleet_round", "harvest_fleet_staleness_seconds",
                "harvest_fleet_committed_steps")
PER_FLEET_JOB = FLEET_COUNTERS + FLEET_GAUGES


def test_every_metric_is_exported_with_its_type():
    found = {name: f for name, f in families(populated()).items() if not name.endswith("_created")}  # prometheus-client's own
    assert {name: found[name].type for name in found} == EXPECTED
    assert all(found[name].samples for name in found), [name for name in found if not found[name].samples]


def test_a_fresh_registry_exports_counters_and_histograms_only():
    found = families(HarvestMetrics())
    with_samples = {name: f.type for name, f in found.items() if f.samples and not name.endswith("_created")}
    assert with_samples == {name: kind for name, kind in EXPECTED.items()
                            if kind == "histogram" or (kind == "counter" and name not in
                                                       ("harvest_trainer_tokens", "harvest_trainer_samples",
                                                        "harvest_trainer_steps", "harvest_job_trainer_seconds",
                                                        "harvest_fleet_tokens_contributed", "harvest_fleet_rounds",
                                                        "harvest_fleet_rounds_failed"))}
    assert all(s.value == 0 for s in samples(HarvestMetrics()) if not s.name.endswith("_created"))


def test_step_observations_move_latency_violations_and_level_changes():
    m = HarvestMetrics()
    m.observe_step(measured_s=0.030, predicted_s=0.028, target_s=0.040, level_index=2, decode_sms=64, trainer_sms=68)
    m.observe_step(measured_s=0.045, predicted_s=0.036, target_s=0.040, level_index=2, decode_sms=64, trainer_sms=68)
    m.observe_step(measured_s=0.020, predicted_s=None, target_s=0.040, level_index=0, decode_sms=132, trainer_sms=0)
    assert value(m, "harvest_decode_step_seconds_count") == 3
    assert value(m, "harvest_decode_step_seconds_sum") == pytest.approx(0.095)
    assert value(m, "harvest_qos_violations_total") == 1
    assert value(m, "harvest_partition_changes_total") == 1
    assert value(m, "harvest_predicted_step_seconds") == pytest.approx(0.036)  # None keeps the last
    assert value(m, "harvest_sm_level_decode_sms") == 132 and value(m, "harvest_sm_level_trainer_sms") == 0


def test_settings_and_level_are_there_before_the_first_step():
    m = HarvestMetrics()
    assert not has(m, "harvest_qos_target_seconds") and not has(m, "harvest_sm_level_decode_sms")
    m.set_settings(target_tpot_s=0.040, max_lend_fraction=0.8)
    m.set_level(decode_sms=132, trainer_sms=0)
    assert value(m, "harvest_qos_target_seconds") == pytest.approx(0.040)
    assert value(m, "harvest_kv_max_lend_fraction") == pytest.approx(0.8)
    assert value(m, "harvest_sm_level_decode_sms") == 132 and value(m, "harvest_sm_level_trainer_sms") == 0
    assert not has(m, "harvest_predicted_step_seconds") and not has(m, "harvest_prediction_error_ratio")
    m.observe_step(measured_s=0.030, predicted_s=None, target_s=0.040, level_index=2, decode_sms=64, trainer_sms=68)
    assert value(m, "harvest_sm_level_trainer_sms") == 68 and not has(m, "harvest_predicted_step_seconds")
    m.set_level(decode_sms=132, trainer_sms=0)  # then the next step writes its split again
    m.observe_step(measured_s=0.030, predicted_s=0.03, target_s=0.040, level_index=2, decode_sms=64, trainer_sms=68)
    assert value(m, "harvest_sm_level_trainer_sms") == 68
    m.set_settings(target_tpot_s=0.050, max_lend_fraction=None)  # an operator's change; no lending here
    assert value(m, "harvest_qos_target_seconds") == pytest.approx(0.050)
    assert value(m, "harvest_kv_max_lend_fraction") == pytest.approx(0.8)
    no_lending = HarvestMetrics()
    no_lending.set_settings(target_tpot_s=0.040, max_lend_fraction=None)
    assert has(no_lending, "harvest_qos_target_seconds") and not has(no_lending, "harvest_kv_max_lend_fraction")


def test_trainer_state_and_memory():
    m = HarvestMetrics()
    assert not has(m, "harvest_trainer_state") and not has(m, "harvest_trainer_window_layers")
    m.set_trainer(state="paused", window_layers=1, resident_bytes=2048)
    assert {state.value: value(m, "harvest_trainer_state", state=state.value) for state in TrainerState} == {
        state.value: float(state is TrainerState.PAUSED) for state in TrainerState}
    assert value(m, "harvest_trainer_window_layers") == 1 and value(m, "harvest_trainer_resident_bytes") == 2048
    with pytest.raises(ValueError, match="'dancing' is not a valid TrainerState"):
        m.set_trainer(state="dancing", window_layers=0, resident_bytes=0)


def test_job_counters_only_grow_across_instances_and_a_resume():
    m = HarvestMetrics()
    tokens = lambda: value(m, "harvest_trainer_tokens_total", job_name="a")  # noqa: E731
    m.set_jobs([job(1, "a", state="building")])
    assert tokens() == 0  # present at 0 from the first report: rate() sees the first increase
    m.set_jobs([job(1, "a", tokens_trained=100, samples_trained=4, steps_trained=1, trainer_s=0.5)])
    m.set_jobs([job(1, "a", tokens_trained=250, samples_trained=10, steps_trained=2, trainer_s=1.25)])
    assert (tokens(), value(m, "harvest_trainer_steps_total", job_name="a")) == (250, 2)
    assert value(m, "harvest_job_trainer_seconds_total", job_name="a") == pytest.approx(1.25)
    # The job stops; the operator resumes it: a new instance, from its checkpoint at
    # tokens_seen 10 000, with nothing trained in this run yet. The counter must not jump.
    ended = job(1, "a", state="stopped", tokens_trained=250, samples_trained=10, steps_trained=2, trainer_s=1.25)
    resumed = job(2, "a", state="building", tokens_seen=10_000, global_step=400)
    m.set_jobs([ended, resumed])
    assert tokens() == 250 and value(m, "harvest_trainer_steps_total", job_name="a") == 2
    m.set_jobs([ended, {**resumed, "state": "running", "tokens_trained": 40, "steps_trained": 1}])
    assert tokens() == 290 and value(m, "harvest_trainer_steps_total", job_name="a") == 3
    m.set_jobs([{**resumed, "state": "running", "tokens_trained": 60}])  # the old instance leaves the list
    assert tokens() == 310
    # A second job has its own series.
    m.set_jobs([{**resumed, "tokens_trained": 60}, job(3, "b", tokens_trained=7)])
    assert tokens() == 310 and value(m, "harvest_trainer_tokens_total", job_name="b") == 7


def test_job_counters_equal_the_sum_of_every_instances_work():
    rng = random.Random(0)
    m = HarvestMetrics()
    totals: dict[int, int] = {}
    seen = []
    for instance in range(1, 6):
        totals[instance] = 0
        for _ in range(rng.randrange(1, 6)):
            totals[instance] += rng.randrange(0, 50)
            m.set_jobs([job(i, "a", tokens_trained=t, tokens_seen=1000 * i + t) for i, t in totals.items()])
            seen.append(value(m, "harvest_trainer_tokens_total", job_name="a"))
    assert seen == sorted(seen) and seen[-1] == sum(totals.values())


def test_a_total_that_drops_is_read_as_a_restart_from_zero():
    m = HarvestMetrics()
    m.set_jobs([job(instance=None, name="a", tokens_trained=100)])  # no instance: known by its name
    m.set_jobs([job(instance=None, name="a", tokens_trained=30)])
    assert value(m, "harvest_trainer_tokens_total", job_name="a") == 130


def test_job_gauges_are_absent_until_they_have_a_value():
    m = HarvestMetrics()
    m.set_jobs([job(1, "a", state="queued", progress=0.0, eta_s=None, loss=None, eval_loss=None, deficit_s=None)])
    assert not has(m, "harvest_trainer_loss") and not has(m, "harvest_trainer_eval_loss")
    assert not has(m, "harvest_job_eta_seconds") and not has(m, "harvest_job_fair_share_deficit_seconds")
    assert value(m, "harvest_job_progress_ratio", job_name="a") == 0 and value(m, "harvest_job_weight", job_name="a") == 1
    m.set_jobs([job(1, "a", loss=2.5, eval_loss=float("nan"), eta_s=30.0)])  # NaN is no value either
    assert value(m, "harvest_trainer_loss", job_name="a") == 2.5 and not has(m, "harvest_trainer_eval_loss")
    assert value(m, "harvest_job_eta_seconds", job_name="a") == 30
    m.set_jobs([job(1, "a", state="finished", eta_s=None, progress=1.0)])  # ended: no ETA; loss kept
    assert not has(m, "harvest_job_eta_seconds") and value(m, "harvest_trainer_loss", job_name="a") == 2.0


def test_job_state_is_one_hot_and_an_unknown_state_changes_nothing():
    m = HarvestMetrics()
    m.set_jobs([job(1, "a", state="starved")])
    assert {state: value(m, "harvest_job_state", job_name="a", state=state) for state in JOB_STATES} == {
        state: float(state == "starved") for state in JOB_STATES}
    before = m.exposition()
    with pytest.raises(ValueError, match="job 'b': state 'dancing' is not one of queued, building"):
        m.set_jobs([job(1, "a", tokens_trained=5), job(2, "b", state="dancing")])
    assert m.exposition() == before


def test_gauges_show_the_latest_instance_of_a_name():
    m = HarvestMetrics()
    m.set_jobs([job(2, "a", state="running", loss=1.5), job(1, "a", state="failed", loss=9.0)])
    assert value(m, "harvest_trainer_loss", job_name="a") == 1.5
    assert value(m, "harvest_job_state", job_name="a", state="running") == 1


def test_a_job_no_longer_listed_loses_its_series_and_the_others_keep_theirs():
    m = HarvestMetrics()
    m.set_jobs([job(1, "a", tokens_trained=10), job(2, "b", tokens_trained=20)])
    m.set_jobs([job(2, "b", tokens_trained=25)])
    labels = {s.labels.get("job_name") for s in samples(m) if s.name in PER_JOB}
    assert labels == {"b"}
    assert {s.name for s in samples(m) if s.labels.get("job_name") == "b" and not s.name.endswith("_created")} == set(PER_JOB)
    assert value(m, "harvest_trainer_tokens_total", job_name="b") == 25
    m.set_jobs([])
    assert not [s for s in samples(m) if s.name in PER_JOB]
    m.set_jobs([job(3, "a", tokens_trained=4)])  # back under the same name: a new counter (a reset to Prometheus)
    assert value(m, "harvest_trainer_tokens_total", job_name="a") == 4


def test_a_fleet_job_exports_its_fleet_view():
    m = HarvestMetrics()
    m.set_jobs([job(1, "shared", tokens_trained=300, fleet=fleet(tokens_contributed=250, rounds=12, rounds_failed=1,
                                                                  round=15, members=3, staleness_s=4.5,
                                                                  committed_steps=36)),
                job(2, "solo", tokens_trained=40)])
    assert value(m, "harvest_fleet_members", job_name="shared") == 3
    assert value(m, "harvest_fleet_round", job_name="shared") == 15  # the fleet's count, not this member's 12
    assert value(m, "harvest_fleet_staleness_seconds", job_name="shared") == 4.5
    assert value(m, "harvest_fleet_committed_steps", job_name="shared") == 36
    assert value(m, "harvest_fleet_tokens_contributed_total", job_name="shared") == 250
    assert value(m, "harvest_fleet_rounds_total", job_name="shared") == 12
    assert value(m, "harvest_fleet_rounds_failed_total", job_name="shared") == 1
    assert value(m, "harvest_trainer_tokens_total", job_name="shared") == 300  # trained here, synced or not
    # A job trained alone has none of them (not zeros).
    assert not [s for s in samples(m) if s.name.startswith("harvest_fleet_") and s.labels.get("job_name") == "solo"]


def test_fleet_gauges_are_absent_until_the_member_joins_and_staleness_once_the_job_ends():
    m = HarvestMetrics()
    joining = fleet(joined=False, rounds=0, round=0, members=0, staleness_s=None, committed_steps=0,
                    tokens_contributed=0)
    m.set_jobs([job(1, "shared", fleet=joining)])
    assert not any(has(m, name, job_name="shared") for name in FLEET_GAUGES)
    # Counters are there at 0 from the first report with a fleet section: rate() sees the first increase.
    assert [value(m, name, job_name="shared") for name in FLEET_COUNTERS] == [0, 0, 0]
    m.set_jobs([job(1, "shared", fleet=fleet(rounds=1, round=7, members=2, staleness_s=0.5, committed_steps=20))])
    assert [value(m, name, job_name="shared") for name in FLEET_GAUGES] == [2, 7, 0.5, 20]
    m.set_jobs([job(1, "shared", state="running", fleet=fleet(staleness_s=float("nan")))])  # unknown: no series
    assert not has(m, "harvest_fleet_staleness_seconds") and has(m, "harvest_fleet_round")
    m.set_jobs([job(1, "shared", state="finished", fleet=fleet(staleness_s=80.0))])  # it no longer syncs
    assert not has(m, "harvest_fleet_staleness_seconds")
    assert value(m, "harvest_fleet_round", job_name="shared") == 12 and has(m, "harvest_fleet_members")


def test_fleet_counters_only_grow_across_instances_and_a_restarted_member():
    m = HarvestMetrics()
    contributed = lambda: value(m, "harvest_fleet_tokens_contributed_total", job_name="shared")  # noqa: E731
    failed = lambda: value(m, "harvest_fleet_rounds_failed_total", job_name="shared")  # noqa: E731
    m.set_jobs([job(1, "shared", fleet=fleet(tokens_contributed=100, rounds=2, rounds_failed=0))])
    m.set_jobs([job(1, "shared", fleet=fleet(tokens_contributed=400, rounds=5, rounds_failed=1))])
    assert (contributed(), failed(), value(m, "harvest_fleet_rounds_total", job_name="shared")) == (400, 1, 5)
    # Stopped and resumed: a new instance, a new member counting from 0; the counters go on.
    ended = job(1, "shared", state="stopped", fleet=fleet(tokens_contributed=400, rounds=5, rounds_failed=1))
    resumed = job(2, "shared", state="building", fleet=None)  # building: no trainer, no fleet view yet
    m.set_jobs([ended, resumed])
    assert (contributed(), failed()) == (400, 1)
    assert not has(m, "harvest_fleet_round")  # the gauges show the latest instance: not joined yet
    m.set_jobs([ended, {**resumed, "state": "running", "fleet": fleet(tokens_contributed=60, rounds=1, rounds_failed=2)}])
    assert (contributed(), failed()) == (460, 3)
    m.set_jobs([{**resumed, "fleet": fleet(tokens_contributed=90, rounds=2, rounds_failed=2)}])  # the old one leaves
    assert (contributed(), failed()) == (490, 3)
    # A member's total that drops (a member rebuilt within the instance) is read as a restart from 0.
    m.set_jobs([{**resumed, "fleet": fleet(tokens_contributed=30, rounds=1, rounds_failed=0)}])
    assert (contributed(), failed()) == (520, 3)


def test_fleet_counters_equal_the_sum_of_every_members_contribution():
    rng = random.Random(1)
    m = HarvestMetrics()
    totals: dict[int, int] = {}
    seen = []
    for instance in range(1, 5):
        totals[instance] = 0
        for _ in range(rng.randrange(1, 6)):
            totals[instance] += rng.randrange(0, 500)
            m.set_jobs([job(i, "shared", fleet=fleet(tokens_contributed=t)) for i, t in totals.items()])
            seen.append(value(m, "harvest_fleet_tokens_contributed_total", job_name="shared"))
    assert seen == sorted(seen) and seen[-1] == sum(totals.values())


def test_a_fleet_job_no_longer_listed_loses_its_fleet_series():
    m = HarvestMetrics()
    m.set_jobs([job(1, "shared", fleet=fleet()), job(2, "other", fleet=fleet(job_id="other"))])
    assert {s.labels["job_name"] for s in samples(m) if s.name in PER_FLEET_JOB} == {"shared", "other"}
    m.set_jobs([job(2, "other", fleet=fleet(job_id="other"))])
    assert {(s.name, s.labels["job_name"]) for s in samples(m) if s.name in PER_FLEET_JOB} == {
        (name, "other") for name in PER_FLEET_JOB}
    m.set_jobs([job(3, "other", fleet=None)])  # its latest instance trains alone: no fleet gauges
    assert {s.name for s in samples(m) if s.name in PER_FLEET_JOB} == set(FLEET_COUNTERS)
    m.set_jobs([])
    assert not [s for s in samples(m) if s.name.startswith("harvest_fleet_")]
    m.set_jobs([job(4, "shared", fleet=fleet(tokens_contributed=7))])  # back: a new counter (a reset)
    assert value(m, "harvest_fleet_tokens_contributed_total", job_name="shared") == 7


def test_constant_labels_are_on_every_sample():
    constant = {"model_name": "tiny-llama", "cluster": "eu-1"}
    everything = samples(populated(constant_labels=constant))
    assert everything and all(s.labels.items() >= constant.items() for s in everything)
    plain = samples(populated())
    assert not [s for s in plain if "model_name" in s.labels]
    # The same samples otherwise.
    assert sorted((s.name, tuple(sorted((k, v) for k, v in s.labels.items() if k not in constant))) for s in everything) == \
        sorted((s.name, tuple(sorted(s.labels.items()))) for s in plain)


@pytest.mark.parametrize("labels, message", [
    ({"1zone": "a"}, r"constant metric label '1zone': not a Prometheus label name"),
    ({"zone-a": "a"}, r"constant metric label 'zone-a': not a Prometheus label name"),
    ({"__zone": "a"}, r"'__zone': names starting with '__' are reserved"),
    ({"job": "a"}, r"'job': Prometheus sets 'job' itself at scrape time"),
    ({"instance": "a"}, r"'instance': Prometheus sets 'instance' itself"),
    ({"state": "a"}, r"'state': harvest's own series use that label name"),
    ({"job_name": "a"}, r"'job_name': harvest's own series use that label name"),
    ({"le": "a"}, r"'le': harvest's own series use that label name"),
    ({"zone": 3}, r"'zone': the value must be a string, got 3"),
])
def test_bad_constant_labels_are_refused_naming_the_label(labels, message):
    with pytest.raises(ValueError, match=message):
        HarvestMetrics(constant_labels=labels)


def test_own_label_names_cover_every_label_harvest_uses():
    used = {name for s in samples(populated()) for name in s.labels}
    assert used <= OWN_LABEL_NAMES


def test_build_info_is_one_series_of_value_one():
    m = HarvestMetrics()
    assert not has(m, "harvest_build_info")
    m.set_build_info(version="0.1.0", sglang_version="0.5.23", torch_version="2.13.0", device="cpu")
    m.set_build_info(version="0.1.0", sglang_version="0.5.23", torch_version="2.13.0", device="cuda:0")
    info = [s for s in samples(m) if s.name == "harvest_build_info"]
    assert [(s.labels, s.value) for s in info] == [
        ({"version": "0.1.0", "sglang_version": "0.5.23", "torch_version": "2.13.0", "device": "cuda:0"}, 1.0)]


def test_gpu_telemetry_names_say_what_nvml_measures():
    m = HarvestMetrics()
    assert not [s for s in samples(m) if s.name.startswith("harvest_gpu_")]  # absent before the first sample
    rates = types.SimpleNamespace(gpu=75, memory=20)
    nvml = types.SimpleNamespace(nvmlDeviceGetUtilizationRates=lambda handle: rates,
                                 nvmlDeviceGetMemoryInfo=lambda handle: types.SimpleNamespace(used=3 << 30))
    sample = NvmlSampler(nvml, handle=object()).sample()
    assert sample == GpuSample(busy_ratio=0.75, memory_busy_ratio=0.2, memory_used_bytes=3 << 30)
    m.set_gpu(busy_ratio=sample.busy_ratio, memory_busy_ratio=sample.memory_busy_ratio, memory_used_bytes=sample.memory_used_bytes)
    assert value(m, "harvest_gpu_busy_ratio") == 0.75 and value(m, "harvest_gpu_memory_busy_ratio") == 0.2
    assert value(m, "harvest_gpu_memory_used_bytes") == 3 << 30
    assert not [s for s in samples(m) if "sm_utilization" in s.name or "bandwidth" in s.name]
    assert "Not SM occupancy" in families(m)["harvest_gpu_busy_ratio"].documentation


def test_memory_metrics():
    m = HarvestMetrics()
    m.set_kv_chunks(mapped=10, lent=6, fragmentation_bytes=1 << 20)
    m.lent(6)
    m.reclaimed(0.002, num_chunks=2)
    assert value(m, "harvest_kv_chunks", state="lent") == 6
    assert value(m, "harvest_kv_lends_total") == 6 and value(m, "harvest_kv_reclaims_total") == 2
    assert value(m, "harvest_kv_reclaim_seconds_count") == 2
    assert value(m, "harvest_allocator_fragmentation_bytes") == 1 << 20
    m.urgent_reclaim(0.012)
    m.admission_held()
    m.set_reserve(4096)
    assert value(m, "harvest_kv_urgent_reclaims_total") == 1 and value(m, "harvest_kv_urgent_reclaim_seconds_count") == 1
    assert value(m, "harvest_kv_admissions_held_total") == 1
    assert value(m, "harvest_kv_reserve_tokens") == 4096


@pytest.mark.skipif(shutil.which("promtool") is None, reason="promtool (Prometheus's tool; apt install prometheus) is not on PATH")
def test_promtool_finds_nothing_to_say_about_the_full_exposition():
    text = populated(constant_labels={"model_name": "tiny-llama", "cluster": "eu-1"}).exposition()
    result = subprocess.run(["promtool", "check", "metrics"], input=text, capture_output=True, timeout=60)
    assert (result.returncode, result.stdout, result.stderr) == (0, b"", b"")


MULTIPROCESS_SCRIPT = """
import warnings
warnings.simplefilter("error")  # removal or clearing in multiprocess mode warns: none may happen here
from prometheus_client import CollectorRegistry, generate_latest, multiprocess
from harvest.metrics.registry import HarvestMetrics
from tests.metrics.populated import job
m = HarvestMetrics(constant_labels={"model_name": "tiny"})
for _ in range(2):
    m.set_build_info(version="0.1.0", sglang_version="0.5.23", torch_version="2.13.0", device="cpu")
    m.set_settings(target_tpot_s=0.04, max_lend_fraction=0.8)
    m.set_jobs([job(1, "a", loss=None, eta_s=None, tokens_trained=5)])
registry = CollectorRegistry()
multiprocess.MultiProcessCollector(registry)
print(generate_latest(registry).decode())
"""


def test_absent_gauges_stay_absent_in_sglang_multiprocess_metrics(tmp_path):
    # SGLang's /metrics (with --enable-metrics) reads prometheus-client's multiprocess
    # files, written by the scheduler process; a gauge never written has no file entry.
    root = Path(__file__).resolve().parents[2]
    env = {**os.environ, "PROMETHEUS_MULTIPROC_DIR": str(tmp_path), "PYTHONPATH": str(root)}
    result = subprocess.run([sys.executable, "-c", MULTIPROCESS_SCRIPT], env=env, capture_output=True, text=True,
                            timeout=60, cwd=root)
    assert result.returncode == 0, result.stderr
    text = result.stdout
    assert 'harvest_qos_target_seconds 0.04' in text and 'harvest_trainer_tokens_total{job_name="a"} 5.0' in text
    for absent in ("harvest_predicted_step_seconds", "harvest_sm_level_decode_sms", "harvest_gpu_busy_ratio",
                   "harvest_trainer_loss", "harvest_job_eta_seconds"):
        assert absent not in text, absent
