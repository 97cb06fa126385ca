"""The gate between trainer units: how the scheduler runs, pauses and stops the trainer.

The trainer calls `acquire()` before every unit (one stage of one micro-batch, forward or
backward, or the optimizer update). The scheduler decides through the gate; the decode
step never waits on the trainer except for at most one unit when it pauses it.
"""

from __future__ import annotations

import abc
import dataclasses
import enum
import threading
import time
from typing import Any, Callable


class GateAction(str, enum.Enum):
    RUN = "run"
    STOP = "stop"


@dataclasses.dataclass(frozen=True)
class GateDecision:
    action: GateAction
    stream: Any = None  # the CUDA stream to run the unit on; None: the thread's current stream
    was_paused: bool = False  # acquire() blocked before returning this decision
    paused_s: float = 0.0  # for how long


class BaseGate(abc.ABC):
    """Owned by the scheduler; consulted by the trainer thread between units.

    Contract:
    - `acquire()` is called by the trainer thread at every unit boundary, and only there.
      It returns when the trainer may go on: `RUN` with the stream for the next unit, or
      `STOP`. While the scheduler wants the trainer paused, `acquire()` blocks; the
      trainer keeps all its state (activations, partial gradients, window) and resumes at
      exactly the unit it stopped before, mid-backward included.
    - After `STOP` the trainer writes a checkpoint and returns from its loop; it does not
      call `acquire()` again.
    - `unit_done(record)` is called after every unit with its `UnitRecord` (for the
      scheduler's measurements); it must return quickly. Default: nothing.
    - `wake()` may be called from any thread when something a parked trainer must handle
      now has changed (lent memory wanted back): a blocked `acquire(while_parked)` then
      runs `while_parked()` on the trainer thread, outside the gate's lock, and blocks
      again. A gate that never blocks may ignore it (the default).
    - Implementations' control methods are called from other threads: thread-safe.
    """

    @abc.abstractmethod
    def acquire(self, while_parked: Callable[[], None] | None = None) -> GateDecision:
        """Block while paused (running `while_parked` after each `wake()`); then say
        whether (and on which stream) to run the next unit."""

    def unit_done(self, record) -> None:  # noqa: B027 - optional hook
        """Called after each unit with its record."""

    def wake(self) -> None:  # noqa: B027 - a gate that never blocks has nothing to wake
        """Make a trainer blocked in `acquire` run its `while_parked` now."""


class Gate(BaseGate):
    """A thread-safe gate with pause / resume / stop and a settable stream.

    Starts in the running state, so a standalone trainer just runs.
    """

    def __init__(self, stream: Any = None):
        self._cond = threading.Condition()
        self._paused = False
        self._stopped = False
        self._stream = stream
        self._parked = False  # the trainer thread is blocked in acquire()
        self._wake_pending = False  # wake() since the parked trainer last ran while_parked
        self.num_pauses = 0

    def pause(self) -> None:
        with self._cond:
            self._paused = True
            self._cond.notify_all()

    def resume(self) -> None:
        with self._cond:
            self._paused = False
            self._cond.notify_all()

    def stop(self) -> None:
        """Ask the trainer to checkpoint and leave its loop at the next unit boundary."""
        with self._cond:
            self._stopped = True
            self._cond.notify_all()

    def wake(self) -> None:
        with self._cond:
            self._wake_pending = True
            self._cond.notify_all()

    def set_stream(self, stream: Any) -> None:
        with self._cond:
            self._stream = stream

    @property
    def paused(self) -> bool:
        return self._paused

    @property
    def stopped(self) -> bool:
        return self._stopped

    def wait_until_parked(self, timeout: float) -> bool:
        """Wait until the trainer thread is blocked at this gate; False on timeout."""
        deadline = time.monotonic() + timeout
        with self._cond:
            while not self._parked:
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    return False
                self._cond.wait(remaining)
            return True

    def acquire(self, while_parked: Callable[[], None] | None = None) -> GateDecision:
        with self._cond:
            if not self._paused or self._stopped:
                self._wake_pending = False  # a running trainer handles it at this boundary anyway
                return self._decision_locked(False, 0.0)
            started = time.monotonic()
            self.num_pauses += 1
            self._parked = True
            self._cond.notify_all()
            try:
                while self._paused and not self._stopped:
                    if self._wake_pending:
                        self._wake_pending = False
                        if while_parked is not None:
                            # Outside the lock: the callback takes the trainer's unit lock,
                            # and the scheduler must be able to resume or stop meanwhile.
                            self._cond.release()
                            try:
                                while_parked()
                            finally:
                                self._cond.acquire()
                        continue
                    self._cond.wait()
            finally:
                self._parked = False
            return self._decision_locked(True, time.monotonic() - started)

    def _decision_locked(self, was_paused: bool, paused_s: float) -> GateDecision:
        action = GateAction.STOP if self._stopped else GateAction.RUN
        return GateDecision(action, self._stream, was_paused, paused_s)
