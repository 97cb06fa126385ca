"""The server's finetune jobs, each on a background thread, behind the scheduler's gate.

The host owns the jobs' threads and everything the decode side needs from them:

- ``scheduler_state()``: what the QoS scheduler sees, in the one trainer-state vocabulary
  (:class:`~harvest.schedule.TrainerState`: absent, building, running, starved on a
  swap-in, paused by the operator, finished, stopped, failed);
- ``apply(run, stream)``: the per-step decision, as gate pause/resume and the trainer
  stream of the chosen SM level, for the job that holds the trainer; takes effect at its
  next unit boundary;
- a **job queue** (``harvest.yaml`` ``jobs``, and :meth:`submit` / :meth:`cancel` at run
  time): up to ``max_running`` jobs are built and share the trainer, one unit at a time,
  by the fair-share rule of :mod:`harvest.schedule.fair_share` (virtual trainer time per
  job weight, a quantum per slice, a starvation guard); the others wait in order;
- operator controls (pause / resume / stop, weights) and a status snapshot per job;
- fault isolation: any exception (an OOM included) in building or running a job ends that
  job with a checkpoint where possible, records the error and tells the runtime, which
  takes back all lent memory; decode keeps every SM while no job runs. Serving never stops.

Each job has a thread and a gate of its own. Only the job holding the trainer (the
*active* one) ever has its gate open; the others are parked at their gates with their
state kept (mid-step included). A slice ends at a unit boundary, on the ending job's own
thread (:meth:`_unit_done`): its gate closes before it asks for its next unit, so two
jobs never run a unit at once; it gives back its window of lent memory, which the next
job needs. Why threads and not one loop over the jobs: a job's ``run`` keeps its place
(gradients of a half-done step, its lent-memory follower) exactly as an operator's pause
does, with no new state in the trainer.

Two threads share the GIL. While a trainer runs, the interpreter's switch interval is
lowered (docs/design.md "Process model": the default 5 ms would let a busy trainer hold off a
decode step for an eighth of a 40 ms TPOT) and restored at shutdown. Each job's torch CPU
operations run on ``cpu_threads`` intra-op threads and its thread's priority is lowered
by ``nice``, on its own thread only (:mod:`harvest.train.trainer_cpu` says why).
"""

from __future__ import annotations

import dataclasses
import itertools
import sys
import threading
import time
import traceback
from pathlib import Path
from typing import Callable

from harvest import config_env
from harvest.logs import get_logger
from harvest.metrics.registry import ENDED_JOB_STATES
from harvest.schedule import TrainerState
from harvest.schedule.fair_share import DEFAULT_QUANTUM_S, DEFAULT_STARVATION_S, FairShare
from harvest.train import trainer_cpu
from harvest.train.gate import Gate
from harvest.train.trainer_cpu import DEFAULT_TRAINER_CPU_THREADS, DEFAULT_TRAINER_NICE

logger = get_logger(__name__)

CO_LOCATED_SWITCH_INTERVAL_S = 0.0005
DEFAULT_MAX_RUNNING = 4


class JobRefused(ValueError):
    """A submission, cancellation or weight change the queue refuses (the message says why)."""


@dataclasses.dataclass(frozen=True)
class JobSpec:
    """A job as the queue knows it before building it (harvest.train.job.JobIdentity fits)."""

    path: Path
    name: str
    weight: float = 1.0
    serve_as: str | None = None
    output_dir: Path | None = None


@dataclasses.dataclass(frozen=True)
class HostStatus:
    state: TrainerState
    job: str | None  # the job holding the trainer (or the last one that did)
    jobs_done: int
    jobs_total: int
    operator_paused: bool
    error: str | None  # the latest job fault
    stats: dict | None  # that job's harvest.train TrainerStats as a dict
    jobs: list = dataclasses.field(default_factory=list)  # one dict per job: JobRun.report()


class InjectedTrainerFault(RuntimeError):
    """Raised on purpose (HARVEST_FAULT_AFTER_UNITS) to test fault isolation."""


class _FaultInjectingGate:
    """Delegates to a gate; raises after ``after_units`` units (the tensor-parallel fault
    tests drive a trainer through it directly; a server's jobs inject through _JobGate)."""

    def __init__(self, gate, after_units: int):
        self._gate = gate
        self._remaining = after_units

    def acquire(self, while_parked=None):
        return self._gate.acquire(while_parked)

    def wake(self) -> None:
        self._gate.wake()

    def unit_done(self, record) -> None:
        self._gate.unit_done(record)
        self._remaining -= 1
        if self._remaining <= 0:
            raise InjectedTrainerFault("injected trainer fault after a unit (HARVEST_FAULT_AFTER_UNITS)")


