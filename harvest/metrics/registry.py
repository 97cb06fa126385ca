"""harvest's Prometheus metrics: names, types and the one object that updates them.

Names follow Prometheus conventions (``harvest_`` prefix, base units, ``_total`` on
counters). The runtime owns one :class:`HarvestMetrics` and pushes plain numbers into it;
nothing here reads harvest state by itself. Invariants: no misleading zeros (a gauge is
absent until written, and an unknown value removes its series; counters and histograms
start at 0); counters only grow (per-job running totals advance them by their increase);
constant labels are added once, at :meth:`HarvestMetrics.exposition`, by a wrapping
collector. With ``PROMETHEUS_MULTIPROC_DIR`` set, values reach SGLang's /metrics too.

Which series appear when, and how they are exported: docs/metrics.md.
"""

from __future__ import annotations

import math
import re
import threading
from collections.abc import Iterable, Mapping

from harvest.schedule import TrainerState

# Histogram buckets for decode steps: 1 ms .. 1 s, dense around typical TPOT targets.
STEP_BUCKETS_S = (0.001, 0.002, 0.005, 0.01, 0.015, 0.02, 0.025, 0.03, 0.035, 0.04, 0.05, 0.06, 0.08, 0.1, 0.15, 0.2, 0.5, 1.0)
RECLAIM_BUCKETS_S = (0.0001, 0.0005, 0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.5, 1.0)

# A finetune job's states, as harvest.colocate.trainer_host reports them per job.
JOB_STATES = ("queued", "building", "running", "paused", "starved", "finished", "stopped", "cancelled", "failed")
ENDED_JOB_STATES = ("finished", "stopped", "cancelled", "failed")  # the job trains no more (nor syncs, in a fleet)
BUILD_INFO_LABELS = ("version", "sglang_version", "torch_version", "device")
# Label names harvest's own series use; a constant label must not reuse one.
OWN_LABEL_NAMES = frozenset({"state", "job_name", "le", "quantile", *BUILD_INFO_LABELS})
# Prometheus attaches these to every scraped series (the target's); a sample carrying one
# is renamed exported_<name>, which would break the dashboard's filters.
SCRAPE_LABEL_NAMES = frozenset({"job", "instance"})
_LABEL_NAME = re.compile(r"[a-zA-Z_][a-zA-Z0-9_]*\Z")

# Per-instance running totals of a job's dict -> the counter they advance.
_JOB_COUNTERS = (("tokens_trained", "trainer_tokens_total"), ("samples_trained", "trainer_samples_total"),
                 ("steps_trained", "trainer_steps_total"), ("trainer_s", "job_trainer_seconds_total"))
# A job's dict -> the gauge it sets (absent while the value is None).
_JOB_GAUGES = (("progress", "job_progress_ratio"), ("eta_s", "job_eta_seconds"), ("weight", "job_weight"),
               ("deficit_s", "job_fair_share_deficit_seconds"), ("loss", "trainer_loss"), ("eval_loss", "trainer_eval_loss"))
# A fleet job's ``fleet`` dict (harvest.fleet.member.FleetMember.stats: this process's
# member, new with each job instance, so per-instance running totals too) -> its counters
# and gauges. Only jobs whose dict has a ``fleet`` section have these series.
_FLEET_COUNTERS = (("tokens_contributed", "fleet_tokens_contributed_total"), ("rounds", "fleet_rounds_total"),
                   ("rounds_failed", "fleet_rounds_failed_total"))
_FLEET_GAUGES = (("members", "fleet_members"), ("round", "fleet_round"), ("staleness_s", "fleet_staleness_seconds"),
                 ("committed_steps", "fleet_committed_steps"))


class _GaugeWhenSet:
    """An unlabelled gauge that joins the registry with its first value, so it is absent
    (not 0) from every exposition until then, SGLang's multiprocess files included."""

    def __init__(self, registry, name: str, documentation: str, lock: threading.Lock):
        self._args = (name, documentation)
        self._registry = registry
        self._lock = lock
        self._gauge = None

    def set(self, value: float) -> None:
        gauge = self._gauge
        if gauge is None:
            from prometheus_client import Gauge

            with self._lock:  # first writes may come from two threads (engine, trainer callbacks)
                if self._gauge is None:
                    self._gauge = Gauge(*self._args, registry=self._registry, multiprocess_mode="mostrecent")
                gauge = self._gauge
        gauge.set(value)

    @property
    def is_set(self) -> bool:
        return self._gauge is not None


