"""A HarvestMetrics with every series written once (the full exposition the dashboard and
promtool tests read), and the parse helpers the metrics tests share."""

from __future__ import annotations

from prometheus_client.parser import text_string_to_metric_families

from harvest.metrics.registry import HarvestMetrics


def job(instance=1, name="alpaca", **fields) -> dict:
    """One job's dict as the trainer host reports it (harvest.colocate.job_status.job_line())."""
    return {"instance": instance, "name": name, "state": "running", "weight": 1.0, "global_step": 3, "total_steps": 10,
            "progress": 0.3, "eta_s": 12.0, "loss": 2.0, "eval_loss": 2.2, "tokens_trained": 0, "samples_trained": 0,
            "steps_trained": 0, "trainer_s": 0.0, "deficit_s": 0.25, **fields}


def fleet(**fields) -> dict:
    """A fleet job's ``fleet`` section (harvest.fleet.member.FleetMember.stats()), joined,
    after 12 rounds with 3 members."""
    return {"member_id": "gpu1-4242-a1b2c3", "job_id": "alpaca", "sync": "periodic", "joined": True, "rank": 0,
            "rounds": 12, "rounds_failed": 0, "rounds_missed": 0, "round": 12, "members": 3, "tokens_contributed": 4096,
            "last_round_at": 1_700_000_000.0, "last_round_tokens": 1024, "steps_requeued": 0, "hosted_store": True,
            "staleness_s": 4.0, "committed_steps": 36, "unsynced_steps": 2, "total_steps": 100, **fields}


def populated(**kwargs) -> HarvestMetrics:
    m = HarvestMetrics(**kwargs)
    m.set_build_info(version="0.1.0", sglang_version="0.5.23", torch_version="2.13.0", device="cpu")
    m.set_settings(target_tpot_s=0.040, max_lend_fraction=0.8)
    m.set_level(decode_sms=132, trainer_sms=0)
    m.observe_step(measured_s=0.030, predicted_s=0.028, target_s=0.040, level_index=2, decode_sms=64, trainer_sms=68)
    m.set_prediction_error(0.05, False)
    m.set_trainer(state="running", window_layers=2, resident_bytes=4096)
    m.set_jobs([job(tokens_trained=100, samples_trained=4, steps_trained=1, trainer_s=0.5, fleet=fleet(rounds_failed=1))])
    m.trainer_fault()
    m.set_kv_chunks(mapped=10, lent=6, fragmentation_bytes=1 << 20)
    m.lent(6)
    m.reclaimed(0.002)
    m.urgent_reclaim(0.012)
    m.admission_held()
    m.set_reserve(4096)
    m.set_gpu(busy_ratio=0.5, memory_busy_ratio=0.25, memory_used_bytes=1 << 30)
    return m


def families(metrics: HarvestMetrics) -> dict:
    return {f.name: f for f in text_string_to_metric_families(metrics.exposition().decode())}


def samples(metrics: HarvestMetrics) -> list:
    return [s for f in text_string_to_metric_families(metrics.exposition().decode()) for s in f.samples]


def value(metrics: HarvestMetrics, sample_name: str, **labels) -> float:
    """The value of the one sample named ``sample_name`` whose labels include ``labels``."""
    found = [s.value for s in samples(metrics) if s.name == sample_name and all(s.labels.get(k) == v for k, v in labels.items())]
    if len(found) != 1:
        raise KeyError(f"{sample_name}{labels}: {len(found)} samples")
    return found[0]


def has(metrics: HarvestMetrics, sample_name: str, **labels) -> bool:
    return any(s.name == sample_name and all(s.labels.get(k) == v for k, v in labels.items()) for s in samples(metrics))