class _JobGate(Gate):
    """A job's gate: charges each unit's trainer time to the job, at the unit boundary
    where the host may end its slice."""

    def __init__(self, on_unit_done: Callable[[float], None], fault_after_units: int | None = None):
        super().__init__()
        self._on_unit_done = on_unit_done
        self._acquired_at: float | None = None
        self._fault_after = fault_after_units

    def acquire(self, while_parked=None):
        decision = super().acquire(while_parked)
        self._acquired_at = time.monotonic()
        return decision

    def unit_done(self, record) -> None:
        if self._acquired_at is not None:
            self._on_unit_done(time.monotonic() - self._acquired_at)
            self._acquired_at = None
        if self._fault_after is not None:
            self._fault_after -= 1
            if self._fault_after <= 0:
                raise InjectedTrainerFault("injected trainer fault after a unit (HARVEST_FAULT_AFTER_UNITS)")


class JobRun:
    """One job in this host, from its submission to its end."""

    def __init__(self, instance: int, spec: JobSpec):
        self.instance = instance
        self.spec = spec
        self.name = spec.name
        self.weight = spec.weight
        self.state = "queued"  # queued | building | running | finished | stopped | cancelled | failed
        self.gate: _JobGate | None = None
        self.thread: threading.Thread | None = None
        self.trainer = None
        self.error: str | None = None
        self.submitted_at = time.time()
        self.started_at: float | None = None
        self.running_since: float | None = None  # monotonic, when its trainer was built
        self.ended_at: float | None = None
        self.trainer_s = 0.0  # trainer time charged to it
        self.cancelled = False
        self.baseline = (0, 0, 0)  # (tokens, samples, steps) when built: a resume starts counting from there
        self.adapter: dict | None = None  # its served adapter: {"name", "state", "error"} (the runtime sets it)

    @property
    def ended(self) -> bool:
        return self.state in ENDED_JOB_STATES

    def report(self, *, active: bool, host_paused: bool, starved: bool, share: float, deficit_s: float) -> dict:
        """The job's line of ``/harvest/status`` (and the metrics' ``set_jobs``)."""
        trainer = self.trainer
        stats = trainer.stats() if trainer is not None else None
        state = self.state
        if state == "running":
            state = "paused" if host_paused else "starved" if active and starved else "running"
        total = stats.total_steps if stats is not None else None
        step = stats.global_step if stats is not None else 0
        progress = (step / total) if total else (1.0 if self.state == "finished" else 0.0)
        eta_s = None
        fleet = stats.fleet if stats is not None else None
        steps_trained = max(0, step - self.baseline[2])
        if fleet is not None and fleet["sync"] == "periodic":
            # The progress is the fleet's: this server trained only its own steps of it, and
            # the ETA is the fleet's pace since this member joined.
            steps_trained, eta_s = fleet["steps_trained"], fleet["eta_s"] if not self.ended else None
        elif stats is not None and self.running_since is not None and not self.ended and step > self.baseline[2]:
            elapsed = time.monotonic() - self.running_since
            eta_s = elapsed / (step - self.baseline[2]) * (total - step)
        tokens, samples = (stats.tokens_seen, stats.samples_seen) if stats is not None else (0, 0)
        return {
            "instance": self.instance, "name": self.name, "path": str(self.spec.path), "state": state,
            "active": active, "weight": self.weight, "serve_as": self.spec.serve_as,
            "output_dir": str(self.spec.output_dir) if self.spec.output_dir is not None else None,
            "global_step": step, "total_steps": total, "progress": progress, "eta_s": eta_s,
            # the newest checkpoint on disk (what `harvest ctl publish` serves of a running job):
            # global_step counts a step before its due checkpoint is written
            "checkpoint_step": stats.checkpoint_step if stats is not None else None,
            "loss": stats.loss if stats is not None else None,
            "eval_loss": stats.eval_loss if stats is not None else None,
            "tokens_seen": tokens, "samples_seen": samples,
            "tokens_trained": max(0, tokens - self.baseline[0]), "samples_trained": max(0, samples - self.baseline[1]),
            "steps_trained": steps_trained,
            "trainer_s": round(self.trainer_s, 6), "share": share, "deficit_s": deficit_s,
            "submitted_at": self.submitted_at, "started_at": self.started_at, "ended_at": self.ended_at,
            "adapter": dict(self.adapter) if self.adapter is not None else None, "error": self.error,
            "fleet": fleet,
        }


