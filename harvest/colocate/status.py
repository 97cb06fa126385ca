"""What a running :class:`~harvest.colocate.colocation.Colocation` reports: its Prometheus
gauges and the snapshot the control endpoint serves (``/harvest/status``, the recorded
steps, the exposition), built on the engine thread at most every ``interval_s``.
Read-only: nothing here changes the system."""

from __future__ import annotations

import dataclasses
import itertools
import math
import time

from harvest.colocate.step_controller import StepRecord
from harvest.colocate.job_control import current_settings

STEP_FIELDS = ("seq", *StepRecord._fields)


class StatusReporter:
    def __init__(self, colocation, interval_s: float = 0.5):
        self.colocation = colocation
        self.interval_s = interval_s
        self._last_publish = -math.inf  # due at once: monotonic() starts near 0 at boot

        # Steps already in a snapshot: each snapshot carries the steps since the one
        # before the previous, so an endpoint that missed one snapshot loses no step.
        self._steps_seq_before_last = 0
        self._steps_seq_last = 0

    def due(self) -> bool:
        """Whether ``interval_s`` has passed since the last snapshot (one clock read: the
        engine asks after every step and idle tick)."""
        return time.monotonic() - self._last_publish >= self.interval_s

    def maybe_publish(self) -> None:
        """The gauges, at most every ``interval_s``: the engine's idle hook runs in a tight loop."""
        if self.due():
            self._last_publish = time.monotonic()
            self.publish()

    def snapshot(self, **extra_status) -> dict:
        """The control endpoint's document: status (with ``extra_status``), the steps
        recorded since the snapshot before the last (rows of ``STEP_FIELDS``) and the
        Prometheus exposition. Counts as a publish of the gauges."""
        self._last_publish = time.monotonic()
        control = self.colocation.step_controller
        status = {**self.status(), **extra_status}  # records the queued steps and publishes the gauges
        newest = control.num_recorded
        since, self._steps_seq_before_last, self._steps_seq_last = self._steps_seq_before_last, self._steps_seq_last, newest
        records = control.recent_steps  # a deque: read newest first, only as far back as needed
        count = min(newest - since, len(records))
        rows = [[newest - i, *record] for i, record in enumerate(itertools.islice(reversed(records), count))]
        rows.reverse()
        metrics = self.colocation.metrics
        return {"published_at": time.time(), "status": status, "steps": {"fields": STEP_FIELDS, "rows": rows},
                "metrics": metrics.exposition().decode() if metrics is not None else ""}

    def publish(self) -> None:
        """The gauges that are not updated per step: the trainer and its jobs, KV chunks,
        predictor, GPU (build info, settings and the first level are set at start-up)."""
        colo = self.colocation
        metrics = colo.metrics
        if metrics is None:
            return
        host = colo.trainer_host
        if host is not None:
            status = host.status()
            stats = status.stats or {}
            metrics.set_trainer(state=status.state, window_layers=stats.get("window_stages", 0),
                                resident_bytes=stats.get("resident_bytes", 0))
            metrics.set_jobs(getattr(status, "jobs", None) or [])  # HostStatus.jobs: one dict per job
        kv = colo.lending.stats()
        if kv:
            lent = colo.lending.num_lent
            # A chunk being lent (waiting for decode's fences) is neither mapped for SGLang nor lent yet.
            mapped = kv["chunks_total"] - lent - kv.get("chunks_lending", 0)
            metrics.set_kv_chunks(mapped=mapped, lent=lent, fragmentation_bytes=kv["fragmentation_bytes"])
        refiner = colo.refiner
        if refiner is not None and refiner.num_observations:  # its error is 0.0, not unknown, before any
            metrics.set_prediction_error(refiner.error, refiner.drift)
        if colo.gpu_sampler is not None:
            sample = colo.gpu_sampler.sample()
            metrics.set_gpu(busy_ratio=sample.busy_ratio, memory_busy_ratio=sample.memory_busy_ratio,
                            memory_used_bytes=sample.memory_used_bytes)

    def status(self) -> dict:
        """The ``/harvest/status`` document (queued step bookkeeping done first)."""
        colo = self.colocation
        control = colo.step_controller
        control.record_steps()
        self.publish()
        host = colo.trainer_host
        config = colo.config
        return {
            "trainer": dataclasses.asdict(host.status()) if host is not None else None,
            "level": {"index": colo.partitioner.current_index, "decode_sms": control.level.decode_sms,
                      "trainer_sms": control.level.trainer_sms, "partitioner": colo.partitioner.description,
                      "ladder": colo.partitioner.ladder.to_dict()},  # what each level index is
            "kv": {**colo.lending.stats(), "integrity_error": colo.integrity_error},
            "qos": {"target_tpot_ms": control.qos.config.target_tpot_ms, **control.qos.stats().to_dict()},
            "tpot_ms": recent_tpot(control.recent_steps),
            "settings": current_settings(colo),
            "queue": {"max_running": host.max_running, "quantum_s": host.fair.quantum_s,
                      "starvation_s": host.fair.starvation_s} if host is not None else None,
            "model_name": getattr(colo, "model_name", None),
            "steps": colo.profiler.num_steps,
            "unmeasured_steps": control.unmeasured_steps,
            **colo.profiler.summary(),
            "prediction_error": colo.refiner.error if colo.refiner is not None else None,
            "prediction_drift": colo.refiner.drift if colo.refiner is not None else None,
            "trainer_cpu_threads": config.trainer.cpu_threads,
            "decode_cpu_threads": colo.decode_cpu_threads,
            "trainer_nice": config.trainer.nice,
            "idle_gc_collections": colo.idle_gc_collections,
            "tensor_parallel": _tensor_parallel(colo),
        }


TPOT_WINDOW_STEPS = 512


def recent_tpot(records) -> dict:
    """Median and 99th percentile of the last ``TPOT_WINDOW_STEPS`` decode steps' measured
    latency (what `harvest top` shows against the target); None without decode steps."""
    measured = sorted(record.measured_ms for record in itertools.islice(reversed(records), TPOT_WINDOW_STEPS)
                      if record.is_decode)
    if not measured:
        return {"p50": None, "p99": None, "window_steps": 0}
    return {"p50": round(_quantile(measured, 0.5), 3), "p99": round(_quantile(measured, 0.99), 3),
            "window_steps": len(measured)}


def _quantile(ordered: list, q: float) -> float:
    """Linear interpolation between closest ranks (numpy's default), on a sorted list."""
    position = q * (len(ordered) - 1)
    low = int(position)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (position - low)


def _tensor_parallel(colo) -> dict | None:
    """The ranks' step agreement (harvest.colocate.rank_sync), as rank 0 last saw it."""
    ranks = colo.ranks
    if ranks is None:
        return None
    agreed = colo.last_agreement
    return {
        "size": ranks.size, "rank": ranks.rank, "exchanges": ranks.exchanges,
        "exchange_ms_mean": round(1e3 * ranks.exchange_s / ranks.exchanges, 3) if ranks.exchanges else None,
        "chunks_taken_by_rank": list(agreed.taken_by_rank) if agreed is not None else None,
        "moves_digest_by_rank": list(agreed.digests_by_rank) if agreed is not None else None,
        "stopped": colo.ranks_stopped_why,
        "trainer_agree_wait_s": round(colo.trainer_tp.waited_s, 3) if colo.trainer_tp is not None else None,
    }
