"""harvest's Prometheus metrics: names, types and the one object that updates them.

Names follow Prometheus conventions: ``harvest_`` prefix, base units (seconds, bytes,
ratios), ``_total`` on counters. The runtime owns one :class:`HarvestMetrics` and pushes
plain numbers into it; nothing here reads harvest state by itself.

Where they are exported (docs/metrics.md): the scheduler process renders this registry
into the control snapshot, and harvest's endpoint process serves it on ``metrics.port``
(``/metrics``; harvest.sglang.control). When SGLang
runs with ``--enable-metrics`` it sets ``PROMETHEUS_MULTIPROC_DIR``; prometheus-client
then stores harvest's values in that directory too, so SGLang's own ``/metrics`` shows
them as well. Gauges use ``multiprocess_mode="mostrecent"`` so that case aggregates to the
latest value rather than a sum over processes.
"""

from __future__ import annotations

from harvest.schedule import TrainerState

# Histogram buckets for decode steps: 1 ms .. 1 s, dense around typical TPOT targets.
STEP_BUCKETS_S = (0.001, 0.002, 0.005, 0.01, 0.015, 0.02, 0.025, 0.03, 0.035, 0.04, 0.05, 0.06, 0.08, 0.1, 0.15, 0.2, 0.5, 1.0)
RECLAIM_BUCKETS_S = (0.0001, 0.0005, 0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.5, 1.0)


