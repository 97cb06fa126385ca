"""harvest's Prometheus metrics: names, types, conventions, and that values move."""

from __future__ import annotations

import pytest
from prometheus_client.parser import text_string_to_metric_families

from harvest.metrics.registry import HarvestMetrics

EXPECTED = {
    "harvest_decode_step_seconds": "histogram",
    "harvest_predicted_step_seconds": "gauge",
    "harvest_prediction_error_ratio": "gauge",
    "harvest_qos_target_seconds": "gauge",
    "harvest_qos_violations": "counter",
    "harvest_sm_level_decode_sms": "gauge",
    "harvest_sm_level_trainer_sms": "gauge",
    "harvest_partition_changes": "counter",
    "harvest_trainer_state": "gauge",
    "harvest_trainer_tokens": "counter",
    "harvest_trainer_samples": "counter",
    "harvest_trainer_steps": "counter",
    "harvest_trainer_loss": "gauge",
    "harvest_trainer_eval_loss": "gauge",
    "harvest_trainer_window_layers": "gauge",
    "harvest_trainer_resident_bytes": "gauge",
    "harvest_trainer_faults": "counter",
    "harvest_kv_chunks": "gauge",
    "harvest_kv_lends": "counter",
    "harvest_kv_reclaims": "counter",
    "harvest_kv_reclaim_seconds": "histogram",
    "harvest_allocator_fragmentation_bytes": "gauge",
    "harvest_gpu_sm_utilization_ratio": "gauge",
    "harvest_gpu_memory_bandwidth_utilization_ratio": "gauge",
    "harvest_gpu_memory_used_bytes": "gauge",
}


def families(metrics: HarvestMetrics) -> dict:
    return {f.name: f for f in text_string_to_metric_families(metrics.exposition().decode())}


def value(metrics: HarvestMetrics, sample_name: str, **labels) -> float:
    for family in families(metrics).values():
        for sample in family.samples:
            if sample.name == sample_name and all(sample.labels.get(k) == v for k, v in labels.items()):
                return sample.value
    raise KeyError(sample_name)


def test_every_metric_is_exported_with_its_type():
    found = families(HarvestMetrics())
    for name, kind in EXPECTED.items():
        assert name in found, name
        assert found[name].type == kind, (name, found[name].type)
    assert all(name.startswith("harvest_") for name in found)


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


def test_trainer_counters_follow_cumulative_stats():
    m = HarvestMetrics()
    m.set_trainer(state="running", tokens=100, samples=4, steps=1, loss=2.5, window_layers=2, resident_bytes=4096)
    m.set_trainer(state="paused", tokens=250, samples=10, steps=2, loss=2.1, window_layers=1, resident_bytes=2048,
                  eval_loss=2.3)
    assert value(m, "harvest_trainer_eval_loss") == pytest.approx(2.3)
    assert value(m, "harvest_trainer_tokens_total") == 250
    assert value(m, "harvest_trainer_steps_total") == 2
    assert value(m, "harvest_trainer_loss") == pytest.approx(2.1)
    assert value(m, "harvest_trainer_state", state="paused") == 1
    assert value(m, "harvest_trainer_state", state="running") == 0
    with pytest.raises(ValueError, match="'dancing' is not a valid TrainerState"):
        m.set_trainer(state="dancing", tokens=0, samples=0, steps=0, loss=None, window_layers=0, resident_bytes=0)


def test_memory_metrics():
    m = HarvestMetrics()
    m.set_kv_chunks(mapped=10, lent=6, fragmentation_bytes=1 << 20)
    m.lent(6)
    m.reclaimed(0.002, num_chunks=2)
    assert value(m, "harvest_kv_chunks", state="lent") == 6
    assert value(m, "harvest_kv_lends_total") == 6 and value(m, "harvest_kv_reclaims_total") == 2
    assert value(m, "harvest_kv_reclaim_seconds_count") == 2
    assert value(m, "harvest_allocator_fragmentation_bytes") == 1 << 20


def test_trainer_state_gauge_has_one_label_per_trainer_state():
    from harvest.schedule import TrainerState

    m = HarvestMetrics()
    m.set_trainer(state=TrainerState.FINISHED, tokens=0, samples=0, steps=0, loss=None, window_layers=0, resident_bytes=0)
    assert {state.value: value(m, "harvest_trainer_state", state=state.value) for state in TrainerState} == {
        state.value: float(state is TrainerState.FINISHED) for state in TrainerState}
