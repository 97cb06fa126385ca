"""The allocator's side of lending KV chunks (lend, finish, cancel, reclaim: the driver's
work and its fence waits), run on the scheduler thread or on a lending thread of its own.

:class:`~harvest.sglang.kv_lending.KvLendingController` decides and edits SGLang's free
lists, on the scheduler thread only (SGLang's allocator is not thread-safe); what it asks
of the unified allocator goes through a *mover*, as jobs whose results come back as
:class:`Moved` records it applies, in order, on the scheduler thread (:meth:`drain`).

- :class:`InlineMover`: the job runs at once on the caller's thread; today's path, and
  the one tensor-parallel ranks keep (every rank must change its free lists at the same
  point of the scheduler loop, which results arriving from a thread at any time cannot
  promise).
- :class:`ThreadedMover`: the jobs run in order on a thread of their own; the scheduler
  thread posts and goes on, or, when decode must have the memory now, posts and waits.
  The thread also finishes pending lends as their fences pass.

Invariants: only the mover's thread calls the allocator's lend, finish, cancel and
reclaim (so it alone changes chunk states, besides the trainer's arena allocations, which
the allocator checks under its own lock); a chunk is in a job only while it is out of
SGLang's free lists; results are applied in the order they happened; :meth:`quiet` holds
the thread off while the idle integrity check compares the allocator with the cache.
Rules and races: docs/design.md §1, 'Reclaim ahead, off the decode thread'.
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import threading
import time

from harvest.logs import get_logger
from harvest.memory.errors import VmmInvalidArgument

logger = get_logger(__name__)

LENT = "lent"  # the allocator lent these chunks (their lend finished)
CANCELLED = "cancelled"  # pending lends given back: their pages never reached the trainer
RECLAIMED = "reclaimed"  # lent chunks mapped back into the KV ranges
UNLENT = "unlent"  # a lend that failed: nothing moved, the slots are SGLang's again
DONE = "done"  # a job finished (its ticket, what it asked for, how many chunks came back)
FAILED = "failed"  # the allocator raised: re-raised on the scheduler thread when applied

RECLAIM_TRIES = 3  # a chunk chosen as unused can be taken by the trainer before the reclaim: choose again


@dataclasses.dataclass(frozen=True)
class Moved:
    kind: str
    chunks: tuple[int, ...] = ()
    seconds: float = 0.0  # RECLAIMED: the allocator's time for the batch
    ticket: int = 0  # DONE
    asked: int = 0  # DONE of a take-back: chunks asked for
    back: int = 0  # DONE: chunks the job gave back to the KV cache
    error: BaseException | None = None  # FAILED


@dataclasses.dataclass(frozen=True)
class Lend:
    chunks: tuple[int, ...]


@dataclasses.dataclass(frozen=True)
class TakeBack:
    """Up to ``count`` chunks back: pending lends first (highest first, as lending chose
    them; no driver work), then lent chunks no trainer buffer uses (lowest first: SGLang
    fills low slots first)."""

    count: int


@dataclasses.dataclass(frozen=True)
class GiveBack:
    """Exactly these chunks back (tensor-parallel ranks agreed on them)."""

    cancels: tuple[int, ...]
    reclaims: tuple[int, ...]


class ChunkMoves:
    """The allocator calls of the jobs; one thread at a time (the mover's)."""

    def __init__(self, allocator):
        self.allocator = allocator
        self.pending: set[int] = set()  # chunks whose lend waits for its fences (allocator: LENDING)

    def run(self, job) -> list[Moved]:
        try:
            if isinstance(job, Lend):
                return self._lend(job.chunks)
            if isinstance(job, TakeBack):
                return self._take_back(job.count)
            if isinstance(job, GiveBack):
                return self._give_back(job)
            raise TypeError(f"unknown lending job {job!r}")
        except Exception as error:  # noqa: BLE001 - reported on the scheduler thread
            return [Moved(FAILED, error=error)]

    def _lend(self, chunks: tuple[int, ...]) -> list[Moved]:
        try:
            lent_now = self.allocator.lend(list(chunks), wait=False)
        except Exception as error:  # noqa: BLE001 - nothing lent: the slots are SGLang's again
            return [Moved(UNLENT, chunks), Moved(FAILED, error=error)]
        if lent_now:
            return [Moved(LENT, chunks)]
        self.pending.update(chunks)  # finish() completes them
        return []

    def finish(self) -> list[Moved]:
        """Complete the pending lends whose fences have passed (queries, no wait). If the
        allocator fails, every pending lend is cancelled (its slots go back to SGLang)."""
        if not self.pending:
            return []
        try:
            done = self.allocator.finish_lends()
        except Exception as error:  # noqa: BLE001
            try:
                out = self._cancel(len(self.pending))
            except Exception:  # noqa: BLE001 - they stay pending (LENDING), as the cache says
                out = []
            return out + [Moved(FAILED, error=error)]
        self.pending.difference_update(done)
        return [Moved(LENT, tuple(done))] if done else []

    def _cancel(self, count: int) -> list[Moved]:
        chosen = sorted(self.pending, reverse=True)[:count]
        if not chosen:
            return []
        self.allocator.cancel_lends(chosen)
        self.pending.difference_update(chosen)
        return [Moved(CANCELLED, tuple(chosen))]

    def _take_back(self, count: int) -> list[Moved]:
        out = self._cancel(count)
        wanted = count - sum(len(m.chunks) for m in out)
        for attempt in range(RECLAIM_TRIES):
            chosen = sorted(self.allocator.reclaimable_chunks())[:wanted] if wanted > 0 else []
            if not chosen:
                break
            started = time.perf_counter()
            try:
                self.allocator.reclaim(chosen)
            except VmmInvalidArgument:
                # The trainer allocated in a chosen chunk between the choice and the
                # reclaim (the allocator refused and changed nothing): choose again.
                if attempt == RECLAIM_TRIES - 1 or set(chosen) <= set(self.allocator.reclaimable_chunks()):
                    raise
                continue
            out.append(Moved(RECLAIMED, tuple(chosen), seconds=time.perf_counter() - started))
            break
        return out

    def _give_back(self, job: GiveBack) -> list[Moved]:
        out = []
        if job.cancels:
            self.allocator.cancel_lends(list(job.cancels))
            self.pending.difference_update(job.cancels)
            out.append(Moved(CANCELLED, job.cancels))
        if job.reclaims:
            started = time.perf_counter()
            self.allocator.reclaim(list(job.reclaims))
            out.append(Moved(RECLAIMED, job.reclaims, seconds=time.perf_counter() - started))
        return out


def _done(job, ticket: int, moved: list[Moved]) -> Moved:
    back = sum(len(m.chunks) for m in moved if m.kind in (CANCELLED, RECLAIMED))
    return Moved(DONE, ticket=ticket, asked=job.count if isinstance(job, TakeBack) else 0, back=back)


class InlineMover:
    """Jobs run at once on the caller's thread (the scheduler's)."""

    threaded = False

    def __init__(self, allocator):
        self.moves = ChunkMoves(allocator)
        self._results: collections.deque[Moved] = collections.deque()
        self._ticket = 0

    @property
    def pending(self) -> set[int]:
        return self.moves.pending

    def submit(self, job) -> int:
        self._ticket += 1
        moved = self.moves.run(job)
        self._results.extend(moved)
        self._results.append(_done(job, self._ticket, moved))
        return self._ticket

    def wait(self, ticket: int) -> None:
        pass

    def poll(self) -> None:
        """Finish the pending lends whose fences have passed (a ThreadedMover's thread does
        this itself)."""
        self._results.extend(self.moves.finish())

    @property
    def busy(self) -> bool:
        return False

    def drain(self) -> list[Moved]:
        out = list(self._results)
        self._results.clear()
        return out

    def wait_all(self) -> None:
        pass

    @contextlib.contextmanager
    def quiet(self, blocking: bool = True):
        yield True

    def close(self) -> None:
        pass


class ThreadedMover:
    """Jobs run in order on a thread of their own, which also finishes pending lends
    (a query every ``poll_s`` while any is pending). Results wait in a queue for
    :meth:`drain` on the scheduler thread."""

    threaded = True
    POLL_S = 0.002  # a pending lend waits for at most one decode step's queued work

    def __init__(self, allocator, name: str = "harvest-kv-lending"):
        self.moves = ChunkMoves(allocator)
        self._cond = threading.Condition(threading.Lock())
        self._jobs: collections.deque = collections.deque()
        self._results: collections.deque[Moved] = collections.deque()  # appended here, popped by drain
        self._submitted = 0
        self._finished = 0
        self._stopping = False
        # Held by the thread while it calls the allocator; by quiet() while the integrity
        # check compares the allocator's chunk states with the controller's cache.
        self._working = threading.Lock()
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    @property
    def pending(self) -> set[int]:
        return self.moves.pending

    def submit(self, job) -> int:
        with self._cond:
            if self._stopping:
                raise RuntimeError("the lending thread is stopped")
            self._submitted += 1
            self._jobs.append((self._submitted, job))
            self._cond.notify_all()
            return self._submitted

    def wait(self, ticket: int) -> None:
        """Until the job of ``ticket`` (and every earlier one) has run: its results are
        queued for :meth:`drain`."""
        with self._cond:
            self._cond.wait_for(lambda: self._finished >= ticket or not self._thread.is_alive())

    def poll(self) -> None:
        pass

    @property
    def busy(self) -> bool:
        """A job posted and not yet run."""
        return self._finished < self._submitted

    def drain(self) -> list[Moved]:
        out = []
        while True:
            try:
                out.append(self._results.popleft())
            except IndexError:
                return out

    def wait_all(self) -> None:
        """Until every job posted so far has run."""
        self.wait(self._submitted)

    @contextlib.contextmanager
    def quiet(self, blocking: bool = True):
        """Yields True with the thread held off and no job outstanding, else False (the
        caller tries again later): a check of the allocator against the cache. Blocking:
        waits for the thread's current call, not for posted jobs."""
        if not self._working.acquire(blocking=blocking):
            yield False
            return
        try:
            yield not self.busy
        finally:
            self._working.release()

    def _run(self) -> None:
        while True:
            with self._cond:
                while not self._jobs and not self._stopping:
                    if self.moves.pending:
                        self._cond.wait(self.POLL_S)
                        break
                    self._cond.wait()
                if self._stopping and not self._jobs:
                    return
                ticket, job = self._jobs.popleft() if self._jobs else (0, None)
            with self._working:
                moved = self.moves.run(job) if job is not None else []
                try:
                    finished = self.moves.finish()
                except Exception as error:  # noqa: BLE001 - the thread goes on; reported on the scheduler thread
                    finished = [Moved(FAILED, error=error)]
                self._results.extend(moved + finished)
                if job is not None:
                    self._results.append(_done(job, ticket, moved))
            if job is not None:
                with self._cond:
                    self._finished = ticket
                    self._cond.notify_all()

    def close(self, timeout_s: float = 30.0) -> None:
        """Run the jobs already posted, then stop the thread and join it. Pending lends
        stay pending (LENDING in the allocator and the cache): consistent, finished or
        cancelled by whoever lends next."""
        with self._cond:
            self._stopping = True
            self._cond.notify_all()
        self._thread.join(timeout_s)
        if self._thread.is_alive():
            logger.error("the KV lending thread did not stop within %.0f s (a driver call hangs?)", timeout_s)