class HarvestMetrics:
    """Every harvest metric, registered in its own CollectorRegistry."""

    def __init__(self, registry=None):
        from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

        self.registry = registry if registry is not None else CollectorRegistry()
        r = self.registry

        def gauge(name, doc, labels=()):
            return Gauge(name, doc, labels, registry=r, multiprocess_mode="mostrecent")

        self.decode_step_seconds = Histogram("harvest_decode_step_seconds", "Measured decode step latency.", registry=r, buckets=STEP_BUCKETS_S)
        self.predicted_step_seconds = gauge("harvest_predicted_step_seconds", "Predicted latency of the last decode step at the chosen SM level.")
        self.prediction_error_ratio = gauge("harvest_prediction_error_ratio", "Rolling mean absolute percentage error of the step-latency predictor (0.05 = 5%).")
        self.prediction_drift = gauge("harvest_prediction_drift", "1 when a stage's rolling prediction error exceeds the drift threshold (the profile no longer describes this machine), else 0.")
        self.qos_target_seconds = gauge("harvest_qos_target_seconds", "Per-token latency (TPOT) target of decode steps.")
        self.qos_violations_total = Counter("harvest_qos_violations_total", "Decode steps whose measured latency exceeded the QoS target.", registry=r)
        self.decode_sms = gauge("harvest_sm_level_decode_sms", "SMs given to decode at the current level.")
        self.trainer_sms = gauge("harvest_sm_level_trainer_sms", "SMs given to the trainer at the current level (0: trainer paused).")
        self.partition_changes_total = Counter("harvest_partition_changes_total", "Changes of SM level between consecutive decode steps.", registry=r)
        self.trainer_state = gauge("harvest_trainer_state", "1 for the trainer's current state, 0 for the others.", ("state",))
        self.trainer_tokens_total = Counter("harvest_trainer_tokens_total", "Tokens the trainer has trained on.", registry=r)
        self.trainer_samples_total = Counter("harvest_trainer_samples_total", "Samples the trainer has trained on.", registry=r)
        self.trainer_steps_total = Counter("harvest_trainer_steps_total", "Optimizer steps the trainer has taken.", registry=r)
        self.trainer_loss = gauge("harvest_trainer_loss", "Training loss of the last optimizer step.")
        self.trainer_eval_loss = gauge("harvest_trainer_eval_loss", "Evaluation loss of the job's last evaluation (jobs with val_size or eval_dataset).")
        self.trainer_window_layers = gauge("harvest_trainer_window_layers", "Frozen layers resident in the trainer's device window.")
        self.trainer_resident_bytes = gauge("harvest_trainer_resident_bytes", "Device bytes held by the trainer.")
        self.trainer_faults_total = Counter("harvest_trainer_faults_total", "Trainer faults (exception or OOM) that stopped the trainer.", registry=r)
        self.kv_chunks = gauge("harvest_kv_chunks", "KV chunks by state.", ("state",))
        self.kv_lends_total = Counter("harvest_kv_lends_total", "KV chunks lent to the trainer.", registry=r)
        self.kv_reclaims_total = Counter("harvest_kv_reclaims_total", "KV chunks taken back from the trainer.", registry=r)
        self.kv_reclaim_seconds = Histogram("harvest_kv_reclaim_seconds", "Time to reclaim one KV chunk (window shrink to remap).", registry=r, buckets=RECLAIM_BUCKETS_S)
        self.allocator_fragmentation_bytes = gauge("harvest_allocator_fragmentation_bytes", "Bytes mapped to the trainer's arena but unused inside partly used chunks.")
        self.gpu_sm_utilization_ratio = gauge("harvest_gpu_sm_utilization_ratio", "GPU SM utilisation reported by NVML (0..1).")
        self.gpu_memory_bandwidth_utilization_ratio = gauge("harvest_gpu_memory_bandwidth_utilization_ratio", "GPU memory bandwidth utilisation reported by NVML (0..1).")
        self.gpu_memory_used_bytes = gauge("harvest_gpu_memory_used_bytes", "GPU memory in use reported by NVML.")
        self._last_level: int | None = None
        self._last_split: tuple | None = None
        self._last_counters = {"tokens": 0, "samples": 0, "steps": 0}

    # --- per decode step -------------------------------------------------------------
    def observe_step(self, *, measured_s: float, predicted_s: float | None, target_s: float, level_index: int, decode_sms: int, trainer_sms: int) -> None:
        self.decode_step_seconds.observe(measured_s)
        if predicted_s is not None:
            self.predicted_step_seconds.set(predicted_s)
        if measured_s > target_s:
            self.qos_violations_total.inc()
        # Per-step cost matters (this runs before every decode step): gauges that rarely
        # change are written only when they do.
        split = (target_s, level_index, decode_sms, trainer_sms)
        if split != self._last_split:
            if self._last_level is not None and level_index != self._last_level:
                self.partition_changes_total.inc()
            self._last_level = level_index
            self.qos_target_seconds.set(target_s)
            self.decode_sms.set(decode_sms)
            self.trainer_sms.set(trainer_sms)
            self._last_split = split

    def set_prediction_error(self, mape: float, drift: bool) -> None:
        self.prediction_error_ratio.set(mape)
        self.prediction_drift.set(1.0 if drift else 0.0)

    # --- trainer ---------------------------------------------------------------------
    def set_trainer(self, *, state: TrainerState, tokens: int, samples: int, steps: int, loss: float | None, window_layers: int, resident_bytes: int,
                    eval_loss: float | None = None) -> None:
        """Cumulative counts from the trainer's stats; counters advance by the difference."""
        state = TrainerState(state)  # a plain string must name a state too
        for each in TrainerState:
            self.trainer_state.labels(state=each.value).set(1.0 if each is state else 0.0)
        for key, counter, value in (
            ("tokens", self.trainer_tokens_total, tokens),
            ("samples", self.trainer_samples_total, samples),
            ("steps", self.trainer_steps_total, steps),
        ):
            delta = value - self._last_counters[key]
            if delta > 0:
                counter.inc(delta)
            self._last_counters[key] = max(value, self._last_counters[key])
        if loss is not None:
            self.trainer_loss.set(loss)
        if eval_loss is not None:
            self.trainer_eval_loss.set(eval_loss)
        self.trainer_window_layers.set(window_layers)
        self.trainer_resident_bytes.set(resident_bytes)

    def trainer_fault(self) -> None:
        self.trainer_faults_total.inc()

    # --- memory ----------------------------------------------------------------------
    def set_kv_chunks(self, *, mapped: int, lent: int, fragmentation_bytes: int) -> None:
        self.kv_chunks.labels(state="mapped").set(mapped)
        self.kv_chunks.labels(state="lent").set(lent)
        self.allocator_fragmentation_bytes.set(fragmentation_bytes)

    def lent(self, num_chunks: int = 1) -> None:
        self.kv_lends_total.inc(num_chunks)

    def reclaimed(self, seconds_each: float, num_chunks: int = 1) -> None:
        self.kv_reclaims_total.inc(num_chunks)
        for _ in range(num_chunks):
            self.kv_reclaim_seconds.observe(seconds_each)

    # --- GPU telemetry ---------------------------------------------------------------
    def set_gpu(self, *, sm_utilization: float, memory_bandwidth_utilization: float, memory_used_bytes: int) -> None:
        self.gpu_sm_utilization_ratio.set(sm_utilization)
        self.gpu_memory_bandwidth_utilization_ratio.set(memory_bandwidth_utilization)
        self.gpu_memory_used_bytes.set(memory_used_bytes)

    def exposition(self) -> bytes:
        """The text format for a /metrics response."""
        from prometheus_client import generate_latest

        return generate_latest(self.registry)
