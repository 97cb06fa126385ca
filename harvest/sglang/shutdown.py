"""Checkpoint the trainer when the scheduler process is told to stop.

:class:`SignalCheckpoint` (in the scheduler) turns SIGINT/SIGTERM into a trainer stop
request; once the trainer has checkpointed (on every rank, with tensor parallelism) or
``timeout_s`` passed, SGLang's own handler is put back and the signal raised again, so
SGLang's behaviour follows unchanged, only later. The handler only sets flags; the waiting
and the re-raise happen in :meth:`SignalCheckpoint.poll` on the scheduler thread.
:class:`SchedulersFirst` (in SGLang's main process) holds back its child watchdog while a
child that ended of a stop signal has a scheduler still running, at most
:data:`SCHEDULER_STOP_GRACE_S`.

Rules: docs/sglang-integration.md, 'Stopping the server (harvest/sglang/shutdown.py)'.
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