class _WithConstantLabels:
    """A collector: every sample of ``registry`` with ``labels`` added."""

    def __init__(self, registry, labels: Mapping[str, str]):
        self._registry = registry
        self._labels = dict(labels)

    def collect(self):
        for family in self._registry.collect():  # fresh Metric objects on every collect
            family.samples = [s._replace(labels={**s.labels, **self._labels}) for s in family.samples]
            yield family


def checked_constant_labels(labels: Mapping[str, str] | None) -> dict[str, str]:
    """``labels`` if every name is a usable constant label, else ValueError naming it."""
    checked = {}
    for name, value in (labels or {}).items():
        what = f"constant metric label {name!r}"
        if not isinstance(name, str) or not _LABEL_NAME.match(name):
            raise ValueError(f"{what}: not a Prometheus label name (letters, digits and '_', not starting with a digit)")
        if name.startswith("__"):
            raise ValueError(f"{what}: names starting with '__' are reserved for Prometheus's internal use")
        if name in SCRAPE_LABEL_NAMES:
            raise ValueError(f"{what}: Prometheus sets '{name}' itself at scrape time (it would be renamed "
                             f"'exported_{name}'); choose another name")
        if name in OWN_LABEL_NAMES:
            raise ValueError(f"{what}: harvest's own series use that label name ({', '.join(sorted(OWN_LABEL_NAMES))}); "
                             "choose another name")
        if not isinstance(value, str):
            raise ValueError(f"{what}: the value must be a string, got {value!r}")
        checked[name] = value
    return checked


def _fleet_of(job: Mapping) -> Mapping | None:
    """A fleet job's ``fleet`` section, or None (a job trained alone)."""
    fleet = job.get("fleet")
    return fleet if isinstance(fleet, Mapping) else None


def _known(value) -> float | None:
    """``value`` as a float, or None when it is missing or not a finite number."""
    if value is None or isinstance(value, bool):
        return None
    value = float(value)
    return value if math.isfinite(value) else None