class TrainerHost:
    def __init__(self, jobs: list, *, build: Callable, on_fault: Callable[[BaseException], None] | None = None,
                 on_unit: Callable[[object], None] | None = None, switch_interval_s: float = CO_LOCATED_SWITCH_INTERVAL_S,
                 cpu_threads: int = DEFAULT_TRAINER_CPU_THREADS, nice: int = DEFAULT_TRAINER_NICE,
                 tp_rank: int = 0, max_running: int = DEFAULT_MAX_RUNNING, quantum_s: float = DEFAULT_QUANTUM_S,
                 starvation_s: float = DEFAULT_STARVATION_S, on_job_end: Callable[[JobRun], None] | None = None):
        """``jobs``: :class:`JobSpec` (or job paths, named after the file). ``build(job_path)
        -> LayerSplitTrainer`` runs on the job's thread (loading a model and dataset takes
        seconds; neither the server nor the other jobs wait for it). ``on_unit(record)``
        runs on the trainer's thread after every unit: background work (the predictor's
        refit) belongs there, not on the decode thread. ``on_job_end(run)`` runs on the
        job's thread when it ends (finished, stopped, cancelled, failed)."""
        self._build = build
        self.on_fault = on_fault
        self.on_unit = on_unit
        self.on_job_end = on_job_end
        self._switch_interval_s = switch_interval_s
        self.cpu_threads = cpu_threads
        self.nice = nice
        self.tp_rank = tp_rank  # this process's tensor-parallel rank (0 without tensor parallelism)
        self.max_running = max_running
        self.fair = FairShare(quantum_s, starvation_s)
        self._instances = itertools.count(1)
        self.runs: list[JobRun] = []
        for job in jobs:
            self._add(job if isinstance(job, JobSpec) else _spec_of_path(job))
        self._lock = threading.RLock()  # RLock: a signal handler on the decode thread may stop the jobs
        self._active: JobRun | None = None
        self._last_active: JobRun | None = None
        self._operator_paused = False
        self._stopped = False
        self._scheduler_run = False
        self._stream = None
        self._started = False
        self._serving_threads: int | None = None
        self._saved_switch_interval: float | None = None
        self._error: str | None = None
        # Resolved per switch: scheduler_state() runs before every decode step.
        self._starved_fn = None

    @property
    def job_paths(self) -> list[Path]:
        return [run.spec.path for run in self.runs]

    @property
    def trainer(self):
        """The trainer of the job holding the trainer (or the last that held it)."""
        run = self._active or self._last_active
        return run.trainer if run is not None else None

    @property
    def gate(self) -> Gate | None:
        """The gate of the job holding the trainer (or the last that held it, or the first)."""
        run = self._active or self._last_active or (self.runs[0] if self.runs else None)
        return run.gate if run is not None else None

    # -- lifecycle --------------------------------------------------------------------
    def start(self) -> None:
        """On the serving thread: start the first ``max_running`` jobs."""
        with self._lock:
            if self._started:
                return
            self._started = True
            self._serving_threads = trainer_cpu.process_default()
            self._fill_locked()

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

    # -- the queue --------------------------------------------------------------------
    def submit(self, spec: JobSpec) -> JobRun:
        """Queue a job at run time (any thread); it starts when fewer than ``max_running``
        jobs are built. Refused (JobRefused) after a stop, or when its name or output
        folder is a live job's."""
        with self._lock:
            if self._stopped:
                raise JobRefused("the trainer has been stopped: no more jobs run until the server restarts")
            run = self._add(spec)
            logger.info("job %s queued (%s, weight %g)", run.name, spec.path, spec.weight)
            if self._started:
                self._fill_locked()
            return run

    def cancel(self, name: str) -> JobRun:
        """Cancel the live job ``name``: a queued one never starts; a building or running one
        checkpoints and ends at its next unit boundary (its output folder keeps the
        checkpoint: resubmitting resumes it)."""
        with self._lock:
            run = self._live(name)
            run.cancelled = True
            if run.state == "queued":
                self._end_locked(run, "cancelled")
                self._fill_locked()
            else:
                run.gate.stop()
            logger.info("job %s cancelled", name)
            return run

    def set_weight(self, name: str, weight: float) -> JobRun:
        with self._lock:
            run = self._live(name)
            if name in self.fair.accounts:
                self.fair.set_weight(name, weight)  # raises ValueError for a bad weight
            elif not (isinstance(weight, (int, float)) and not isinstance(weight, bool) and 0 < weight < float("inf")):
                raise JobRefused(f"job {name!r}: weight must be a positive number, got {weight!r}")
            logger.info("job %s: weight %g -> %g", name, run.weight, weight)
            run.weight = float(weight)
            return run

    def _add(self, spec: JobSpec) -> JobRun:
        for other in self.runs:
            if other.ended:
                continue
            clash = spec_clash(spec, other.spec)
            if clash == "name":
                raise JobRefused(f"a job named {spec.name!r} is already {other.state}; cancel it first or name this "
                                 "one differently (harvest: {name: ...})")
            if clash is not None:
                raise JobRefused(f"job {spec.name!r}: {clash} is the output_dir of job "
                                 f"{other.name!r} ({other.state}); two jobs would overwrite each other's checkpoints")
        run = JobRun(next(self._instances), spec)
        self.runs.append(run)
        return run

    def _live(self, name: str) -> JobRun:
        for run in self.runs:
            if run.name == name and not run.ended:
                return run
        known = sorted({run.name for run in self.runs if not run.ended})
        raise JobRefused(f"no live job named {name!r}" + (f" (live: {', '.join(known)})" if known else " (none is live)"))

    def _fill_locked(self) -> None:
        """Start queued jobs while fewer than ``max_running`` are building or running."""
        live = sum(run.state in ("building", "running") for run in self.runs)
        for run in self.runs:
            if live >= self.max_running or self._stopped:
                return
            if run.state == "queued":
                self._start_run_locked(run)
                live += 1

    def _start_run_locked(self, run: JobRun) -> None:
        fault_after = config_env.fault_after_units()
        if config_env.fault_rank() not in (None, self.tp_rank):
            fault_after = None
        run.gate = _JobGate(lambda seconds, run=run: self._unit_done(run, seconds), fault_after)
        run.gate.pause()  # opened when it holds the trainer and the scheduler lets it run
        run.state, run.started_at = "building", time.time()
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
                run.trainer = trainer
                run.baseline = (stats.tokens_seen, stats.samples_seen, stats.global_step)
                run.running_since = time.monotonic()
                run.state = "running"
                self.fair.add(run.name, run.weight)
                self.fair.set_runnable(run.name, True, time.monotonic())
                if self._active is None:
                    self._switch_locked(self.fair.next_slice(time.monotonic()))
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
            self._end_locked(run, outcome)
            self._fill_locked()
            if not any(other.state in ("building", "running") for other in self.runs):
                self._restore_switch_interval()  # serving alone again: the interpreter's own interval
        if self.on_job_end is not None:
            try:
                self.on_job_end(run)
            except Exception:  # noqa: BLE001 - a hook's failure must not end the host
                logger.exception("job %s: the end-of-job hook failed", run.name)

    def _end_locked(self, run: JobRun, outcome: str) -> None:
        was_sharing = run.state == "running"  # a name is live at most once: its account is this run's
        run.state, run.ended_at = outcome, time.time()
        if was_sharing:
            self.fair.remove(run.name)
        if self._active is run:
            self._active = None
            self._starved_fn = None
            self._switch_locked(self.fair.next_slice(time.monotonic()))

    # -- sharing the trainer --------------------------------------------------------------
    def _unit_done(self, run: JobRun, seconds: float) -> None:
        """The active job's thread, after each unit: charge it; at the end of its slice,
        hand the trainer to the job the fair-share rule picks."""
        with self._lock:
            run.trainer_s += seconds
            self.fair.charge(run.name, seconds)
            if len(self.fair.accounts) < 2 or self._active is not run:
                return
            chosen = self.fair.next_slice(time.monotonic())
            if chosen == run.name:
                return
            self._switch_locked(chosen)
        # Its gate is closed: it parks at its next acquire. Its frozen-weight window in
        # lent memory goes now, for the next job's window.
        if getattr(run.trainer, "holds_lent_window", False):
            run.trainer.release_window()

    def _switch_locked(self, name: str | None) -> None:
        previous = self._active
        target = next((r for r in self.runs if r.name == name and r.state == "running"), None) if name else None
        if previous is target:
            return
        if previous is not None:
            previous.gate.pause()
        if name is not None and self.fair.running != name:
            self.fair.switch_to(name, time.monotonic())
        self._active = target
        if target is None:
            self._starved_fn = None
            return
        self._last_active = target
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
        active = self._active
        if active is None:
            return self._idle_state()
        if self._operator_paused:
            return TrainerState.PAUSED
        # Starved = running but its next stage is still being copied in (Harli (arXiv:2511.11729) §6.2: then
        # decode takes every SM this step). A parked trainer loads what it needs when it
        # runs, so it is runnable, not starved.
        ready = self._starved_fn
        if self._scheduler_run and ready is not None and not ready():
            return TrainerState.STARVED
        return TrainerState.RUNNING

    def _idle_state(self) -> TrainerState:
        """No job holds the trainer: one is building, or none is live."""
        runs = self.runs
        if not runs:
            return TrainerState.ABSENT
        if any(run.state in ("building", "running", "queued") for run in runs):
            return TrainerState.PAUSED if self._operator_paused else TrainerState.BUILDING
        if self._stopped:
            return TrainerState.STOPPED
        last = max(runs, key=lambda run: run.ended_at or 0.0)
        return {"failed": TrainerState.FAILED, "finished": TrainerState.FINISHED}.get(last.state, TrainerState.STOPPED)

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
                    active = self._active
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
                if self._active is not None:
                    self._active.gate.pause()

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
            self._stopped = True
            for run in self.runs:
                if run.gate is not None:
                    run.gate.stop()
                elif run.state == "queued":
                    run.state, run.ended_at = "stopped", time.time()

    @property
    def stopped(self) -> bool:
        return self._stopped

    @property
    def live(self) -> bool:
        """Some job is queued, building or running."""
        return any(run.state in ("queued", "building", "running") for run in self.runs)

    def status(self) -> HostStatus:
        with self._lock:
            active, last = self._active, self._last_active
            runs = list(self.runs)
            error = self._error
            shares = self._shares_locked()
            deficits = {name: self.fair.deficit_s(name) for name in self.fair.accounts}
        state = self.scheduler_state()
        if state is TrainerState.RUNNING and not self._scheduler_run:
            state = TrainerState.PAUSED  # what it does now: no decision lets it run
        host_paused = self._operator_paused
        starved = state is TrainerState.STARVED
        jobs = [run.report(active=run is active, host_paused=host_paused and not run.ended, starved=starved,
                           share=shares.get(run.instance, 0.0),
                           deficit_s=deficits.get(run.name, 0.0) if run.state == "running" else 0.0)
                for run in runs]
        shown = active or last
        trainer = shown.trainer if shown is not None else None
        return HostStatus(
            state=state, job=shown.name if shown is not None else None,
            jobs_done=sum(run.state == "finished" for run in runs), jobs_total=len(runs),
            operator_paused=self._operator_paused, error=error,
            stats=dataclasses.asdict(trainer.stats()) if trainer is not None else None, jobs=jobs,
        )

    def _shares_locked(self) -> dict[int, float]:
        """Each job's share of the trainer time charged to the jobs that are running now."""
        running = [run for run in self.runs if run.state == "running"]
        total = sum(run.trainer_s for run in running)
        return {run.instance: (run.trainer_s / total if total > 0 else 0.0) for run in running}


def spec_clash(spec: JobSpec, other: JobSpec) -> str | None:
    """What two jobs that live at once must not share, as a message names it: ``"name"``
    (status, ctl and metrics address a job by it) or ``"output_dir <path>"`` (each would
    overwrite the other's checkpoints); None when they share neither."""
    if spec.name == other.name:
        return "name"
    if spec.output_dir is not None and other.output_dir is not None \
            and Path(spec.output_dir).resolve() == Path(other.output_dir).resolve():
        return f"output_dir {spec.output_dir}"
    return None


def _spec_of_path(path) -> JobSpec:
    """A job given as a bare path (tests, harnesses): named after its file."""
    path = Path(path)
    return JobSpec(path=path, name=path.name.removesuffix(".yaml").removesuffix(".yml") or str(path))
