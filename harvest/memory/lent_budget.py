"""What the memory side lends the trainer and what it wants back, published one way.

The serving side (``harvest.sglang.kv_lending``) and the trainer's frozen-weight window
meet here, and only here: the memory side *publishes* how many bytes are lent and wanted
back; the trainer reads the latest :class:`BudgetSnapshot` at its unit boundaries, resizes
its window to ``limit_bytes`` and *acknowledges* the generation it applied. Neither calls
into the other. A non-urgent reclaim publishes and goes on; an urgent one (an SGLang
allocation would fail) then waits in :meth:`wait_acknowledged`, bounded: the trainer
answers at the end of its unit, or at once when parked (the ``wake`` callback registered
by :meth:`follow`). With no follower, waits return at once. Thread-safe; reading
:attr:`snapshot` is one attribute read.
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
    """Followed by every trainer of the server's jobs (harvest.colocate.trainer_host runs
    several, one unit at a time). A follower is a trainer thread: it follows, acknowledges
    and stops following on its own thread, so followers are told apart by thread. A wait
    for a generation waits for every follower: a parked job acknowledges at once (its
    ``wake``), the running one at its next unit boundary."""

    def __init__(self) -> None:
        self._cond = threading.Condition(threading.Lock())
        self._snapshot = BudgetSnapshot(0, 0, 0)
        self._acknowledged = 0  # the least generation every follower applied (the last, once none follows)
        self._followers: dict[int, list] = {}  # thread ident -> [wake, generation it applied]

    # -- memory side ----------------------------------------------------------------------
    @property
    def snapshot(self) -> BudgetSnapshot:
        return self._snapshot

    @property
    def followed(self) -> bool:
        """Whether a trainer follows this budget (only a follower ever acknowledges)."""
        return bool(self._followers)

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
            wakes = [follower[0] for follower in self._followers.values()]
        for wake in wakes:
            wake()  # outside this lock: the wake takes the follower's gate lock
        return generation

    @property
    def acknowledged_generation(self) -> int:
        """The latest generation every follower has applied."""
        return self._acknowledged

    def wait_acknowledged(self, generation: int, timeout_s: float) -> bool:
        """Wait until every follower has applied ``generation`` (or stopped following), at
        most ``timeout_s``. True if they did."""
        with self._cond:
            return self._cond.wait_for(lambda: self._acknowledged >= generation or not self._followers, timeout_s)

    # -- trainer side ---------------------------------------------------------------------
    def acknowledge(self, generation: int) -> None:
        """The calling follower applied ``generation``: it holds at most that snapshot's
        limit. From a thread that does not follow: the only follower's (a trainer driven
        from another thread), or, with none, the budget's record."""
        with self._cond:
            follower = self._followers.get(threading.get_ident())
            if follower is None and len(self._followers) == 1:
                follower = next(iter(self._followers.values()))
            if follower is None:
                if not self._followers and generation > self._acknowledged:
                    self._acknowledged = generation
                    self._cond.notify_all()
                return
            if generation > follower[1]:
                follower[1] = generation
                self._update_acknowledged_locked()

    def follow(self, wake: Callable[[], None]) -> Callable[[], None]:
        """Register the calling thread's trainer as a follower. ``wake()`` is called (from
        the publishing thread, so it must only signal, never block) after every change, so
        that a follower blocked elsewhere applies it promptly. Returns ``unfollow``; a
        follower that stops must have released the lent memory first. A new follower holds
        no lent memory yet: it counts as having applied the current generation."""
        ident = threading.get_ident()
        with self._cond:
            if ident in self._followers:
                raise RuntimeError("LentMemoryBudget.follow: this thread already follows the budget")
            self._followers[ident] = [wake, self._snapshot.generation]
            self._update_acknowledged_locked()

        def unfollow() -> None:
            with self._cond:
                follower = self._followers.get(ident)
                if follower is not None and follower[0] is wake:
                    del self._followers[ident]
                    self._update_acknowledged_locked()

        return unfollow

    def _update_acknowledged_locked(self) -> None:
        if self._followers:
            self._acknowledged = min(follower[1] for follower in self._followers.values())
        self._cond.notify_all()
