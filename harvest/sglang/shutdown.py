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


class SignalCheckpoint:
    def __init__(self, trainer_host, on_signal, timeout_s: float = 10.0):
        """``on_signal()`` tells the scheduler thread to call :meth:`poll` soon."""
        self.trainer_host = trainer_host
        self.on_signal = on_signal
        self.timeout_s = timeout_s
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
        if not done and time.monotonic() < self._deadline:
            return
        name = signal.Signals(signum).name
        if done:
            logger.info("%s: the trainer checkpointed and stopped; passing the signal on", name)
        else:
            logger.error("%s: the trainer did not stop within %.0f s; passing the signal on without its checkpoint",
                         name, self.timeout_s)
        self.uninstall()
        signal.raise_signal(signum)

    def uninstall(self) -> None:
        for signum, previous in self._previous.items():
            signal.signal(signum, signal.SIG_DFL if previous is None else previous)  # None: set outside Python
        self._previous.clear()
