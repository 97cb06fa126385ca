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

from harvest.colocate.controller import StepLoad
from harvest.colocate.rank_sync import Field, LendingRequest, OperatorCode, SlowestRank, new_row
from harvest.colocate.step_profiler import StepProfiler
from harvest.logs import get_logger

logger = get_logger(__name__)


class NoKvLending:
    """An engine whose KV cache harvest does not manage: nothing is lent."""

    num_lent = 0
    num_taken = 0
    enabled = False
    moves_digest = 0

    def lend_due(self) -> bool:
        return False

    def after_step(self) -> None:
        pass

    def maybe_lend(self, force: bool = False, tick: bool | None = None) -> None:
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
                 engine_places_forward: bool = False, ranks=None, trainer_tp=None, adapters=None):
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
        # The engine's decode graphs, one set per SM level (harvest.sglang.level_graphs), or
        # None: ``select(index)`` once per step, for the plan's level, before its forward.
        self.level_graphs = None
        # The running step's plan until its forward ran (``engine_places_forward``): the one
        # thing the step hands its forward, which SGLang calls from inside the step.
        self._forward_plan = None
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
        self._last_refit = -math.inf  # monotonic() starts near 0 at boot
        self._closed = False
        # Tensor-parallel (harvest.colocate.rank_sync): the ranks agree at every step and
        # idle tick; rank 0 decides. ``trainer_tp``: the trainer's TensorParallel, whose
        # waits are given up when another rank's trainer faults.
        self.ranks = ranks
        self.trainer_tp = trainer_tp
        self._slowest = SlowestRank(ranks.size) if ranks is not None else None
        self._measured: list[tuple[int, float]] = []  # this rank's measurements, for the next exchange
        self._operator_out = OperatorCode.NONE  # rank 0: for every rank, with the next exchange
        self._lending_out = LendingRequest.NONE
        self._local_fault = False  # this rank's trainer faulted: told at the next exchange
        self._ranks_fault_handled = False
        self.ranks_stopped_why: str | None = None  # lending stopped on every rank: a rank's check failed
        self.last_agreement = None
        if ranks is not None:
            lending.ranks = ranks
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
        with self.profiler as lap:
            if self._attention:
                self._attend()
            self._feed_back()  # a late timer's (CUDA events) earlier steps: before this decision
            if self.ranks is None:
                plan = self.control.before_step(load)
                lend_tick = None
            else:
                plan, lend_tick = self._agree(load)
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
            self._feed_back()
            lap("feedback")
            self.lending.after_step()  # under the reserve: reclaim now
            if lend_tick is None:
                self.lending.maybe_lend()  # at most every lend interval: a busy server lends too
            else:
                self.lending.maybe_lend(tick=lend_tick)  # when rank 0's clock says, on every rank
            lap("lending")
        return result

    @property
    def every_ranks_trainer_ended(self) -> bool:
        """Tensor-parallel: at the last exchange, no rank's trainer job was running (so no
        rank needs a peer for its trainer any more: the collective checkpoint is written)."""
        agreed = self.last_agreement
        return agreed is not None and agreed.trainers_ended

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

    def _feed_back(self) -> None:
        if self.ranks is not None:  # rank 0 takes the slowest rank's, after the exchange
            self._measured.extend(self.timer.completed())
            return
        for tag, measured_s in self.timer.completed():
            self.control.after_step(tag, measured_s)

    # -- tensor parallel: the ranks' agreement ------------------------------------------------
    def _agree(self, load: StepLoad | None):
        """Rank 0 decides (the step's level and gate, or the idle tick's); every rank
        applies that decision and what else the exchange says. Returns (the step's plan,
        None on an idle tick; whether to look for chunks to lend)."""
        ranks = self.ranks
        row = new_row()
        plan = None
        if ranks.leader:
            if load is not None:
                plan = self.control.before_step(load)
                row[Field.TAG] = plan.step
            else:
                self.control.on_idle()
            row[Field.LEVEL], row[Field.RUN] = self.control.applied
            row[Field.OPERATOR], self._operator_out = self._operator_out, OperatorCode.NONE
            row[Field.LENDING_REQUEST], self._lending_out = self._lending_out, LendingRequest.NONE
            row[Field.LEND_TICK] = self.lending.lend_due()
        for index, (tag, seconds) in enumerate(self._measured[-2:]):
            row[Field.MEASURED_TAG_1 + 2 * index], row[Field.MEASURED_S_1 + 2 * index] = tag, seconds
        self._measured.clear()
        row[Field.FAULT] = self._local_fault
        row[Field.NUM_TAKEN] = self.lending.num_taken
        row[Field.MOVES_DIGEST] = self.lending.moves_digest
        row[Field.LENDING_OK] = self.integrity_error is None
        row[Field.TRAINER_ENDED] = self.trainer_host is None or self.trainer_host.join(0)
        agreed = ranks.exchange(row)
        self.last_agreement = agreed
        if ranks.leader:
            for tag, seconds in self._slowest.add(agreed.measurements):
                self.control.after_step(tag, seconds)
        elif load is not None:
            plan = self.control.follow(agreed.tag, agreed.level, agreed.run)
        elif agreed.level >= 0:
            self.control.apply_decision(agreed.level, agreed.run)
        self._apply_agreement(agreed)
        return plan, agreed.lend_tick

    def _apply_agreement(self, agreed) -> None:
        host = self.trainer_host
        if agreed.operator is not OperatorCode.NONE and not self.ranks.leader and host is not None:
            if agreed.operator is OperatorCode.PAUSE:
                host.operator_pause()
            elif agreed.operator is OperatorCode.RESUME:
                host.operator_resume()
            elif agreed.operator is OperatorCode.STOP:
                self._operator_stopped = True
                host.operator_stop()
        if agreed.lending_request is LendingRequest.RETURN:
            self.lending.return_all()
        elif agreed.lending_request is LendingRequest.RESUME and not self._operator_stopped \
                and self.ranks_stopped_why is None:
            self.lending.resume_lending()
        if agreed.faulted_ranks and not self._ranks_fault_handled:
            self._ranks_fault_handled = True
            ranks = ", ".join(map(str, agreed.faulted_ranks))
            if self.trainer_tp is not None:
                self.trainer_tp.abort(f"the trainer of rank {ranks} faulted")
            if self.metrics is not None and self.ranks.leader:
                self.metrics.trainer_fault()
            self.lending.reclaim_all()  # every rank here, at once: the same chunks come back everywhere
            logger.info("trainer fault on rank %s handled: %d KV chunks lent now, decode has every SM", ranks,
                        self.lending.num_lent)
        broken = agreed.lending_broken_ranks
        if (broken or agreed.diverged) and self.ranks_stopped_why is None:
            # Nothing is reclaimed: with a rank's bookkeeping in doubt, putting slots back
            # could hand SGLang a slot twice (as on one rank: _check_kv_integrity).
            self.ranks_stopped_why = (f"the KV integrity check failed on rank {', '.join(map(str, broken))}" if broken
                                      else f"the ranks' lent chunks differ (counts {agreed.taken_by_rank}, "
                                           f"digests {agreed.digests_by_rank})")
            self.lending.enabled = False
            if host is not None:
                host.operator_stop()  # on every rank: the trainers vote stop together and checkpoint
            logger.error("lending and the trainer are stopped on every rank, serving goes on: %s",
                         self.ranks_stopped_why)

    # -- between steps ------------------------------------------------------------------
    def on_idle(self) -> None:
        if self._attention:
            self._attend()
        self._feed_back()
        if not self.timer.outstanding:
            self.control.forget_unmeasured()  # steps whose measurement was lost: not waited for
        if self.ranks is None:
            self.control.on_idle()
            self.lending.maybe_lend()
        else:
            _, lend_tick = self._agree(None)
            self.lending.maybe_lend(tick=lend_tick)
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
        """Trainer thread: flag the fault for the engine thread (``_attend``; tensor-parallel:
        the next exchange, where every rank handles it)."""
        if self.ranks is not None:
            self._local_fault = True
            return
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
        if host is None or not host.runs:
            return 409, {"error": "no finetune job configured"}
        state = host.status().state
        ended = (TrainerState.STOPPED, TrainerState.FINISHED, TrainerState.FAILED)
        if state in ended or (self._operator_stopped and action != "stop"):
            return 409, {"error": f"the trainer has {'been stopped' if self._operator_stopped else state.value}: "
                                  f"nothing to {action}", "trainer": state.value}
        if self.ranks is not None:
            self._operator_out = {"pause": OperatorCode.PAUSE, "resume": OperatorCode.RESUME,
                                  "stop": OperatorCode.STOP}.get(action, OperatorCode.NONE)
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

    def lend_again_for_live_jobs(self) -> None:
        """After a job's fault took every chunk back (lending off): the server's other
        jobs, or one submitted later, get lent memory again, unless lending stopped for a
        reason that concerns every job (a failed integrity check, an operator's stop)."""
        host = self.trainer_host
        if isinstance(self.lending, NoKvLending) or host is None or not host.live or self._operator_stopped \
                or self.integrity_error is not None \
                or self.ranks_stopped_why is not None or self.ranks is not None:
            return
        self.lending.enabled = True
        self.lending.resume_lending()

    def _request_lending(self, request: str) -> None:
        if self.ranks is not None:  # rank 0's endpoint: every rank moves memory at the next exchange
            self._lending_out = LendingRequest.RETURN if request == "return" else LendingRequest.RESUME
            return
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
            self.lend_again_for_live_jobs()
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
