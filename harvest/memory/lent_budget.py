"""What the memory side lends the trainer and what it wants back, published one way.

The serving side (``harvest.sglang.kv_lending``) lends whole free KV chunks and takes
them back; the trainer's frozen-weight window lives in that lent memory. The two meet
here, and only here: the memory side *publishes* how many bytes are lent and how many it
wants back; the trainer reads the latest :class:`BudgetSnapshot` at its own unit
boundaries, resizes its window to fit ``limit_bytes`` and *acknowledges* the generation
it applied. The memory side never calls into the trainer; the trainer never touches the
lending state.

- Non-urgent (the reserve still covers decode): publish and go on; a later step takes the
  chunks once the trainer has let go of them.
- Urgent (an SGLang allocation would fail): publish, then :meth:`wait_acknowledged`,
  bounded: the trainer acknowledges at the end of its running unit (~10 ms on a GPU), or
  at once when it is parked at its gate (the follower's ``wake`` callback, registered by
  :meth:`follow`, wakes the parked trainer thread, which applies the budget and parks
  again).
- With no follower (no trainer running) nothing holds lent memory a wait could free, so
  waits return at once.

Thread-safe. Reading :attr:`snapshot` is one attribute read (a frozen object replaced
whole), cheap enough for every unit boundary.
"""

from __future__ import annotations

import dataclasses
import threading
from typing import Callable


@dataclasses.dataclass(frozen=True)
class BudgetSnapshot:
    generation: int  # bumped by every publish that changes a value
    lent_bytes: int  # lent to the trainer now
    wanted_back_bytes: int  # of those, what the memory side asks back

    @property
    def limit_bytes(self) -> int:
        """What the trainer may hold once it has applied this snapshot."""
        return self.lent_bytes - self.wanted_back_bytes


class LentMemoryBudget:
    def __init__(self) -> None:
        self._cond = threading.Condition(threading.Lock())
        self._snapshot = BudgetSnapshot(0, 0, 0)
        self._acknowledged = 0
        self._wake: Callable[[], None] | None = None  # the follower's

    # -- memory side ----------------------------------------------------------------------
    @property
    def snapshot(self) -> BudgetSnapshot:
        return self._snapshot

    @property
    def followed(self) -> bool:
        """Whether a trainer follows this budget (only a follower ever acknowledges)."""
        return self._wake is not None

    def publish(self, *, lent_bytes: int, wanted_back_bytes: int) -> int:
        """Publish what is lent and what is wanted back; returns the generation to wait
        for. Publishing the values already published changes nothing (no wake-up)."""
        if not 0 <= wanted_back_bytes <= lent_bytes:
            raise ValueError(f"publish: wanted_back_bytes={wanted_back_bytes} must be in [0, lent_bytes={lent_bytes}]")
        with self._cond:
            current = self._snapshot
            if (current.lent_bytes, current.wanted_back_bytes) == (lent_bytes, wanted_back_bytes):
                return current.generation
            generation = current.generation + 1
            self._snapshot = BudgetSnapshot(generation, lent_bytes, wanted_back_bytes)
            wake = self._wake
        if wake is not None:
            wake()  # outside this lock: the wake takes the follower's gate lock
        return generation

    @property
    def acknowledged_generation(self) -> int:
        """The latest generation the follower has applied."""
        return self._acknowledged

    def wait_acknowledged(self, generation: int, timeout_s: float) -> bool:
        """Wait until the follower has applied ``generation`` (or stopped following), at
        most ``timeout_s``. True if it did."""
        with self._cond:
            return self._cond.wait_for(lambda: self._acknowledged >= generation or self._wake is None, timeout_s)

    # -- trainer side ---------------------------------------------------------------------
    def acknowledge(self, generation: int) -> None:
        """The follower applied ``generation``: it holds at most that snapshot's limit."""
        with self._cond:
            if generation > self._acknowledged:
                self._acknowledged = generation
                self._cond.notify_all()

    def follow(self, wake: Callable[[], None]) -> Callable[[], None]:
        """Register the one follower. ``wake()`` is called (from the publishing thread, so
        it must only signal, never block) after every change, so that a follower blocked
        elsewhere applies it promptly. Returns ``unfollow``; a follower that stops must
        have released the lent memory first (waiters then stop waiting)."""
        with self._cond:
            if self._wake is not None:
                raise RuntimeError("LentMemoryBudget.follow: a follower is already registered (one trainer at a time)")
            self._wake = wake

        def unfollow() -> None:
            with self._cond:
                if self._wake is wake:
                    self._wake = None
                    self._cond.notify_all()

        return unfollow
