"""The finetune job(s) on a background thread, behind the scheduler's gate.

The host owns the trainer thread and everything the decode side needs from it:

- ``scheduler_state()``: what the QoS scheduler sees, in the one trainer-state vocabulary
  (:class:`~harvest.schedule.TrainerState`: absent, building, running, starved on a
  swap-in, paused by the operator, finished, stopped, failed);
- ``apply(run, stream)``: the per-step decision, as gate pause/resume and the trainer
  stream of the chosen SM level; takes effect at the trainer's next unit boundary;
- operator controls (pause / resume / stop) and a stats snapshot for metrics and status;
- fault isolation: any exception (an OOM included) in building or running a job stops the
  trainer with a checkpoint where possible, records the error and returns control, so
  decode keeps every SM and the runtime takes back all lent memory. Serving never stops.

Two threads share the GIL. While the trainer runs, the interpreter's switch interval is
lowered (DESIGN.md "Process model": the default 5 ms would let a busy trainer hold off a
decode step for an eighth of a 40 ms TPOT) and restored when it ends. The trainer's torch
CPU operations run on ``cpu_threads`` intra-op threads and its thread's priority is lowered
by ``nice``, both on its own thread only (:mod:`harvest.train.trainer_cpu` says why).
"""

from __future__ import annotations

import dataclasses
import sys
import threading
import traceback
from pathlib import Path
from typing import Callable

from harvest import config_env
from harvest.logs import get_logger
from harvest.schedule import TrainerState
from harvest.train import trainer_cpu
from harvest.train.trainer_cpu import DEFAULT_TRAINER_CPU_THREADS, DEFAULT_TRAINER_NICE

logger = get_logger(__name__)

CO_LOCATED_SWITCH_INTERVAL_S = 0.0005


@dataclasses.dataclass(frozen=True)
class HostStatus:
    state: TrainerState
    job: str | None
    jobs_done: int
    jobs_total: int
    operator_paused: bool
    error: str | None
    stats: dict | None  # harvest.train TrainerStats as a dict


class InjectedTrainerFault(RuntimeError):
    """Raised on purpose (HARVEST_FAULT_AFTER_UNITS) to test fault isolation."""


class _FaultInjectingGate:
    """Delegates to the real gate; raises after ``after_units`` units (test knob)."""

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


