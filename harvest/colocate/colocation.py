"""One co-located decode engine and trainer: the per-step loop and what runs when idle.

Built by :func:`harvest.colocate.assemble.assemble`; the serving engine's adapter (the
SGLang runtime, the transformers harness of scripts/colocate_gpu.py) calls
:meth:`Colocation.run_step` around every decode step and :meth:`Colocation.on_idle`
between them. Everything here runs on the engine's (decode) thread except the two
callbacks the trainer thread makes (``_after_trainer_unit``, ``_on_trainer_fault``).

A trainer fault stops only the trainer: the scheduler already gives decode every SM once
it is stopped, and this thread takes every lent KV chunk back at its next step or idle
tick (the engine's free lists belong to this thread).
"""

from __future__ import annotations

import gc
import threading
import math
import time
from typing import Callable

from harvest.colocate.step_controller import StepLoad
from harvest.colocate.lending_state import LendingSwitch, NoKvLending
from harvest.colocate.rank_decision import rank_decision
from harvest.colocate.step_profiler import StepProfiler
from harvest.logs import get_logger

logger = get_logger(__name__)

__all__ = ["Colocation", "NoKvLending", "leave_cores_to_trainer"]


class Colocation:
    def __init__(self, *, config, partitioner, step_controller, trainer_host, lending, timer, metrics, refiner,
                 gpu_sampler=None, device_type: str = "cpu", refit_min_interval_s: float = 2.0,
                 engine_places_forward: bool = False, ranks=None, trainer_tp=None, adapters=None):
        self.config = config
        self.partitioner = partitioner
        self.step_controller = step_controller
        self.trainer_host = trainer_host
        self.lending = lending
        self.timer = timer
        self.metrics = metrics
        self.refiner = refiner
        self.gpu_sampler = gpu_sampler
        self.device_type = device_type
        self.refit_min_interval_s = refit_min_interval_s
        # True: the engine calls run_forward for the step's forward itself (SGLang, whose
        # scheduler moves the forward onto a stream of its own inside the step); False:
        # run_step's whole ``run`` is the forward.
        self.engine_places_forward = engine_places_forward
        # The engine's decode graphs, one set per SM level (harvest.sglang.level_graphs), or
        # None: ``select(index)`` once per step, for the plan's level, before its forward.
        self.level_graphs = None
        # The running step's plan until its forward ran (``engine_places_forward``): the one
        # thing the step hands its forward, which SGLang calls from inside the step.
        self._forward_plan = None
        self.profiler = StepProfiler()
        self.idle_gc_collections = 0
        self.decode_cpu_threads: int | None = None  # the engine thread's torch threads, once started
        # Called on this thread when attention is requested; each returns whether it wants
        # to be called again (a stop signal waits for the trainer's checkpoint).
        self.attention_handlers: list[Callable[[], bool]] = []
        self._attention = False  # a trainer fault, a lending request or a stop signal to handle on this thread
        self._refit_lock = threading.Lock()
        self._last_refit = -math.inf  # monotonic() starts near 0 at boot
        self._closed = False
        # Whether lending runs, and why not (harvest.colocate.lending_state).
        self.lending_switch = LendingSwitch(lending)
        # Who decides for this rank (harvest.colocate.rank_decision): the rank alone, or,
        # tensor-parallel (``ranks``: harvest.colocate.rank_sync.RankSync), rank 0 for every
        # rank at each step and idle tick. ``trainer_tp``: the trainer's TensorParallel.
        self.ranks = ranks
        self.trainer_tp = trainer_tp
        self.decides = rank_decision(ranks, step_controller=step_controller, timer=timer, lending=lending, switch=self.lending_switch,
                                     trainer_host=trainer_host, metrics=metrics, trainer_tp=trainer_tp,
                                     request_attention=self.request_attention)
        # harvest.colocate.job_control.AdapterServing: finished jobs' adapters into the
        # serving engine (None: the engine cannot serve adapters).
        self.adapters = adapters
        self.model_name: str | None = None  # the served model's name (metrics' model_name label)
        self._cores_left_to_trainer = False
        if trainer_host is not None:
            trainer_host.on_unit = self._after_trainer_unit
            trainer_host.on_fault = self._on_trainer_fault
            trainer_host.on_job_end = self._on_job_end

    # -- the decode step ----------------------------------------------------------------
    def run_step(self, load: StepLoad, run, *args, **kwargs):
        """decide -> run the engine's step on the chosen level -> feedback -> lend."""
        decides = self.decides
        with self.profiler as lap:
            if self._attention:
                self._attend()
            decides.feed_back()  # a late timer's (CUDA events) earlier steps: before this decision
            plan = decides.step(load)
            lap("decide")
            if self.engine_places_forward:  # the engine calls run_forward inside ``run``
                self._forward_plan = plan
                try:
                    result = run(*args, **kwargs)
                finally:
                    self._forward_plan = None
            else:
                result = self.timer.time(plan.step, plan.stream, run, *args, **kwargs)
            lap("engine")
            decides.feed_back()
            lap("feedback")
            self.lending.after_step()  # under the reserve: reclaim now
            decides.lend()
            lap("lending")
        return result

    @property
    def forward_pending(self) -> bool:
        """Inside run_step, before the step's forward ran (``engine_places_forward``)."""
        return self._forward_plan is not None

    def run_forward(self, run, *args, **kwargs):
        """The forward of the running step, for an engine that calls it itself
        (``engine_places_forward``): the plan's decode graphs, on the plan's decode stream,
        timed as the step. The first forward of a step is the step's; any other call
        (outside a step, or a second forward in one) runs as the engine placed it, with the
        whole-device level's graphs."""
        plan = self._forward_plan
        graphs = self.level_graphs
        if plan is None:
            if graphs is not None:
                graphs.select(self.partitioner.ladder.whole_device_index)
            return run(*args, **kwargs)
        self._forward_plan = None
        if graphs is not None:
            graphs.select(plan.level)
        return self.timer.time(plan.step, plan.stream, run, *args, **kwargs)

    # -- what the state says (the status, the control endpoint) ---------------------------------
    @property
    def integrity_error(self) -> str | None:
        """This rank's first failed idle integrity check's message."""
        return self.lending_switch.integrity_error

    @property
    def ranks_stopped_why(self) -> str | None:
        """Tensor-parallel: why lending stopped on every rank (a rank's check failed, the ranks differ)."""
        return self.lending_switch.ranks_stopped_why

    @property
    def _operator_stopped(self) -> bool:
        return self.lending_switch.operator_stopped

    @property
    def last_agreement(self):
        """Tensor-parallel: what the ranks agreed at the last exchange (None: one rank, or none yet)."""
        return self.decides.last_agreement

    @property
    def every_ranks_trainer_ended(self) -> bool:
        """Tensor-parallel: at the last exchange, no rank's trainer job was running."""
        return self.decides.every_ranks_trainer_ended

    # -- between steps ------------------------------------------------------------------
    def on_idle(self) -> None:
        if self._attention:
            self._attend()
        self.decides.feed_back()
        if not self.timer.outstanding:
            self.step_controller.forget_unmeasured()  # steps whose measurement was lost: not waited for
        self.decides.idle()  # the trainer on the level with the most trainer SMs; lending
        self._check_kv_integrity()
        self.maybe_refit()
        self._collect_young_garbage()
        if self.trainer_host is not None:
            # SGLang calls this in a tight loop while idle, so this thread always wants the
            # GIL; a trainer thread that releases it around each torch call then waits up to
            # a switch interval to get it back, call after call (a model load took a minute).
            # A zero sleep hands the GIL over at once.
            time.sleep(0)

    # Young-generation garbage collection when idle: a collection of generation 1 can hold
    # the GIL for milliseconds, which a decode step meeting it waits out; collected while
    # idle instead, whenever a generation-0 collection happened since the last one. A
    # server that is never idle collects as before (docs/measurements.md).
    def _collect_young_garbage(self) -> None:
        if gc.get_count()[1]:
            gc.collect(1)
            self.idle_gc_collections += 1

    def _check_kv_integrity(self) -> None:
        """At most every integrity interval while idle: the engine's free lists, the
        allocator's chunk states and the lending cache agree (harvest.sglang.kv_lending).
        A disagreement found here stops lending and the trainer, and serving goes on with
        the memory decode has, instead of surfacing later as a corrupted KV cache. Nothing
        is reclaimed: with the bookkeeping wrong, putting slots back could hand SGLang a
        slot twice (LendingSwitch.integrity_failed)."""
        if self.lending_switch.integrity_error is not None:
            return
        try:
            self.lending.maybe_check_integrity()
        except Exception as exc:  # noqa: BLE001 - VmmIntegrityError, KvIntegrityError, or a broken check
            message = f"{type(exc).__name__}: {exc}"
            self.decides.integrity_failed(message)
            if self.trainer_host is not None:
                self.trainer_host.operator_stop()
            logger.error("KV memory integrity check failed; lending and the trainer are stopped, serving goes on: %s",
                         message)

    def maybe_refit(self) -> None:
        """Refit the predictor when enough new steps were seen: from the trainer thread
        between units, or from the engine thread when idle; never inside a decode step.
        (A scikit-learn refit holds the GIL for tens of ms; a thread of its own would take
        it from decode at any moment, measured as QoS violations.)"""
        now = time.monotonic()
        if self.refiner is None or not self.refiner.refit_due() or now - self._last_refit < self.refit_min_interval_s:
            return
        if not self._refit_lock.acquire(blocking=False):
            return  # the other thread is refitting
        try:
            self._last_refit = now
            self.refiner.try_refit()
        finally:
            self._refit_lock.release()

    def _after_trainer_unit(self, record) -> None:
        self.maybe_refit()

    # -- faults and signals ---------------------------------------------------------------
    def _on_trainer_fault(self, exc: BaseException) -> None:
        """Trainer thread: the fault is handled on the engine thread (alone: its next step
        or idle tick; tensor-parallel: the next exchange, where every rank handles it)."""
        self.decides.trainer_faulted()

    def request_attention(self) -> None:
        """Any thread or a signal handler: run the attention handlers at the next step or idle tick."""
        self._attention = True

    # -- the operator (any thread: the control endpoint's) -------------------------------------
    def operator(self, action: str) -> tuple[int, dict]:
        """An operator's ``pause``, ``resume`` or ``stop``: (HTTP status, reply). The reply
        says the state the action leads to; an action the trainer's state does not allow
        is refused with 409. Pause gives the lent KV memory back (``memory.release_on_pause``);
        stop checkpoints, gives every chunk back and lends no more. The memory moves on the
        engine thread, at its next step or idle tick."""
        from harvest.schedule import TrainerState

        host = self.trainer_host
        if host is None or not host.runs:
            return 409, {"error": "no finetune job configured"}
        state = host.status().state
        ended = (TrainerState.STOPPED, TrainerState.FINISHED, TrainerState.FAILED)
        stopped = self.lending_switch.operator_stopped
        if state in ended or (stopped and action != "stop"):
            return 409, {"error": f"the trainer has {'been stopped' if stopped else state.value}: "
                                  f"nothing to {action}", "trainer": state.value}
        self.decides.operator_action(action)  # tensor-parallel: every rank applies it at the next exchange
        if action == "pause":
            host.operator_pause()
            release = self.config.memory.release_on_pause
            if release:
                self.decides.request_lending("return")
            return 200, {"trainer": "paused", "kv": "returning lent memory to decode" if release else "kept"}
        if action == "resume":
            host.operator_resume()
            self.decides.request_lending("resume")
            return 200, {"trainer": "resumed", "kv": "lending"}
        if action == "stop":
            if stopped:
                return 409, {"error": "the trainer is already stopping", "trainer": state.value}
            self.lending_switch.stop()
            host.operator_stop()
            self.decides.request_lending("return")
            return 200, {"trainer": "stopping (checkpoint first)", "kv": "returning lent memory; no more lending"}
        raise ValueError(f"unknown operator action {action!r}")

    def lend_again_for_live_jobs(self) -> None:
        """After a job's fault took every chunk back (lending off): the server's other
        jobs, or one submitted later, get lent memory again, unless lending stopped for a
        reason that concerns every job (a failed integrity check, an operator's stop; on
        a tensor-parallel instance, any fault)."""
        self.decides.lend_again()

    def _attend(self) -> None:
        self._attention = False
        self.decides.attend()  # alone: the operator's lending request, a trainer fault
        for handler in self.attention_handlers:
            if handler():
                self._attention = True

    # -- lifecycle ------------------------------------------------------------------------
    def start(self) -> None:
        """On the engine thread: settle its CPU threads beside the trainer's, then start
        the trainer thread."""
        if self.trainer_host is not None:
            if self.trainer_host.runs:
                self._leave_cores_to_trainer()
            self.trainer_host.start()
        import torch

        self.decode_cpu_threads = torch.get_num_threads()

    def _leave_cores_to_trainer(self) -> None:
        """Engine thread, once, before the first job starts (at start-up, or the first
        submission to a server started without jobs)."""
        if self._cores_left_to_trainer:
            return
        self._cores_left_to_trainer = True
        if self.device_type == "cpu":
            leave_cores_to_trainer(self.config.trainer.cpu_threads)
            if self.trainer_host is not None:
                self.trainer_host.note_serving_threads()

    # -- the job queue and run-time settings (engine thread: the control link's commands) --
    def command(self, action: str, args: dict | None = None) -> tuple[int, dict]:
        """An operator's command from the control endpoint: (HTTP status, reply)."""
        from harvest.colocate import job_control

        return job_control.execute(self, action, args or {})

    def _on_job_end(self, run) -> None:
        """A job's thread, as the job ends: a finished job with ``serve_as`` is served."""
        if run.state == "finished" and run.spec.serve_as and self.adapters is not None:
            self.adapters.publish(run, run.spec.serve_as)

    def close(self, trainer_timeout_s: float = 10.0) -> None:
        """Stop the trainer (it checkpoints first), then the lending thread (what it was
        asked runs first; nothing is left half-moved); idempotent."""
        if self._closed:
            return
        self._closed = True
        if self.trainer_host is not None:
            self.trainer_host.shutdown(timeout_s=trainer_timeout_s)
        self.lending.close()


def leave_cores_to_trainer(trainer_cpu_threads: int) -> None:
    """On a CPU device, decode's OpenMP team and the trainer's threads must fit the cores
    together: an oversubscribed team stalls decode steps (harvest.train.trainer_cpu)."""
    from harvest.train import trainer_cpu

    before, after = trainer_cpu.leave_cores_to_trainer(trainer_cpu_threads)
    cores = trainer_cpu.usable_cores()
    problem = trainer_cpu.oversubscription(trainer_cpu_threads, after, cores)
    if problem is not None:
        logger.warning("%s", problem)
    elif after != before:
        logger.info("decode's torch threads %d -> %d: the trainer's %d thread(s) take the other core(s) of %d",
                    before, after, trainer_cpu_threads, cores)