class HarvestMetrics:
    """Every harvest metric, registered in its own CollectorRegistry."""

    def __init__(self, registry=None, *, constant_labels: Mapping[str, str] | None = None):
        from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

        self.constant_labels = checked_constant_labels(constant_labels)
        self.registry = registry if registry is not None else CollectorRegistry()
        r = self.registry
        lock = threading.Lock()

        def gauge(name, doc, labels=None):
            if labels is None:
                return _GaugeWhenSet(r, name, doc, lock)
            return Gauge(name, doc, labels, registry=r, multiprocess_mode="mostrecent")

        def counter(name, doc, labels=()):
            return Counter(name, doc, labels, registry=r)

        self.build_info = gauge("harvest_build_info", "1, labelled with harvest's version, SGLang's, torch's and the device type.", BUILD_INFO_LABELS)
        self.decode_step_seconds = Histogram("harvest_decode_step_seconds", "Measured decode step latency.", registry=r, buckets=STEP_BUCKETS_S)
        self.predicted_step_seconds = gauge("harvest_predicted_step_seconds", "Predicted latency of the last decode step at the chosen SM level.")
        self.prediction_error_ratio = gauge("harvest_prediction_error_ratio", "Rolling mean absolute percentage error of the step-latency predictor (0.05 = 5%).")
        self.prediction_drift = gauge("harvest_prediction_drift", "1 when a stage's rolling prediction error exceeds the drift threshold (the profile no longer describes this machine), else 0.")
        self.qos_target_seconds = gauge("harvest_qos_target_seconds", "Per-token latency (TPOT) target of decode steps.")
        self.kv_max_lend_fraction = gauge("harvest_kv_max_lend_fraction", "Largest share of the KV pool harvest may lend to the trainer (memory.max_lend_fraction).")
        self.qos_violations_total = counter("harvest_qos_violations_total", "Decode steps whose measured latency exceeded the QoS target.")
        self.decode_sms = gauge("harvest_sm_level_decode_sms", "SMs given to decode at the current level.")
        self.trainer_sms = gauge("harvest_sm_level_trainer_sms", "SMs given to the trainer at the current level (0: trainer paused).")
        self.partition_changes_total = counter("harvest_partition_changes_total", "Changes of SM level between consecutive decode steps.")
        self.trainer_state = gauge("harvest_trainer_state", "1 for the trainer host's current state, 0 for the others.", ("state",))
        self.trainer_tokens_total = counter("harvest_trainer_tokens_total", "Tokens the job has trained on in this process.", ("job_name",))
        self.trainer_samples_total = counter("harvest_trainer_samples_total", "Samples the job has trained on in this process.", ("job_name",))
        self.trainer_steps_total = counter("harvest_trainer_steps_total", "Optimizer steps the job has taken in this process.", ("job_name",))
        self.job_trainer_seconds_total = counter("harvest_job_trainer_seconds_total", "Trainer time charged to the job (its units' wall time).", ("job_name",))
        self.trainer_loss = gauge("harvest_trainer_loss", "Training loss of the job's last optimizer step.", ("job_name",))
        self.trainer_eval_loss = gauge("harvest_trainer_eval_loss", "Evaluation loss of the job's last evaluation (jobs with val_size or eval_dataset).", ("job_name",))
        self.job_progress_ratio = gauge("harvest_job_progress_ratio", "The job's global step over its total steps (0..1).", ("job_name",))
        self.job_eta_seconds = gauge("harvest_job_eta_seconds", "Estimated seconds until the job's last step, at its pace in this process.", ("job_name",))
        self.job_weight = gauge("harvest_job_weight", "The job's weight in the fair share of trainer time.", ("job_name",))
        self.job_fair_share_deficit_seconds = gauge("harvest_job_fair_share_deficit_seconds", "Trainer seconds the job is owed under the fair share (negative: ahead).", ("job_name",))
        self.job_state = gauge("harvest_job_state", "1 for the job's current state, 0 for the others.", ("job_name", "state"))
        self.fleet_tokens_contributed_total = counter("harvest_fleet_tokens_contributed_total", "Tokens this server trained that its fleet rounds averaged into the fleet job's weights.", ("job_name",))
        self.fleet_rounds_total = counter("harvest_fleet_rounds_total", "Fleet rounds (periodic: averagings; every_step: gradient all-reduces) this server completed for the job.", ("job_name",))
        self.fleet_rounds_failed_total = counter("harvest_fleet_rounds_failed_total", "Fleet rounds of the job that failed on this server (a member died in the collective, the store was unreachable).", ("job_name",))
        self.fleet_members = gauge("harvest_fleet_members", "Members (servers) in the fleet job's last round this server took part in.", ("job_name",))
        self.fleet_round = gauge("harvest_fleet_round", "The fleet job's completed rounds, as of the last round this server took part in.", ("job_name",))
        self.fleet_staleness_seconds = gauge("harvest_fleet_staleness_seconds", "Seconds since this server's last completed fleet round of the job (its weights' distance from the fleet's).", ("job_name",))
        self.fleet_committed_steps = gauge("harvest_fleet_committed_steps", "Global steps of the fleet job in the fleet's weights, as of this server's last look.", ("job_name",))
        self.trainer_window_layers = gauge("harvest_trainer_window_layers", "Frozen layers resident in the trainer's device window.")
        self.trainer_resident_bytes = gauge("harvest_trainer_resident_bytes", "Device bytes held by the trainer.")
        self.trainer_faults_total = counter("harvest_trainer_faults_total", "Trainer faults (exception or OOM) that stopped a job.")
        self.kv_chunks = gauge("harvest_kv_chunks", "KV chunks by state.", ("state",))
        self.kv_lends_total = counter("harvest_kv_lends_total", "KV chunks lent to the trainer.")
        self.kv_reclaims_total = counter("harvest_kv_reclaims_total", "KV chunks taken back from the trainer.")
        self.kv_reclaim_seconds = Histogram("harvest_kv_reclaim_seconds", "Time to reclaim one KV chunk (window shrink to remap).", registry=r, buckets=RECLAIM_BUCKETS_S)
        self.kv_urgent_reclaims_total = counter("harvest_kv_urgent_reclaims_total", "Times serving waited for lent KV memory: an allocation, a decode capacity check or an admission found too few free slots and lent chunks had to come back first.")
        self.kv_urgent_reclaim_seconds = Histogram("harvest_kv_urgent_reclaim_seconds", "How long the scheduler thread waited for lent KV memory, per urgent reclaim.", registry=r, buckets=RECLAIM_BUCKETS_S)
        self.kv_admissions_held_total = counter("harvest_kv_admissions_held_total", "Times lent KV memory held back SGLang's admission of queued requests that would have fitted with it (each also an urgent reclaim).")
        self.kv_reserve_tokens = gauge("harvest_kv_reserve_tokens", "Free KV slots kept mapped for decode (the lending reserve).")
        self.allocator_fragmentation_bytes = gauge("harvest_allocator_fragmentation_bytes", "Bytes mapped to the trainer's arena but unused inside partly used chunks.")
        self.gpu_busy_ratio = gauge("harvest_gpu_busy_ratio", "NVML utilization.gpu: share of the last sample period in which any kernel ran on the GPU (0..1). Not SM occupancy.")
        self.gpu_memory_busy_ratio = gauge("harvest_gpu_memory_busy_ratio", "NVML utilization.memory: share of the last sample period in which device memory was read or written (0..1).")
        self.gpu_memory_used_bytes = gauge("harvest_gpu_memory_used_bytes", "Device memory in use on the GPU (NVML), every process's.")
        self._exposed = _WithConstantLabels(r, self.constant_labels) if self.constant_labels else r
        self._build_labels: tuple | None = None
        self._last_level: int | None = None
        self._last_split: tuple | None = None
        self._job_totals: dict[tuple, dict[str, float]] = {}  # per job instance: last running total per counter
        self._job_series: set[tuple[str, tuple[str, ...]]] = set()  # (metric attribute, label values) present

    # --- start-up and settings -------------------------------------------------------
    def set_build_info(self, *, version: str, sglang_version: str, torch_version: str, device: str) -> None:
        """``harvest_build_info{...} 1``: the one series the dashboard lists servers by."""
        labels = (version, sglang_version, torch_version, device)
        if self._build_labels not in (None, labels):  # one series, ever (removal warns in multiprocess mode)
            self.build_info.remove(*self._build_labels)
        self.build_info.labels(*labels).set(1.0)
        self._build_labels = labels

    def set_settings(self, *, target_tpot_s: float, max_lend_fraction: float | None) -> None:
        """The run-time settings, at start-up and when an operator changes one
        (``max_lend_fraction`` None: this server lends no KV memory; the gauge stays absent)."""
        self.qos_target_seconds.set(target_tpot_s)
        if max_lend_fraction is not None:
            self.kv_max_lend_fraction.set(max_lend_fraction)

    def set_level(self, *, decode_sms: int, trainer_sms: int) -> None:
        """The SM split in force before the first decode step (decode steps update it)."""
        self.decode_sms.set(decode_sms)
        self.trainer_sms.set(trainer_sms)
        self._last_split = None  # the next step writes its own split

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
            self.qos_target_seconds.set(target_s)  # the target this step was judged against
            self.decode_sms.set(decode_sms)
            self.trainer_sms.set(trainer_sms)
            self._last_split = split

    def set_prediction_error(self, mape: float, drift: bool) -> None:
        """Call once the predictor has measurements: before that its error means nothing."""
        self.prediction_error_ratio.set(mape)
        self.prediction_drift.set(1.0 if drift else 0.0)

    # --- trainer ---------------------------------------------------------------------
    def set_trainer(self, *, state: TrainerState, window_layers: int, resident_bytes: int) -> None:
        """The trainer host as a whole: its state and the memory the job holding it uses."""
        state = TrainerState(state)  # a plain string must name a state too
        for each in TrainerState:
            self.trainer_state.labels(state=each.value).set(1.0 if each is state else 0.0)
        self.trainer_window_layers.set(window_layers)
        self.trainer_resident_bytes.set(resident_bytes)

    def set_jobs(self, jobs: Iterable[Mapping]) -> None:
        """Every job the trainer host lists (harvest.colocate.job_status.job_line()).

        Counters advance by the increase of each job instance's running totals
        (``tokens_trained``, ``samples_trained``, ``steps_trained``, ``trainer_s``, and a
        fleet job's ``fleet`` ``tokens_contributed``, ``rounds``, ``rounds_failed``: 0 when
        the instance starts in this process); a total below the last one is read as a
        restart from 0, as Prometheus reads a counter reset. Gauges show the listed
        instance of each name with the highest ``instance``. A name no longer listed
        loses all its series, counters included (they restart from 0 if it comes back)."""
        listed = []
        for job in jobs:
            instance, state = job.get("instance"), job.get("state")
            name = job.get("name") or (f"job-{instance}" if instance is not None else None)
            if name is None:
                continue  # nothing to label it with
            if state is not None and state not in JOB_STATES:
                raise ValueError(f"job {name!r}: state {state!r} is not one of {', '.join(JOB_STATES)}")
            listed.append((str(name), instance, job))
        latest: dict[str, tuple[int, Mapping]] = {}
        live_keys = set()
        for name, instance, job in listed:
            key = ("instance", instance) if instance is not None else ("name", name)
            live_keys.add(key)
            totals = self._job_totals.setdefault(key, {})
            fleet = _fleet_of(job)
            running = [(source, attribute, job.get(source)) for source, attribute in _JOB_COUNTERS]
            if fleet is not None:
                running += [("fleet." + source, attribute, fleet.get(source)) for source, attribute in _FLEET_COUNTERS]
            for source, attribute, raw in running:
                counter = getattr(self, attribute).labels(job_name=name)  # present at 0 from the job's first report
                self._job_series.add((attribute, (name,)))
                value = _known(raw)
                if value is None:
                    continue
                last = totals.get(source, 0.0)
                increase = value - last if value >= last else value
                if increase > 0:
                    counter.inc(increase)
                totals[source] = value
            rank = instance if instance is not None else -1
            if name not in latest or rank >= latest[name][0]:
                latest[name] = (rank, job)
        for key in self._job_totals.keys() - live_keys:
            del self._job_totals[key]
        for name, (_, job) in latest.items():
            for source, attribute in _JOB_GAUGES:
                self._put(attribute, (name,), _known(job.get(source)))
            state = job.get("state")
            for each in JOB_STATES:
                self._put("job_state", (name, each), None if state is None else float(each == state))
            fleet = _fleet_of(job)
            # Absent until the member has joined the fleet (periodic: its first round), and
            # for a job that is not a fleet job; staleness also once the job has ended.
            joined = fleet is not None and bool(fleet.get("joined"))
            for source, attribute in _FLEET_GAUGES:
                known = joined and not (source == "staleness_s" and state in ENDED_JOB_STATES)
                self._put(attribute, (name,), _known(fleet.get(source)) if known else None)
        for attribute, labels in [series for series in self._job_series if series[1][0] not in latest]:
            self._put(attribute, labels, None)

    def _put(self, attribute: str, labels: tuple[str, ...], value: float | None) -> None:
        """Set a per-job series, or remove it when ``value`` is None."""
        metric = getattr(self, attribute)
        if value is not None:
            metric.labels(*labels).set(value)
            self._job_series.add((attribute, labels))
        elif (attribute, labels) in self._job_series:  # removal only on a change: it warns in multiprocess mode
            self._job_series.discard((attribute, labels))
            metric.remove(*labels)

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

    def urgent_reclaim(self, seconds: float) -> None:
        self.kv_urgent_reclaims_total.inc()
        self.kv_urgent_reclaim_seconds.observe(seconds)

    def admission_held(self) -> None:
        self.kv_admissions_held_total.inc()

    def set_reserve(self, tokens: int) -> None:
        self.kv_reserve_tokens.set(tokens)

    # --- GPU telemetry ---------------------------------------------------------------
    def set_gpu(self, *, busy_ratio: float, memory_busy_ratio: float, memory_used_bytes: int) -> None:
        """One NVML sample (harvest.metrics.gpu_telemetry.GpuSample's fields)."""
        self.gpu_busy_ratio.set(busy_ratio)
        self.gpu_memory_busy_ratio.set(memory_busy_ratio)
        self.gpu_memory_used_bytes.set(memory_used_bytes)

    def exposition(self) -> bytes:
        """The text format for a /metrics response, every sample with the constant labels."""
        from prometheus_client import generate_latest

        return generate_latest(self._exposed)