class TrainerHost:
    def __init__(self, job_paths: list[Path], *, build: Callable, on_fault: Callable[[BaseException], None] | None = None,
                 on_unit: Callable[[object], None] | None = None, switch_interval_s: float = CO_LOCATED_SWITCH_INTERVAL_S,
                 cpu_threads: int = DEFAULT_TRAINER_CPU_THREADS, nice: int = DEFAULT_TRAINER_NICE,
                 tp_rank: int = 0):
        """``build(job_path) -> LayerSplitTrainer`` runs on the trainer thread (loading a
        model and dataset takes seconds; start-up of the server does not wait for it).
        ``on_unit(record)`` runs on the trainer thread after every unit: background work
        (the predictor's refit) belongs there, not on the decode thread."""
        from harvest.train.gate import Gate

        self.job_paths = list(job_paths)
        self._build = build
        self.on_fault = on_fault
        self.on_unit = on_unit
        self._switch_interval_s = switch_interval_s
        self.cpu_threads = cpu_threads
        self.nice = nice
        self.tp_rank = tp_rank  # this process's tensor-parallel rank (0 without tensor parallelism)
        self._threads_limited = threading.Event()
        self.gate = Gate()
        self.gate.pause()  # the scheduler opens it with its first decision
        self.trainer = None
        self._state = TrainerState.ABSENT if not self.job_paths else TrainerState.BUILDING
        self._job: str | None = None
        self._jobs_done = 0
        self._error: str | None = None
        self._operator_paused = False
        self._scheduler_run = False
        self._stream = None
        self._lock = threading.Lock()
        self._thread: threading.Thread | None = None
        self._saved_switch_interval: float | None = None
        # Resolved once: scheduler_state() runs before every decode step.
        self._starved_fn = None

    # -- lifecycle --------------------------------------------------------------------
    def start(self) -> None:
        if not self.job_paths or self._thread is not None:
            return
        self._saved_switch_interval = sys.getswitchinterval()
        sys.setswitchinterval(self._switch_interval_s)
        serving_threads = trainer_cpu.process_default()
        self._thread = threading.Thread(target=self._main, name="harvest-trainer", daemon=True)
        self._thread.start()
        # The trainer thread limits its own CPU threads first thing (microseconds); then
        # the process default goes back to what the serving threads use.
        if not self._threads_limited.wait(30.0):
            logger.warning("trainer thread did not start within 30 s")
        trainer_cpu.restore_process_default(serving_threads)

    def shutdown(self, timeout_s: float = 60.0) -> None:
        """Stop the trainer (it checkpoints first) and wait for the thread."""
        self.gate.stop()
        if self._thread is not None:
            self._thread.join(timeout_s)
            if self._thread.is_alive():
                logger.error("trainer did not stop within %.0fs", timeout_s)
        self._restore_switch_interval()

    def join(self, timeout_s: float | None = None) -> bool:
        if self._thread is not None:
            self._thread.join(timeout_s)
            return not self._thread.is_alive()
        return True

    def _main(self) -> None:
        try:
            try:
                trainer_cpu.claim_trainer_thread(self.cpu_threads, self.nice)
            finally:
                self._threads_limited.set()
            for path in self.job_paths:
                if self.gate.stopped:
                    break
                with self._lock:
                    self._job, self._state = str(path), TrainerState.BUILDING
                trainer = self._build(path)
                with self._lock:
                    self.trainer = trainer
                    # Lock-free: the decode thread must never wait for a running unit.
                    self._starved_fn = trainer.peek_next_unit_ready
                    self._state = TrainerState.RUNNING
                logger.info("trainer started job %s (%d steps)", path, trainer.total_steps)
                fault_after = config_env.fault_after_units()
                if config_env.fault_rank() not in (None, self.tp_rank):
                    fault_after = None
                gate = self.gate if fault_after is None else _FaultInjectingGate(self.gate, fault_after)
                outcome = trainer.run(gate, on_unit=self.on_unit)
                logger.info("trainer job %s %s at step %d", path, outcome, trainer.global_step)
                with self._lock:
                    self._state = TrainerState(outcome)  # the trainer's run(): "finished" or "stopped"
                    self._jobs_done += self._state is TrainerState.FINISHED
                    self._starved_fn = None
                if self._state is TrainerState.STOPPED:
                    break
        except BaseException as exc:  # noqa: BLE001 - any trainer fault must leave decode serving
            with self._lock:
                self._state = TrainerState.FAILED
                self._starved_fn = None
                self._error = f"{type(exc).__name__}: {exc}"
            logger.error("trainer fault (serving continues, trainer stopped): %s\n%s", self._error, traceback.format_exc())
            if self.on_fault is not None:
                try:
                    self.on_fault(exc)
                except Exception:  # noqa: BLE001
                    logger.exception("trainer fault handler failed")
        finally:
            self._restore_switch_interval()

    def _restore_switch_interval(self) -> None:
        if self._saved_switch_interval is not None:
            sys.setswitchinterval(self._saved_switch_interval)
            self._saved_switch_interval = None

    # -- what the scheduler reads and decides (decode thread, every step) ---------------
    def scheduler_state(self) -> TrainerState:
        state = self._state
        if state is not TrainerState.RUNNING:
            return state
        if self._operator_paused:
            return TrainerState.PAUSED
        # Starved = running but its next stage is still being copied in (Harli §6.2: then
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
            if stream is not self._stream:
                self.gate.set_stream(stream)
                self._stream = stream
            if not self._scheduler_run:
                self.gate.resume()
        elif self._scheduler_run:
            self.gate.pause()
        self._scheduler_run = run

    # -- operator ----------------------------------------------------------------------
    def operator_pause(self) -> None:
        self._operator_paused = True
        self.apply(False)

    def operator_resume(self) -> None:
        self._operator_paused = False

    def operator_stop(self) -> None:
        self.gate.stop()

    def status(self) -> HostStatus:
        trainer = self.trainer
        with self._lock:
            state, job, done, error = self._state, self._job, self._jobs_done, self._error
        if state is TrainerState.RUNNING:  # what it does now: let run, parked, or waiting on a swap-in
            state = TrainerState.PAUSED if self._operator_paused or not self._scheduler_run else self.scheduler_state()
        return HostStatus(
            state=state, job=job, jobs_done=done, jobs_total=len(self.job_paths),
            operator_paused=self._operator_paused, error=error,
            stats=dataclasses.asdict(trainer.stats()) if trainer is not None else None,
        )
