"""harvest inside one SGLang scheduler process: composition, the step hook, control.

Created by the ``Scheduler.__init__`` hook when harvest is enabled (``HARVEST_ENABLED``).
It composes the engine-agnostic pieces (harvest.colocate) with SGLang's objects:

- the KV pool, already on harvest's allocator (harvest.sglang.kv_backing), and a
  :class:`~harvest.sglang.kv_lending.KvLendingController` on SGLang's token allocator;
- the SM partitioner (green contexts, or the whole-device fallback), the profile's latency
  predictor with online refinement, the QoS controller, the trainer thread;
- metrics and the control endpoint on ``metrics.port``.

Every decode step goes through :meth:`run_step`; the loop reads like the spec::

    decision = control.before_step(observe(batch, decode_modes))
    with decode stream: result = run_batch(batch)
    control.after_step(measured); lending.after_step()

(The step's KV slots were allocated before, when SGLang prepared the batch; the hooks on
the token allocator's ``check_decode_capacity`` and ``alloc`` take lent chunks back there.)

Anything wrong at start-up raises (SGLang then refuses to start); a trainer fault later
only stops the trainer: it gets no SMs and all lent memory comes back.
"""

from __future__ import annotations

import atexit
import collections
import dataclasses
import gc
import math
import statistics
import threading
import time

from harvest import config_env
from harvest.colocate import StepLoad
from harvest.logs import get_logger

logger = get_logger(__name__)


def forward_mode_sets():
    """(modes run_step passes straight through, decode modes), by SGLang's own predicates,
    evaluated once: per step a set lookup instead of two or three method calls."""
    from sglang.srt.model_executor.forward_batch_info import ForwardMode

    passthrough = frozenset(mode for mode in ForwardMode if mode.is_idle() or mode.is_prebuilt())
    decode = frozenset(mode for mode in ForwardMode if mode.is_decode())
    return passthrough, decode


def observe(batch, decode_modes) -> StepLoad:
    """The StepLoad of an SGLang ScheduleBatch (``len(reqs)`` is ``batch_size()``)."""
    return StepLoad(len(batch.reqs), int(batch.seq_lens_sum or 0), batch.forward_mode in decode_modes)


