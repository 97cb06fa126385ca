"""The server's finetune jobs, each on a background thread, behind the scheduler's gate.

The host owns the jobs' threads and everything the decode side needs from them:
``scheduler_state()`` (what the QoS scheduler sees), ``apply(run, stream)`` (the per-step
decision, effective at the job's next unit boundary), the job queue (:meth:`submit`,
:meth:`cancel`; policy in :mod:`harvest.colocate.job_queue`), operator controls and a
status per job. Invariants: only the active job's gate is ever open, so two jobs never run
a unit at once; a job's fault ends that job only, the runtime takes back all lent memory
and serving never stops.

Rules: docs/design.md, 'The trainer host (harvest/colocate/trainer_host.py)'.
"""

from __future__ import annotations

import sys
import threading
import time
import traceback
from pathlib import Path
from typing import Callable

from harvest import config_env
from harvest.colocate.job_gates import JobGate
from harvest.colocate.job_queue import Handover, JobQueue, JobRun, JobSpec, spec_of_path
from harvest.colocate.job_status import HostStatus, host_status
from harvest.logs import get_logger
from harvest.schedule import TrainerState
from harvest.schedule.fair_share import DEFAULT_QUANTUM_S, DEFAULT_STARVATION_S, FairShare
from harvest.train import trainer_cpu
from harvest.train.gate import Gate
from harvest.train.trainer_cpu import DEFAULT_TRAINER_CPU_THREADS, DEFAULT_TRAINER_NICE

logger = get_logger(__name__)

CO_LOCATED_SWITCH_INTERVAL_S = 0.0005
DEFAULT_MAX_RUNNING = 4


