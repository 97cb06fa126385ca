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
import time
from typing import Callable

from harvest.colocate.controller import StepLoad
from harvest.colocate.step_profiler import StepProfiler
from harvest.logs import get_logger

logger = get_logger(__name__)


class NoKvLending:
    """An engine whose KV cache harvest does not manage: nothing is lent."""

    num_lent = 0
    enabled = False

    def after_step(self) -> None:
        pass

    def maybe_lend(self, force: bool = False) -> None:
        pass

    def reclaim_all(self) -> None:
        pass

    def return_all(self) -> None:
        pass

    def resume_lending(self) -> None:
        pass

    def maybe_check_integrity(self) -> bool:
        return False

    def stats(self) -> dict:
        return {}


class Colocation:
    def __init__(self, *, config, partitioner, control, trainer_host, lending, timer, metrics, refiner,
                 gpu_sampler=None, device_type: str = "cpu", refit_min_interval_s: float = 2.0,
                 engine_places_forward: bool = False):
        self.config = config
        self.partitioner = partitioner
        self.control = control
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
        self._step_tag: int | None = None  # the running step's decision number, until its forward ran
        self.profiler = StepProfiler()
        self.idle_gc_collections = 0
        self.integrity_error: str | None = None  # the first failed idle integrity check's message
        self.decode_cpu_threads: int | None = None  # the engine thread's torch threads, once started
        # Called on this thread when attention is requested; each returns whether it wants
        # to be called again (a stop signal waits for the trainer's checkpoint).
        self.attention_handlers: list[Callable[[], bool]] = []
        self._attention = False  # a trainer fault or a stop signal to handle on this thread
        self._fault_pending = False
        self._lending_request: str | None = None  # an operator's "return" or "resume", for this thread
        self._operator_stopped = False
        self._refit_lock = threading.Lock()
        self._last_refit = 0.0
        self._closed = False
        if trainer_host is not None:
            trainer_host.on_unit = self._after_trainer_unit
            trainer_host.on_fault = self._on_trainer_fault

    # -- the decode step ----------------------------------------------------------------
    def run_step(self, load: StepLoad, run, *args, **kwargs):
        """decide -> run the engine's step on the chosen level -> feedback -> lend."""
        with self.profiler as lap:
            if self._attention:
                self._attend()
            self._feed_back()  # a late timer's (CUDA events) earlier steps: before this decision
            tag = self.control.before_step(load).step
            lap("decide")
            if self.engine_places_forward:
                self._step_tag = tag
                try:
                    result = run(*args, **kwargs)
                finally:
                    self._step_tag = None
            else:
                result = self.timer.time(tag, self.control.decode_stream, run, *args, **kwargs)
            lap("engine")
            self._feed_back()
            lap("feedback")
            self.lending.after_step()  # under the reserve: reclaim now
            self.lending.maybe_lend()  # at most every lend interval: a busy server lends too
            lap("lending")
        return result

    @property
    def forward_pending(self) -> bool:
        """Inside run_step, before the step's forward ran (``engine_places_forward``)."""
        return self._step_tag is not None

    def run_forward(self, run, *args, **kwargs):
        """The forward of the running step, for an engine that calls it itself
        (``engine_places_forward``): on the chosen level's decode stream, timed as the
        step. The first forward of a step is the step's; any other call (outside a step,
        or a second forward in one) runs as the engine placed it."""
        tag = self._step_tag
        if tag is None:
            return run(*args, **kwargs)
        self._step_tag = None
        return self.timer.time(tag, self.control.decode_stream, run, *args, **kwargs)

    def _feed_back(self) -> None:
        for tag, measured_s in self.timer.completed():
            self.control.after_step(tag, measured_s)

    # -- between steps ------------------------------------------------------------------
    def on_idle(self) -> None:
        if self._attention:
            self._attend()
        self._feed_back()
        if not self.timer.outstanding:
            self.control.forget_unmeasured()  # steps whose measurement was lost: not waited for
        self.control.on_idle()
        self.lending.maybe_lend()
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
        slot twice."""
        if self.integrity_error is not None:
            return
        try:
            self.lending.maybe_check_integrity()
        except Exception as exc:  # noqa: BLE001 - VmmIntegrityError, KvIntegrityError, or a broken check
            self.integrity_error = f"{type(exc).__name__}: {exc}"
            self.lending.enabled = False
            if self.trainer_host is not None:
                self.trainer_host.operator_stop()
            logger.error("KV memory integrity check failed; lending and the trainer are stopped, serving goes on: %s",
                         self.integrity_error)

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
        """Trainer thread: flag the fault for the engine thread (``_attend``)."""
        self._fault_pending = True
        self._attention = True

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
        if host is None:
            return 409, {"error": "no finetune job configured"}
        state = host.status().state
        ended = (TrainerState.STOPPED, TrainerState.FINISHED, TrainerState.FAILED)
        if state in ended or (self._operator_stopped and action != "stop"):
            return 409, {"error": f"the trainer has {'been stopped' if self._operator_stopped else state.value}: "
                                  f"nothing to {action}", "trainer": state.value}
        if action == "pause":
            host.operator_pause()
            release = self.config.memory.release_on_pause
            if release:
                self._request_lending("return")
            return 200, {"trainer": "paused", "kv": "returning lent memory to decode" if release else "kept"}
        if action == "resume":
            host.operator_resume()
            self._request_lending("resume")
            return 200, {"trainer": "resumed", "kv": "lending"}
        if action == "stop":
            if self._operator_stopped:
                return 409, {"error": "the trainer is already stopping", "trainer": state.value}
            self._operator_stopped = True
            host.operator_stop()
            self._request_lending("return")
            return 200, {"trainer": "stopping (checkpoint first)", "kv": "returning lent memory; no more lending"}
        raise ValueError(f"unknown operator action {action!r}")

    def _request_lending(self, request: str) -> None:
        self._lending_request = request
        self.request_attention()

    def _attend(self) -> None:
        self._attention = False
        request, self._lending_request = self._lending_request, None
        if request == "return":
            self.lending.return_all()
        elif request == "resume" and not self._operator_stopped and self.integrity_error is None:
            self.lending.resume_lending()
        if self._fault_pending:
            self._fault_pending = False
            if self.metrics is not None:
                self.metrics.trainer_fault()
            self.lending.reclaim_all()
            logger.info("trainer fault handled: %d KV chunks lent now, decode has every SM", self.lending.num_lent)
        for handler in self.attention_handlers:
            if handler():
                self._attention = True

    # -- lifecycle ------------------------------------------------------------------------
    def start(self) -> None:
        """On the engine thread: settle its CPU threads beside the trainer's, then start
        the trainer thread."""
        if self.trainer_host is not None:
            if self.device_type == "cpu":
                leave_cores_to_trainer(self.config.trainer.cpu_threads)
            self.trainer_host.start()
        import torch

        self.decode_cpu_threads = torch.get_num_threads()

    def close(self, trainer_timeout_s: float = 10.0) -> None:
        """Stop the trainer (it checkpoints first); idempotent."""
        if self._closed:
            return
        self._closed = True
        if self.trainer_host is not None:
            self.trainer_host.shutdown(timeout_s=trainer_timeout_s)


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
