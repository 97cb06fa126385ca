"""Checkpoint the trainer when the scheduler process is told to stop.

SGLang 0.5.23 stops a scheduler process in one of three ways:

- Graceful: SIGTERM to the server's main process only (``kill <pid>``, Kubernetes,
  ``docker stop``). It drains requests and sends the scheduler a ``ShutdownReq``; the
  scheduler leaves its loop and the process exits normally, so the runtime's ``atexit``
  hook stops the trainer, which checkpoints (within SGLang's 15 s grace period).
- A signal to the whole process group (Ctrl-C, ``kill -TERM -<pgid>``, systemd's
  control-group kill): the scheduler gets SIGINT or SIGTERM itself, whose default is to
  die at once. :class:`SignalCheckpoint` catches them: the trainer is asked to stop (it
  checkpoints at its next unit boundary), serving goes on meanwhile, and once the trainer
  is done (or ``timeout_s`` passed) the scheduler thread puts SGLang's handler back and
  raises the signal again, so what SGLang did before follows unchanged, only later.
- SIGKILL (after the grace period, or the parent dying: ``PR_SET_PDEATHSIG``): nothing
  runs; the last periodic checkpoint (the job's ``save_steps``) is what remains.

With tensor parallelism every rank's scheduler gets the group's signal, and the trainers
stop together (a collective checkpoint that rank 0 writes). A rank passes its signal on
only once every rank's trainer has ended (``peers_ended``, from the ranks' step exchange):
a rank that died first would break its peers' collectives, and SGLang answers a scheduler
that fails with SIGKILL to the whole server, rank 0's checkpoint write included. The ranks
see the same exchange, so they pass the signal on at the same point of the same tick.

SGLang's main process takes any child's end for a crash and SIGKILLs the whole server
within a second (its ``SubprocessWatchdog``), and on a group signal the detokenizer ends
at once: the schedulers' checkpoints would race that kill (and lose it on a loaded
machine or with a slow write). :class:`SchedulersFirst`, in the main process, holds that
check back while a child that ended *of a stop signal* has a scheduler still running,
for at most :data:`SCHEDULER_STOP_GRACE_S`; a child that crashed is acted on at once,
as before.

The handler runs on the scheduler's main thread between two bytecodes, anywhere in the
event loop, so it only sets flags (the gate's lock is re-entrant); the waiting and the
re-raise happen in :meth:`poll`, called from the scheduler thread at its next step or
idle tick.
"""

from __future__ import annotations

import signal
import threading
import time

from harvest.logs import get_logger

logger = get_logger(__name__)

SIGNALS = (signal.SIGTERM, signal.SIGINT)
# multiprocessing's exit code of a child that a stop signal ended
STOP_EXIT_CODES = tuple(-signum for signum in SIGNALS)
# A scheduler waits up to SignalCheckpoint.timeout_s (10 s) for its trainer, then ends.
SCHEDULER_STOP_GRACE_S = 15.0


class SignalCheckpoint:
    def __init__(self, trainer_host, on_signal, timeout_s: float = 10.0, peers_ended=None):
        """``on_signal()`` tells the scheduler thread to call :meth:`poll` soon;
        ``peers_ended()`` (tensor-parallel) says whether every rank's trainer has ended."""
        self.trainer_host = trainer_host
        self.on_signal = on_signal
        self.timeout_s = timeout_s
        self.peers_ended = peers_ended
        self._previous: dict[int, object] = {}
        self._signum: int | None = None
        self._deadline = 0.0

    def install(self) -> bool:
        """Take over SIGTERM and SIGINT (main thread only; False elsewhere)."""
        if threading.current_thread() is not threading.main_thread():
            logger.warning("not on the main thread: a signal to the scheduler will not checkpoint the trainer")
            return False
        for signum in SIGNALS:
            self._previous[signum] = signal.signal(signum, self._handle)
        return True

    @property
    def pending(self) -> bool:
        return self._signum is not None

    def _handle(self, signum, frame) -> None:
        if self._signum is not None:  # a second signal: do not wait any longer
            self._deadline = 0.0
            return
        self._signum = signum
        self._deadline = time.monotonic() + self.timeout_s
        self.trainer_host.operator_stop()  # every job checkpoints and ends
        self.on_signal()

    def poll(self) -> None:
        """Scheduler thread: once the trainer has checkpointed and stopped (or the wait
        is over), hand the signal to the handler SGLang had."""
        signum = self._signum
        if signum is None:
            return
        done = self.trainer_host.join(0)
        peers_done = self.peers_ended is None or self.peers_ended()
        if not (done and peers_done) and time.monotonic() < self._deadline:
            return
        name = signal.Signals(signum).name
        if done and peers_done:
            logger.info("%s: the trainer checkpointed and stopped%s; passing the signal on", name,
                        "" if self.peers_ended is None else " on every rank")
        elif done:
            logger.error("%s: another rank's trainer did not stop within %.0f s; passing the signal on", name,
                         self.timeout_s)
        else:
            logger.error("%s: the trainer did not stop within %.0f s; passing the signal on without its checkpoint",
                         name, self.timeout_s)
        self.uninstall()
        self._signum = None  # passed on once: a handler that returns must not get it every tick
        signal.raise_signal(signum)

    def uninstall(self) -> None:
        for signum, previous in self._previous.items():
            signal.signal(signum, signal.SIG_DFL if previous is None else previous)  # None: set outside Python
        self._previous.clear()


class SchedulersFirst:
    """Main process: whether SGLang's child watchdog should wait before it takes a child's
    end for a crash (and kills the server): while every child that ended was ended by a
    stop signal and a scheduler still runs, up to ``grace_s``."""

    def __init__(self, grace_s: float = SCHEDULER_STOP_GRACE_S, clock=time.monotonic):
        self.grace_s = grace_s
        self.clock = clock
        self._since: float | None = None

    def hold(self, processes, names) -> bool:
        ended = [proc.exitcode for proc in processes if not proc.is_alive() and proc.exitcode != 0]
        if not ended or any(code not in STOP_EXIT_CODES for code in ended):
            return False  # nothing ended, or a crash: SGLang's check as it is
        if not any(proc.is_alive() for proc, name in zip(processes, names) if str(name).startswith("scheduler")):
            return False  # every scheduler is done: the server may go
        now = self.clock()
        if self._since is None:
            self._since = now
            logger.info("a server process ended of a stop signal: waiting up to %.0f s for the schedulers to "
                        "checkpoint their trainers before the server is taken down", self.grace_s)
        return now - self._since < self.grace_s