class TrainerHost:
    def __init__(self, jobs: list, *, build: Callable, on_fault: Callable[[BaseException], None] | None = None,
                 on_unit: Callable[[object], None] | None = None, switch_interval_s: float = CO_LOCATED_SWITCH_INTERVAL_S,
                 cpu_threads: int = DEFAULT_TRAINER_CPU_THREADS, nice: int = DEFAULT_TRAINER_NICE,
                 tp_rank: int = 0, max_running: int = DEFAULT_MAX_RUNNING, quantum_s: float = DEFAULT_QUANTUM_S,
                 starvation_s: float = DEFAULT_STARVATION_S, on_job_end: Callable[[JobRun], None] | None = None,
                 corun_check: Callable[[float, str], str | None] | None = None):
        """``jobs``: :class:`JobSpec` (or job paths, named after the file). ``build(job_path)
        -> LayerSplitTrainer`` runs on the job's thread (loading a model and dataset takes
        seconds; neither the server nor the other jobs wait for it). ``on_unit(record)``
        runs on the trainer's thread after every unit: background work (the predictor's
        refit) belongs there, not on the decode thread. ``on_job_end(run)`` runs on the
        job's thread when it ends (finished, stopped, cancelled, failed).
        ``corun_check(micro_batch_tokens, job) -> problem or None``: once a job has
        completed its first step here, whether its micro-batches are the size the
        profile's co-run stage measured decode beside
        (harvest.predict.compat.corun_units_mismatch); a problem is logged as a warning
        and shown in the job's status line (``corun_mismatch``)."""
        self._build = build
        self.on_fault = on_fault
        self.on_unit = on_unit
        self.on_job_end = on_job_end
        self.corun_check = corun_check
        self._switch_interval_s = switch_interval_s
        self.cpu_threads = cpu_threads
        self.nice = nice
        self.tp_rank = tp_rank  # this process's tensor-parallel rank (0 without tensor parallelism)
        self.queue = JobQueue([job if isinstance(job, JobSpec) else spec_of_path(job) for job in jobs],
                              max_running=max_running, fair=FairShare(quantum_s, starvation_s))
        self._lock = threading.RLock()  # RLock: a signal handler on the decode thread may stop the jobs
        self._operator_paused = False
        self._scheduler_run = False
        self._stream = None
        self._started = False
        self._serving_threads: int | None = None
        self._saved_switch_interval: float | None = None
        self._error: str | None = None
        # Resolved per handover: scheduler_state() runs before every decode step.
        self._starved_fn = None

    @property
    def runs(self) -> list[JobRun]:
        return self.queue.runs

    @property
    def fair(self) -> FairShare:
        return self.queue.fair

    @property
    def max_running(self) -> int:
        return self.queue.max_running

    @property
    def job_paths(self) -> list[Path]:
        return [run.spec.path for run in self.runs]

    @property
    def trainer(self):
        """The trainer of the job holding the trainer (or the last that held it)."""
        run = self.queue.active or self.queue.last_active
        return run.trainer if run is not None else None

    @property
    def gate(self) -> Gate | None:
        """The gate of the job holding the trainer (or the last that held it, or the first)."""
        run = self.queue.active or self.queue.last_active or (self.runs[0] if self.runs else None)
        return run.gate if run is not None else None

    # -- lifecycle --------------------------------------------------------------------
    def start(self) -> None:
        """On the serving thread: start the first ``max_running`` jobs."""
        with self._lock:
            if self._started:
                return
            self._started = True
            self._serving_threads = trainer_cpu.process_default()
            self._start_queued_locked()

    def shutdown(self, timeout_s: float = 60.0) -> None:
        """Stop every job (each checkpoints first) and wait for their threads."""
        self.operator_stop()
        deadline = time.monotonic() + timeout_s
        for run in list(self.runs):
            if run.thread is not None:
                run.thread.join(max(0.0, deadline - time.monotonic()))
                if run.thread.is_alive():
                    logger.error("job %s did not stop within %.0fs", run.name, timeout_s)
        self._restore_switch_interval()

    def join(self, timeout_s: float | None = None) -> bool:
        """Wait until every started job's thread ended (True) or ``timeout_s`` passed."""
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        for run in list(self.runs):
            if run.thread is not None:
                run.thread.join(None if deadline is None else max(0.0, deadline - time.monotonic()))
                if run.thread.is_alive():
                    return False
        return True

    def note_serving_threads(self) -> None:
        """On the serving thread, after it changed its torch thread count: the default
        to restore once a job's thread has claimed its own."""
        if self._started:
            self._serving_threads = trainer_cpu.process_default()

    # -- the queue (operator commands, any thread) -----------------------------------------
    def submit(self, spec: JobSpec) -> JobRun:
        """Queue a job at run time (any thread); it starts when fewer than ``max_running``
        jobs are built. Refused (JobRefused) after a stop, or when its name or output
        folder is a live job's."""
        with self._lock:
            run = self.queue.submit(spec)
            logger.info("job %s queued (%s, weight %g)", run.name, spec.path, spec.weight)
            if self._started:
                self._start_queued_locked()
            return run

    def cancel(self, name: str) -> JobRun:
        """Cancel the live job ``name``: a queued one never starts; a building or running one
        checkpoints and ends at its next unit boundary (its output folder keeps the
        checkpoint: resubmitting resumes it)."""
        with self._lock:
            run = self.queue.cancel(name, time.monotonic())
            if run.ended:  # it was queued
                self._start_queued_locked()
            else:
                run.gate.stop()
            logger.info("job %s cancelled", name)
            return run

    def set_weight(self, name: str, weight: float) -> JobRun:
        with self._lock:
            run, previous = self.queue.set_weight(name, weight)
            logger.info("job %s: weight %g -> %g", name, previous, weight)
            return run

    # -- the jobs' threads --------------------------------------------------------------
    def _start_queued_locked(self) -> None:
        """Start queued jobs while fewer than ``max_running`` are building or running."""
        while (run := self.queue.next_to_start()) is not None:
            self._start_thread_locked(run)

    def _start_thread_locked(self, run: JobRun) -> None:
        fault_after = config_env.fault_after_units()
        if config_env.fault_rank() not in (None, self.tp_rank):
            fault_after = None
        run.gate = JobGate(lambda seconds, run=run: self._unit_done(run, seconds), fault_after)
        run.gate.pause()  # opened when it holds the trainer and the scheduler lets it run
        if self._saved_switch_interval is None:
            self._saved_switch_interval = sys.getswitchinterval()
            sys.setswitchinterval(self._switch_interval_s)
        claimed = threading.Event()
        run.thread = threading.Thread(target=self._main, args=(run, claimed), name=f"harvest-trainer-{run.name}",
                                      daemon=True)
        run.thread.start()
        # The job's thread limits its own CPU threads first thing (microseconds); then the
        # process default goes back to what the serving threads use.
        if not claimed.wait(30.0):
            logger.warning("job %s: its thread did not start within 30 s", run.name)
        trainer_cpu.restore_process_default(self._serving_threads)

    def _main(self, run: JobRun, claimed: threading.Event) -> None:
        try:
            try:
                trainer_cpu.claim_trainer_thread(self.cpu_threads, self.nice)
            finally:
                claimed.set()
            if run.gate.stopped:
                self._finish(run, "cancelled" if run.cancelled else "stopped")
                return
            trainer = self._build(run.spec.path)
            stats = trainer.stats()
            with self._lock:
                baseline = (stats.tokens_seen, stats.samples_seen, stats.global_step)
                self._hand_over_locked(self.queue.built(run, trainer, baseline, time.monotonic()))
            logger.info("trainer started job %s (%d steps)", run.name, trainer.total_steps)
            outcome = trainer.run(run.gate, on_unit=self.on_unit)
            logger.info("trainer job %s %s at step %d", run.name, outcome, trainer.global_step)
            self._finish(run, "cancelled" if outcome == "stopped" and run.cancelled else outcome)
        except BaseException as exc:  # noqa: BLE001 - any trainer fault must leave decode serving
            error = f"{type(exc).__name__}: {exc}"
            with self._lock:
                run.error = self._error = error
            logger.error("trainer fault in job %s (serving continues, the job ended): %s\n%s", run.name, error,
                         traceback.format_exc())
            self._finish(run, "failed")
            if self.on_fault is not None:
                try:
                    self.on_fault(exc)
                except Exception:  # noqa: BLE001
                    logger.exception("trainer fault handler failed")

    def _finish(self, run: JobRun, outcome: str) -> None:
        with self._lock:
            self._hand_over_locked(self.queue.end(run, outcome, time.monotonic()))
            self._start_queued_locked()
            if not self.queue.any_built:
                self._restore_switch_interval()  # serving alone again: the interpreter's own interval
        if self.on_job_end is not None:
            try:
                self.on_job_end(run)
            except Exception:  # noqa: BLE001 - a hook's failure must not end the host
                logger.exception("job %s: the end-of-job hook failed", run.name)

    # -- sharing the trainer --------------------------------------------------------------
    def _unit_done(self, run: JobRun, seconds: float) -> None:
        """The active job's thread, after each unit: charge it; at the end of its slice,
        hand the trainer to the job the fair-share rule picks."""
        if not run.corun_checked and self.corun_check is not None:
            self._check_corun_units(run)
        with self._lock:
            handover = self.queue.unit_done(run, seconds, time.monotonic())
            if handover is None:
                return
            self._hand_over_locked(handover)
        # Its gate is closed: it parks at its next acquire. Its frozen-weight window in
        # lent memory goes now, for the next job's window.
        if getattr(run.trainer, "holds_lent_window", False):
            run.trainer.release_window()

    def _check_corun_units(self, run: JobRun) -> None:
        """Once the job has completed a step here: its mean non-padding tokens per
        micro-batch against the profile's co-run workload's (``corun_check``)."""
        trainer = run.trainer
        if trainer is None or trainer.global_step <= run.baseline[2]:
            return
        stats = trainer.stats()
        tokens, samples = stats.tokens_seen - run.baseline[0], stats.samples_seen - run.baseline[1]
        problem = None
        if tokens > 0 and samples > 0:
            problem = self.corun_check(tokens / samples * stats.micro_batch_size, f"job {run.name}")
        with self._lock:
            run.corun_checked, run.corun_mismatch = True, problem
        if problem is not None:
            logger.warning("profile: %s", problem)

    def _hand_over_locked(self, handover: Handover | None) -> None:
        """Carry out the queue's handover on the gates: the previous job parks, the target
        gets the trainer stream and runs when the scheduler and the operator let it."""
        if handover is None:
            return
        if handover.previous is not None:
            handover.previous.gate.pause()
        target = handover.target
        if target is None:
            self._starved_fn = None
            return
        target.gate.set_stream(self._stream)
        # Lock-free: the decode thread must never wait for a running unit.
        self._starved_fn = target.trainer.peek_next_unit_ready
        if self._scheduler_run and not self._operator_paused:
            target.gate.resume()

    def _restore_switch_interval(self) -> None:
        if self._saved_switch_interval is not None:
            sys.setswitchinterval(self._saved_switch_interval)
            self._saved_switch_interval = None

    # -- what the scheduler reads and decides (decode thread, every step) ---------------
    def scheduler_state(self) -> TrainerState:
        if self.queue.active is None:
            return self.queue.idle_state(self._operator_paused)
        if self._operator_paused:
            return TrainerState.PAUSED
        # Starved = running but its next stage is still being copied in (Harli (arXiv:2511.11729) §6.2: then
        # decode takes every SM this step). A parked trainer loads what it needs when it
        # runs, so it is runnable, not starved.
        ready = self._starved_fn
        if self._scheduler_run and ready is not None and not ready():
            return TrainerState.STARVED
        return TrainerState.RUNNING

    def next_phase(self) -> str | None:
        """"forward" or "backward" (the stage-2 model to use), None otherwise."""
        trainer = self.trainer
        if trainer is None:
            return None
        unit = trainer.peek_next_unit()
        if unit is None:
            return None
        return "forward" if unit.kind.value == "eval" else unit.kind.value  # evaluation runs forward passes

    def apply(self, run: bool, stream=None) -> None:
        run = run and not self._operator_paused
        if run:
            if stream is not self._stream or not self._scheduler_run:
                with self._lock:
                    active = self.queue.active
                    if stream is not self._stream:
                        self._stream = stream
                        if active is not None:
                            active.gate.set_stream(stream)
                    if not self._scheduler_run:
                        self._scheduler_run = True
                        if active is not None:
                            active.gate.resume()
        elif self._scheduler_run:
            with self._lock:
                self._scheduler_run = False
                if self.queue.active is not None:
                    self.queue.active.gate.pause()

    # -- operator ----------------------------------------------------------------------
    def operator_pause(self) -> None:
        self._operator_paused = True
        with self._lock:
            self._scheduler_run = False
            for run in self.runs:
                if run.gate is not None:
                    run.gate.pause()

    def operator_resume(self) -> None:
        self._operator_paused = False

    def operator_stop(self) -> None:
        """Every job checkpoints and ends; queued ones never start (signal-safe: the lock
        is reentrant and nothing here blocks)."""
        with self._lock:
            self.queue.stop()  # queued ones end as stopped
            for run in self.runs:
                if run.gate is not None:
                    run.gate.stop()

    @property
    def stopped(self) -> bool:
        return self.queue.stopped

    @property
    def live(self) -> bool:
        """Some job is queued, building or running."""
        return self.queue.any_live

    def status(self) -> HostStatus:
        with self._lock:
            queue = self.queue
            seen = (queue.active, queue.last_active, list(queue.runs), queue.shares(),
                    {name: queue.fair.deficit_s(name) for name in queue.fair.accounts}, self._error)
        state = self.scheduler_state()
        if state is TrainerState.RUNNING and not self._scheduler_run:
            state = TrainerState.PAUSED  # what it does now: no decision lets it run
        return host_status(*seen, state=state, operator_paused=self._operator_paused)