class HarvestRuntime:
    def __init__(self, *, config, control, lending, trainer_host, timer, metrics, partitioner, refiner, device_type):
        self.config = config
        self.control = control
        self.lending = lending
        self.trainer_host = trainer_host
        self.timer = timer
        self.metrics = metrics
        self.partitioner = partitioner
        self.refiner = refiner
        self.device_type = device_type
        self.control_server = None
        self.num_steps = 0
        self.accounted_steps = 0  # steps whose hook cost was measured (every ACCOUNT_EVERY-th)
        self.step_ns_total = 0
        self.step_cpu_ns_total = 0
        # Per accounted step: (thread CPU, wall, and the wall time of its parts: decide, feedback, lending), ns.
        self.recent_hook_ns: collections.deque = collections.deque(maxlen=2048)
        self._last_refit = 0.0
        self._last_publish = 0.0
        self.idle_gc_collections = 0
        self._fault_pending = False
        self._attention = False  # a trainer fault or a stop signal to handle on the scheduler thread
        self.shutdown_signals = None
        self.gpu_sampler = None
        self._refit_lock = threading.Lock()
        self._closed = False
        self._passthrough_modes, self._decode_modes = forward_mode_sets()
        import torch

        self._torch = torch
        self.decode_cpu_threads = None  # set after start-up: the scheduler thread's torch threads

    # -- start-up ---------------------------------------------------------------------
    @classmethod
    def attach(cls, scheduler) -> "HarvestRuntime":
        from harvest.colocate import StepController, TrainerHost, make_step_timer
        from harvest.compute import create_partitioner
        from harvest.config import HarvestConfig, load
        from harvest.memory.lending import LendingPolicy
        from harvest.memory.lent_budget import LentMemoryBudget
        from harvest.memory.reserve import reserve_tokens
        from harvest.metrics.registry import HarvestMetrics
        from harvest.predict.compat import load_for
        from harvest.predict.online import OnlineRefiner
        from harvest.predict.profiler.levels import from_partitioner
        from harvest.predict.profiler.provenance import running_identity
        from harvest.schedule import QoSController, SchedulerConfig
        from harvest.sglang.kv_backing import allocator_of
        from harvest.sglang.kv_lending import KvLendingController

        path = config_env.harvest_config_path()
        config = load(path) if path is not None else HarvestConfig()
        server_args = scheduler.server_args
        if server_args.tp_size != 1 or server_args.pp_size != 1 or server_args.dp_size != 1:
            raise RuntimeError("harvest supports tp_size = pp_size = dp_size = 1 for now")
        token_allocator = scheduler.token_to_kv_pool_allocator
        pool = token_allocator.get_kvcache()
        allocator = allocator_of(pool)
        if allocator is None:
            raise RuntimeError("harvest: the KV cache is not on harvest's allocator (the KV hook did not run)")
        device = str(pool.device)
        device_type = "cuda" if device.startswith("cuda") else "cpu"

        metrics = HarvestMetrics()
        levels_arg = {} if config.ladder is None else {"levels": list(config.ladder)}
        partitioner = create_partitioner(device, **levels_arg)

        predictor = refiner = None
        if config.profile is not None:
            ladder = from_partitioner(partitioner).ladder
            identity = running_identity(device, server_args.model_path, str(scheduler.model_config.dtype).replace("torch.", ""), ladder)
            profile = load_for(config.profile, identity, allow_mismatch=config.allow_profile_mismatch)
            refiner = OnlineRefiner.from_profile(profile)
            predictor = refiner.predictor

        qos = QoSController(
            SchedulerConfig(target_tpot_ms=config.qos.target_tpot_ms, initial_margin=config.qos.margin),
            partitioner.levels,
        )

        from harvest.train.job import load_job

        for job_path in config.jobs:
            load_job(job_path)  # field-level validation now, at start-up; built on the trainer thread
        trainer_host = None
        budget = LentMemoryBudget()  # lending publishes on it; the trainer's window follows it
        if config.jobs:
            served = None
            if config.share_served_weights:
                served = (server_args.model_path, scheduler.tp_worker.model_runner.model, scheduler.model_config.hf_config)
            trainer_host = TrainerHost(list(config.jobs), build=_job_builder(allocator, device, budget, served),
                                       cpu_threads=config.trainer.cpu_threads, nice=config.trainer.nice)

        g = allocator.geometry
        num_chunks = min(g.num_chunks, math.ceil((token_allocator.size + 1) / g.tokens_per_chunk))
        max_bs = max(1, int(scheduler.max_running_requests))
        reserve = config.memory.reserve_tokens
        if reserve is None:
            # Harli §4.4 with T_swap taken as two steps (a trainer layer swaps out within a
            # unit boundary; units are shorter than a step): reserve = 2 * max_bs tokens,
            # capped at a quarter of the pool (SGLang's max_running_requests default on a
            # CPU is 4096, far above any real decode batch there).
            target_s = config.qos.target_tpot_ms / 1e3
            reserve = min(reserve_tokens(2 * target_s, target_s, max_bs, g.kv_bytes_per_token), token_allocator.size // 4)
        policy = LendingPolicy(tokens_per_chunk=g.tokens_per_chunk, num_chunks=num_chunks, reserve_tokens=reserve,
                               hysteresis_chunks=config.memory.hysteresis_chunks, max_lend_fraction=config.memory.max_lend_fraction)
        lending = KvLendingController(token_allocator, allocator, policy, budget, metrics=metrics)

        control = StepController(partitioner=partitioner, qos=qos, trainer_host=trainer_host, predictor=predictor,
                                 refiner=refiner, metrics=metrics, target_tpot_ms=config.qos.target_tpot_ms)
        runtime = cls(config=config, control=control, lending=lending, trainer_host=trainer_host,
                      timer=make_step_timer(device_type), metrics=metrics, partitioner=partitioner, refiner=refiner,
                      device_type=device_type)
        if device_type == "cuda":
            from harvest.metrics.gpu_telemetry import cuda_device_pci_bus_id, open_sampler

            ordinal = int(device.split(":")[1]) if ":" in device else 0
            runtime.gpu_sampler, why_not = open_sampler(ordinal, cuda_device_pci_bus_id(ordinal))
            if runtime.gpu_sampler is None:
                logger.warning("GPU telemetry off: %s", why_not)
        if trainer_host is not None:
            trainer_host._on_fault = runtime._on_trainer_fault
            trainer_host.on_unit = runtime._after_trainer_unit
        if refiner is not None:
            import sklearn.linear_model  # noqa: F401 - pay the ~1 s import at start-up, not in the first refit
        if config.metrics.port:
            from harvest.sglang.control import ControlServer

            runtime.control_server = ControlServer(runtime, port=config.metrics.port, api_key=server_args.api_key,
                                                   admin_api_key=getattr(server_args, "admin_api_key", None)).start()
        if trainer_host is not None:
            from harvest.sglang.shutdown import SignalCheckpoint
            from harvest.train import trainer_cpu

            if device_type == "cpu":
                # Decode's OpenMP team and the trainer's threads must fit the cores
                # together (an oversubscribed team stalls decode steps; trainer_cpu).
                before, after = trainer_cpu.leave_cores_to_trainer(config.trainer.cpu_threads)
                cores = trainer_cpu.usable_cores()
                problem = trainer_cpu.oversubscription(config.trainer.cpu_threads, after, cores)
                if problem is not None:
                    logger.warning("%s", problem)
                elif after != before:
                    logger.info("decode's torch threads %d -> %d: the trainer's %d thread(s) take the other core(s) of %d",
                                before, after, config.trainer.cpu_threads, cores)
            trainer_host.start()
            runtime.shutdown_signals = SignalCheckpoint(trainer_host, runtime._needs_attention)
            runtime.shutdown_signals.install()
        runtime.decode_cpu_threads = runtime._torch.get_num_threads()
        atexit.register(runtime.close)
        logger.info(
            "harvest co-location on %s: %s; KV %d chunks x %d tokens, reserve %d tokens; target TPOT %.1f ms; jobs: %s",
            device, partitioner.description, num_chunks, g.tokens_per_chunk, reserve, config.qos.target_tpot_ms,
            ", ".join(map(str, config.jobs)) or "none",
        )
        return runtime

    # -- the decode step ----------------------------------------------------------------
    # Hook overhead is accounted on every ACCOUNT_EVERY-th step: a thread-CPU clock read
    # is a system call (~0.6-1.5 us here), four per step would be a tenth of the hook.
    # Prime, so that the sample does not alias with the bookkeeping every RECORD_EVERY (32)
    # steps: sampled steps see it in proportion. The wall clock is read inside the CPU
    # clock's reads, so the wall figures do not count those system calls.
    ACCOUNT_EVERY = 7

    def run_step(self, original, scheduler, batch, *args, **kwargs):
        if batch.forward_mode in self._passthrough_modes:
            return original(scheduler, batch, *args, **kwargs)
        self.num_steps += 1
        # Overhead accounting, two clocks: thread CPU time is what harvest's control costs
        # this thread; wall time adds OS preemption and GIL waits (large on a loaded CPU).
        accounted = self.num_steps % self.ACCOUNT_EVERY == 0
        if accounted:
            cpu0 = time.thread_time_ns()
            wall0 = time.perf_counter_ns()
        if self._attention:
            self._attend()
        if self.timer.measures_late:  # CUDA events of earlier steps: feedback before this decision
            for measured in self.timer.completed():
                self.control.after_step(measured)
        # No KV check here: this step's tokens were allocated when SGLang prepared the batch
        # (the hooks on check_decode_capacity and alloc took lent chunks back if needed).
        self.control.before_step(observe(batch, self._decode_modes))
        stream = self.control.decode_stream
        if accounted:
            wall1 = time.perf_counter_ns()
            cpu1 = time.thread_time_ns()
        if stream is None:  # CPU, or the whole-device level: the thread's current stream
            self.timer.start(None)
            result = original(scheduler, batch, *args, **kwargs)
            self.timer.stop(None)
        else:
            with self._torch.cuda.stream(stream):
                self.timer.start(stream)
                result = original(scheduler, batch, *args, **kwargs)
                self.timer.stop(stream)
        if accounted:
            cpu2 = time.thread_time_ns()
            wall2 = time.perf_counter_ns()
        for measured in self.timer.completed():
            self.control.after_step(measured)
        if accounted:
            wall3 = time.perf_counter_ns()
        self.lending.after_step()
        self.lending.maybe_lend()  # at most every lend_interval_s: a busy server lends too, not only an idle one
        if accounted:
            wall4 = time.perf_counter_ns()
            cpu_ns = (cpu1 - cpu0) + time.thread_time_ns() - cpu2
            decide_ns, feedback_ns, lending_ns = wall1 - wall0, wall3 - wall2, wall4 - wall3
            wall_ns = decide_ns + feedback_ns + lending_ns
            self.recent_hook_ns.append((cpu_ns, wall_ns, decide_ns, feedback_ns, lending_ns))
            self.accounted_steps += 1
            self.step_ns_total += wall_ns
            self.step_cpu_ns_total += cpu_ns
        return result

    REFIT_MIN_INTERVAL_S = 2.0

    PUBLISH_INTERVAL_S = 0.5

    def on_idle(self) -> None:
        if self._attention:
            self._attend()
        self.control.on_idle()
        self.lending.maybe_lend()
        self._maybe_refit()
        self._collect_young_garbage()
        now = time.monotonic()
        if now - self._last_publish >= self.PUBLISH_INTERVAL_S:  # on_idle runs in a tight loop
            self._last_publish = now
            self._publish()

    # Young-generation garbage collection when idle. With a job, the scheduler process
    # collected generation 1 about ten times a minute of serving on CPU (once without), the
    # longest 2-6 ms holding the GIL, which a decode step meeting one waits out. Collected
    # while idle instead, whenever a generation-0 collection happened since the last one:
    # measured, none over 2 ms was left during serving (5-6 per run before), each idle one
    # well under 2 ms. A server that is never idle collects as before.
    def _collect_young_garbage(self) -> None:
        if gc.get_count()[1]:
            gc.collect(1)
            self.idle_gc_collections += 1

    def _after_trainer_unit(self, record) -> None:
        self._maybe_refit()

    def _maybe_refit(self) -> None:
        """Refit the predictor when enough new steps were seen: from the trainer thread
        between units, or from the scheduler thread when idle; never inside a decode step.
        (A scikit-learn refit holds the GIL ~30 ms; a dedicated thread would take it from
        decode at any moment, measured as QoS violations on CPU.)"""
        now = time.monotonic()
        if self.refiner is None or not self.refiner.refit_due() or now - self._last_refit < self.REFIT_MIN_INTERVAL_S:
            return
        if not self._refit_lock.acquire(blocking=False):
            return  # the other thread is refitting
        try:
            self._last_refit = now
            self.refiner.refit()
        except Exception:  # noqa: BLE001 - a failed refit keeps the old model; serving goes on
            logger.exception("predictor refit failed; keeping the previous coefficients")
        finally:
            self._refit_lock.release()

    def _publish(self) -> None:
        if self.trainer_host is not None:
            status = self.trainer_host.status()
            stats = status.stats or {}
            state = {"running": "running", "paused": "paused", "building": "paused"}.get(status.state, "stopped")
            if state == "running" and self.trainer_host.scheduler_state().value == "starved":
                state = "starved"
            self.metrics.set_trainer(state=state, tokens=stats.get("tokens_seen", 0), samples=stats.get("samples_seen", 0),
                                     steps=stats.get("global_step", 0), loss=stats.get("loss"),
                                     window_layers=stats.get("window_stages", 0), resident_bytes=stats.get("resident_bytes", 0))
        lent = self.lending.num_lent
        self.metrics.set_kv_chunks(mapped=self.lending.policy.num_chunks - lent, lent=lent,
                                   fragmentation_bytes=self.lending.stats()["fragmentation_bytes"])
        if self.refiner is not None:
            self.metrics.set_prediction_error(self.refiner.error)
        if self.gpu_sampler is not None:
            sample = self.gpu_sampler.sample()
            self.metrics.set_gpu(sm_utilization=sample.sm_utilization,
                                 memory_bandwidth_utilization=sample.memory_bandwidth_utilization,
                                 memory_used_bytes=sample.memory_used_bytes)

    # -- faults and shutdown --------------------------------------------------------------
    def _on_trainer_fault(self, exc: BaseException) -> None:
        """Trainer thread: flag the fault. SGLang's free lists belong to the scheduler
        thread, so that thread takes every lent chunk back (``_handle_fault``, at its next
        step or idle tick); the scheduler already gives decode every SM (trainer stopped)."""
        self._fault_pending = True
        self._attention = True

    def _needs_attention(self) -> None:
        self._attention = True

    def _attend(self) -> None:
        """Scheduler thread: a trainer fault to clean up after, or a stop signal."""
        signals = self.shutdown_signals
        self._attention = signals is not None and signals.pending  # keep polling until it is passed on
        if self._fault_pending:
            self._handle_fault()
        if signals is not None and signals.pending:
            signals.poll()

    def _handle_fault(self) -> None:
        self._fault_pending = False
        self.metrics.trainer_fault()
        self.lending.reclaim_all()
        logger.info("trainer fault handled: %d KV chunks lent now, decode has every SM", self.lending.num_lent)

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        if self.trainer_host is not None:
            # Checkpoints first; within SGLang's 15 s between ShutdownReq and SIGKILL.
            self.trainer_host.shutdown(timeout_s=10.0)
        if self.control_server is not None:
            self.control_server.close()

    # -- control endpoint (harvest.sglang.control.Controllable) --------------------------
    def status(self) -> dict:
        self.control.record_steps()
        hook = list(self.recent_hook_ns)
        self._publish()
        trainer = dataclasses.asdict(self.trainer_host.status()) if self.trainer_host is not None else None
        return {
            "trainer": trainer,
            "level": {"index": self.control.level.index, "decode_sms": self.control.level.decode_sms,
                      "trainer_sms": self.control.level.trainer_sms, "partitioner": self.partitioner.description},
            "kv": self.lending.stats(),
            "qos": {"target_tpot_ms": self.config.qos.target_tpot_ms, **self.control.qos.stats().to_dict()},
            "steps": self.num_steps,
            # Means and medians over the accounted steps (every ACCOUNT_EVERY-th).
            "hook_overhead_us_per_step": (self.step_ns_total / self.accounted_steps / 1e3) if self.accounted_steps else 0.0,
            "hook_cpu_us_per_step": (self.step_cpu_ns_total / self.accounted_steps / 1e3) if self.accounted_steps else 0.0,
            # Medians over the last steps: the typical step's cost, not the rare one that
            # reclaims KV chunks or is preempted mid-hook (those are in the means above).
            "hook_cpu_us_median": _median_us(hook, 0),
            "hook_wall_us_median": _median_us(hook, 1),
            # Where the wall time goes: predict + decide + apply before the step (with a
            # late timer, the earlier steps' feedback too); the measurement's feedback after
            # it; the KV reserve check and lending plan. Each part's own median.
            "hook_wall_us_median_by_part": {part: _median_us(hook, index)
                                            for index, part in enumerate(HOOK_PARTS, start=2)},
            "prediction_error": self.refiner.error if self.refiner is not None else None,
            "trainer_cpu_threads": self.config.trainer.cpu_threads,
            "decode_cpu_threads": self.decode_cpu_threads,
            "trainer_nice": self.config.trainer.nice,
            "idle_gc_collections": self.idle_gc_collections,
        }

    def pause_trainer(self) -> dict:
        if self.trainer_host is None:
            return {"error": "no finetune job configured"}
        self.trainer_host.operator_pause()
        return {"trainer": "paused"}

    def resume_trainer(self) -> dict:
        if self.trainer_host is None:
            return {"error": "no finetune job configured"}
        self.trainer_host.operator_resume()
        return {"trainer": "resumed"}

    def stop_trainer(self) -> dict:
        if self.trainer_host is None:
            return {"error": "no finetune job configured"}
        self.trainer_host.operator_stop()
        return {"trainer": "stopping (checkpoint first)"}

    def recent_steps(self) -> list:
        return [list(record) for record in list(self.control.recent_steps)]

    def metrics_exposition(self) -> bytes:
        self.control.record_steps()
        self._publish()
        return self.metrics.exposition()


HOOK_PARTS = ("decide", "feedback", "lending")


def _median_us(samples: list, index: int) -> float:
    return statistics.median(s[index] for s in samples) / 1e3 if samples else 0.0


def _job_builder(allocator, device: str, budget, served=None):
    """``build(job_path)`` for the trainer thread: its window in the lent arena, following
    ``budget``. ``served`` = (model path, SGLang model, HF config): a job whose base is that
    checkpoint trains on the served weights in place."""

    def build(job_path):
        from harvest.train.arena_window import ArenaWindowAllocator
        from harvest.train.build import build_trainer
        from harvest.train.errors import WeightSourceError
        from harvest.train.job import load_job

        job = load_job(job_path)
        window = ArenaWindowAllocator(allocator, device, budget)
        if served is not None:
            from harvest.sglang.served_weights import same_checkpoint, served_weight_tensors
            from harvest.train.weights import SharedTensorWeightSource

            served_path, model, hf_config = served
            if same_checkpoint(job.llamafactory_args["model_name_or_path"], served_path):
                try:
                    trainer = build_trainer(job, allocator=window,
                                            weight_source=SharedTensorWeightSource(served_weight_tensors(model, hf_config)))
                    logger.info("job %s trains on the served weights in place (same base model: no second copy)", job_path)
                    return trainer
                except WeightSourceError as exc:
                    logger.warning("job %s: cannot share the served weights (%s); using a host copy", job_path, exc)
        return build_trainer(job, allocator=window)

    return build

