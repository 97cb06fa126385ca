"""Lend whole free KV chunks of SGLang's token allocator to the trainer; take them back.

Mechanism only; the rule is :mod:`harvest.memory.lending`, the free slots to keep
:func:`harvest.memory.demand.free_target`. One source of truth per fact: slot liveness is
SGLang's free lists (a slot is free iff it is in them; a chunk is lent only after all its
slots were taken out of them, on the scheduler thread that alone changes them); chunk
state is the unified allocator (the controller's cache of lent and being-lent chunks
changes only when the allocator's results are applied; :meth:`check_integrity` verifies
it). The allocator's work (lend, finish, cancel, reclaim) runs through a mover
(:mod:`harvest.sglang.lending_thread`): on the scheduler thread, or on a lending thread
whose results the scheduler thread applies at its next lending call. Decode never fails
or retracts for lack of lent memory: ``ensure_available`` takes lent chunks back first;
an admission that lent memory holds back takes them back too (``before_admission``).
The controller lives on its token allocator (``LENDING_ATTR``).

Rules: docs/sglang-integration.md, 'KV lending (harvest/sglang/kv_lending.py)'; design and
races: docs/design.md §1.
"""

from __future__ import annotations

import dataclasses
import math
import time

import torch

from harvest.logs import get_logger
from harvest.memory import demand
from harvest.memory.lending import LendingPolicy, plan, reclaim_count
from harvest.memory.lent_budget import LentMemoryBudget
from harvest.sglang import kv_integrity
from harvest.sglang.lending_thread import (CANCELLED, DONE, FAILED, LENT, RECLAIMED, UNLENT, InlineMover, Lend, TakeBack,
                                           ThreadedMover)

logger = get_logger(__name__)

LENDING_ATTR = "_harvest_lending"  # on SGLang's token allocator: its KvLendingController

KvIntegrityError = kv_integrity.KvIntegrityError


def lending_of(token_allocator) -> "KvLendingController | None":
    """The controller lending from this SGLang token allocator, if any."""
    return getattr(token_allocator, LENDING_ATTR, None)


class KvLendingController:
    def __init__(self, token_allocator, allocator, policy: LendingPolicy, budget: LentMemoryBudget, memory, *,
                 metrics=None):
        """``memory``: harvest.yaml's ``memory`` section (harvest.config.MemoryConfig), for
        its intervals, the urgent wait, reclaim-ahead and the lending thread."""
        self.tokens = token_allocator
        self.allocator = allocator
        self.policy = policy
        self.budget = budget
        self.metrics = metrics
        self.lend_interval_s = memory.lend_interval_s
        # Longest an allocation waits for the trainer to let go of lent memory. A unit
        # takes ~10 ms on a GPU and well under a second on the CPU test models; only a hung
        # trainer reaches it, and then decode goes on with what is free (SGLang may retract).
        self.urgent_wait_s = memory.urgent_reclaim_wait_s
        # The idle integrity check costs a few milliseconds (docs/measurements.md); once
        # every few seconds of idling is a fraction of a percent of the scheduler thread.
        self.integrity_interval_s = memory.integrity_check_interval_s
        self.reclaim_ahead = getattr(memory, "reclaim_ahead", True)
        thread = getattr(memory, "lending_thread", None)
        self.wants_thread = allocator.geometry.backend == "cuda" if thread is None else bool(thread)
        self.mover = InlineMover(allocator)  # a ThreadedMover from the first job, when wanted (one rank)
        g = allocator.geometry
        self.tokens_per_chunk = g.tokens_per_chunk
        self.chunk_bytes = g.chunk_bytes
        self._lent = [False] * policy.num_chunks  # cache of the allocator's LENT chunks
        self._num_lent = 0  # sum(self._lent)
        self._lending: set[int] = set()  # out of the free lists, on the way to lent (a job, or LENDING)
        self._wanted_back = 0  # chunks published as wanted back and not yet reclaimed
        self._publish_on_done = 0  # the ticket of the latest non-urgent take-back: its result publishes
        self.enabled = True  # False after a trainer fault: everything comes back, nothing is lent
        # True while the operator has the trainer paused or stopped: nothing is lent and
        # every chunk comes back as the trainer lets go of it (never waited for).
        self.returning = False
        self.num_lent_total = 0
        self.num_lends_cancelled_total = 0
        self.num_reclaimed_total = 0
        self.reclaim_s_total = 0.0
        self.num_integrity_checks = 0
        self.num_urgent_reclaims_total = 0  # allocations and admissions that waited for lent chunks
        self.urgent_reclaim_s_total = 0.0
        self.num_admissions_held_total = 0  # admission rounds lent memory held back (a subset of the above)
        # What SGLang's admission sets aside for its running requests' decode (reclaim
        # ahead keeps it free besides the reserve), and what a held admission needs free.
        self.promised_tokens = 0
        self.held_tokens = 0
        self.queue_seen: set = set()  # SGLang's queued request ids at the last admission round
        # harvest.memory.demand.DemandReserve (reserve_tokens: auto, one rank): the reserve
        # follows the demand seen, at every lending pass. None: the policy's stays.
        self.reserve = None
        self._reserve_reason: str | None = None  # the last update's
        self._reserve_updated = -math.inf
        self._last_lend = -math.inf  # monotonic() starts near 0 at boot
        self._last_integrity_check = -math.inf
        # harvest.colocate.rank_sync.RankSync on a tensor-parallel instance: every rank's
        # free lists change only together (the same chunks, at the same point of the
        # scheduler loop), as SGLang's ranks need them equal. None: one rank. Set before
        # the first lend (the lending thread is for one rank only).
        self.ranks = None
        # Which chunks left and rejoined SGLang's free lists, in order, as one number:
        # tensor-parallel ranks compare it (harvest.colocate.rank_sync).
        self.moves_digest = 0
        # Allocation takes the lowest free slots only if frees are merged and sorted.
        token_allocator.need_sort = True
        setattr(token_allocator, LENDING_ATTR, self)

    # -- reading SGLang's free lists ------------------------------------------------------
    def _free_ids(self) -> torch.Tensor:
        return torch.cat((self.tokens.free_pages, self.tokens.release_pages))

    def free_per_chunk(self) -> list[int]:
        ids = self._free_ids()
        counts = torch.bincount(torch.div(ids, self.tokens_per_chunk, rounding_mode="floor"), minlength=self.policy.num_chunks)
        return counts[: self.policy.num_chunks].tolist()

    @property
    def num_lent(self) -> int:
        return self._num_lent

    @property
    def num_lending(self) -> int:
        """Chunks on their way to lent (out of the free lists, not lent yet)."""
        return len(self._lending)

    @property
    def num_taken(self) -> int:
        """Chunks out of SGLang's free lists: lent or being lent (SGLang's leak check
        counts their slots as accounted for)."""
        return self._num_lent + len(self._lending)

    @property
    def lending_thread(self) -> bool:
        return self.mover.threaded

    def lent_chunks(self) -> list[int]:
        """The chunks lent now, as the allocator (the authority) says."""
        return kv_integrity.lent_chunks(self.allocator)

    @property
    def reserve_reason(self) -> str:
        """Why the reserve is what it is (``/harvest/status``'s ``kv.reserve_reason``)."""
        if self._reserve_reason is not None:
            return self._reserve_reason
        tokens = self.policy.reserve_tokens
        if self.reserve is None:
            return f"memory.reserve_tokens: {tokens} tokens, fixed"
        if self.ranks is not None:
            return f"Harli's formula ({tokens} tokens): tensor-parallel ranks keep the reserve they started with"
        return self.reserve.current.reason

    def free_target(self) -> int:
        """Free mapped slots to keep now (the reserve, plus what reclaim-ahead adds)."""
        return demand.free_target(self.policy.reserve_tokens, promised_tokens=self.promised_tokens,
                                  held_tokens=self.held_tokens)

    def _target_policy(self) -> LendingPolicy:
        return demand.with_free_target(self.policy, promised_tokens=self.promised_tokens, held_tokens=self.held_tokens)

    # -- per step / idle ------------------------------------------------------------------
    def after_step(self) -> None:
        """Non-urgent path: free mapped slots under the target -> take chunks back (on the
        lending thread, or now), or ask the trainer for them (never waits)."""
        self._drain()
        if not self.num_taken:
            return
        if self.returning:
            count = self.num_taken
        else:
            count = reclaim_count(self._target_policy(), self.tokens.available_size(), self.num_taken)
        if count or self._wanted_back:
            self.reclaim(count, wait=False)  # count 0 withdraws a request no longer needed

    def lend_due(self) -> bool:
        """Whether ``lend_interval_s`` has passed since lending was last looked at."""
        return self.enabled and time.monotonic() - self._last_lend >= self.lend_interval_s

    def maybe_lend(self, force: bool = False, tick: bool | None = None) -> None:
        """Finish the lends whose fences have passed (every call), then, at most every
        ``lend_interval_s``, lend or reclaim as the policy says. ``tick``: tensor-parallel
        ranks look when rank 0's clock says (the agreement's), not their own."""
        self._drain()
        if self._lending and self.enabled and not self.returning:
            self.finish_lends()
        now = time.monotonic()
        if tick is not None:
            if not (tick and self.enabled):
                return
        elif not self.enabled or (not force and now - self._last_lend < self.lend_interval_s):
            return
        if self.mover.busy:
            return  # the lending thread still moves chunks: plan on its results, at the next call
        self._last_lend = now
        if tick is None:
            self._follow_demand(now)
        if self.returning:
            if self.num_taken:
                self.reclaim(self.num_taken, wait=False)  # what the trainer let go of since
            return
        taken = [lent or chunk in self._lending for chunk, lent in enumerate(self._lent)]
        decision = plan(self._target_policy(), self.free_per_chunk(), taken)
        if decision.reclaim_count or self._wanted_back:
            self.reclaim(decision.reclaim_count, wait=False)
        elif decision.lend:
            self.lend(decision.lend)

    def ensure_available(self, need_tokens: int) -> bool:
        """Urgent path, before an allocation of ``need_tokens``: if it would fail, take lent
        chunks back, waiting for the trainer if it holds them (counted and timed: decode
        waits). Returns whether any came back."""
        if not self.num_taken:
            return False
        came_back = bool(self._drain())  # a reclaim ahead that finished meanwhile
        short = need_tokens - self.tokens.available_size()
        if short <= 0 or not self.num_taken:
            return came_back
        started = time.perf_counter()
        took = bool(self.reclaim(min(self.num_taken, math.ceil(short / self.tokens_per_chunk))))
        self._count_urgent(time.perf_counter() - started)
        return took or came_back

    def _count_urgent(self, waited: float) -> None:
        self.num_urgent_reclaims_total += 1
        self.urgent_reclaim_s_total += waited
        if self.metrics is not None:
            self.metrics.urgent_reclaim(waited)

    @property
    def watches_admissions(self) -> bool:
        """Whether SGLang's admissions concern lending (one rank; chunks lent or lendable)."""
        return self.ranks is None and (self.enabled or self.num_taken > 0)

    def before_admission(self, want) -> bool:
        """SGLang is about to admit from its queue (``want``: harvest.sglang.admission's
        AdmissionDemand). Notes what its running requests are promised (reclaim ahead keeps
        it free) and, when the queue's head would fit had nothing been lent, takes lent
        chunks back now, without waiting for the trainer: an admission held back by lent
        memory, counted (once per episode: until an admission round finds no such
        shortfall) as a held admission and an urgent reclaim; within an episode, again
        only when the need grew. Returns True when harvest
        has since given back the memory an earlier round was held for (SGLang stopped
        looking at its queue: ``batch_is_full``), so it should look again."""
        self._drain()
        self.promised_tokens = want.promised_tokens if self.reclaim_ahead else 0
        if want.arrived_tokens and self.reserve is not None:
            self.reserve.demand.record(time.monotonic(), want.arrived_tokens)
        if not want.looked:
            return self.held_tokens > 0 and self.tokens.available_size() + want.evictable_tokens >= self.held_tokens
        need = want.promised_tokens + want.queued_tokens - want.evictable_tokens
        short = need - self.tokens.available_size()
        if not want.queued_tokens or short <= 0 or not self.num_taken:
            self.held_tokens = 0
            return False
        episode, grew = self.held_tokens == 0, need > self.held_tokens
        self.held_tokens = need
        if grew:  # a new episode, or more arrived: now (else after_step follows up as the trainer lets go)
            started = time.perf_counter()
            count = min(self.num_taken, math.ceil(short / self.tokens_per_chunk))
            goal = self.num_taken - count
            self._publish_on_done = 0
            self._submit(TakeBack(count), wait=True)
            self._publish(self.num_taken - goal)
            if episode:
                self.num_admissions_held_total += 1
                self._count_urgent(time.perf_counter() - started)
                if self.metrics is not None:
                    self.metrics.admission_held()
        return False

    @property
    def demand_from_arrivals(self) -> bool:
        """The auto reserve follows the requests arriving in SGLang's queue, as its
        admission prices them (reclaim ahead, one rank), not its allocations."""
        return self.reclaim_ahead and self.ranks is None

    def record_allocation(self, tokens: int) -> None:
        """SGLang allocated ``tokens`` slots (decode's growth or an arrival's prompt): the
        demand the auto reserve follows, unless it follows arrivals."""
        if self.reserve is not None and not self.demand_from_arrivals:
            self.reserve.demand.record(time.monotonic(), tokens)

    def _follow_demand(self, now: float) -> None:
        """The auto reserve, from the demand recorded (one rank: tensor-parallel ranks keep
        the reserve they started with, which every rank has alike)."""
        if self.reserve is None or self.ranks is not None or now - self._reserve_updated < demand.UPDATE_INTERVAL_S:
            return
        self._reserve_updated = now
        self.reserve.recorded = ("tokens arriving in SGLang's queue (as its admission prices them)"
                                 if self.demand_from_arrivals else "tokens allocated")
        decision = self.reserve.update(now)
        self._reserve_reason = decision.reason
        if decision.tokens != self.policy.reserve_tokens:
            logger.info("KV reserve %d -> %d tokens: %s", self.policy.reserve_tokens, decision.tokens, decision.reason)
            self.policy = dataclasses.replace(self.policy, reserve_tokens=decision.tokens)
            if self.metrics is not None:
                self.metrics.set_reserve(decision.tokens)

    def after_pool_cleared(self) -> None:
        """SGLang's ``clear()`` (``/flush_cache``, a weight update) just made every slot of
        the pool free again, the slots of the chunks lent or being lent included: take
        those back out of the free list. They stay the trainer's, and SGLang's state is
        what it would be had nothing been lent (its leak check counts them as lent, as
        after any step). Nothing waits and nothing moves in memory. (Chunks whose return
        the lending thread has reported but this thread not applied count as lent: their
        slots rejoin the free list when applied.)"""
        taken = [c for c in range(len(self._lent)) if self._lent[c] or c in self._lending]
        if not taken:
            return
        ids, out = self._free_slots_in(taken)
        self.tokens.free_pages = ids[~out]
        logger.info("SGLang cleared its KV pool: the %d chunk(s) lent or being lent stay out of its free list", len(taken))

    # -- mechanism ------------------------------------------------------------------------
    def _mover(self):
        if self.wants_thread and not self.mover.threaded and self.ranks is None and not self.mover.pending:
            self.mover = ThreadedMover(self.allocator)
        return self.mover

    def _submit(self, job, wait: bool = False) -> list[int]:
        """Post a job to the mover (``wait``: until it has run), then apply what has come
        back; returns the chunks whose slots rejoined the free lists."""
        mover = self._mover()
        ticket = mover.submit(job)
        if wait:
            mover.wait(ticket)
        return self._drain()

    def settle(self) -> list[int]:
        """Wait for the lending thread's jobs and apply their results (shutdown, tests)."""
        self.mover.wait_all()
        return self._drain()

    def close(self) -> None:
        """Stop the lending thread (the jobs posted run first) and apply its last results;
        any later call works on the scheduler thread."""
        self.mover.close()
        try:
            self._drain()
        except Exception:  # noqa: BLE001 - at shutdown: logged, the state stays consistent
            logger.exception("KV lending: the lending thread's last results")
        self.wants_thread = False
        if self.mover.threaded:
            inline = InlineMover(self.allocator)
            inline.moves.pending = self.mover.moves.pending  # lends still waiting for their fences
            self.mover = inline

    def _drain(self) -> list[int]:
        """Apply the mover's results in order (scheduler thread). The chunks whose slots
        rejoined SGLang's free lists; an allocator error is raised once all are applied."""
        back, error = [], None
        for moved in self.mover.drain():
            if moved.kind == LENT:
                self._lending.difference_update(moved.chunks)
                self._lent_now(moved.chunks)
            elif moved.kind in (CANCELLED, RECLAIMED, UNLENT):
                self._returned(moved)
                back += moved.chunks
            elif moved.kind == DONE:
                if moved.ticket == self._publish_on_done:
                    self._publish(moved.asked - moved.back)  # the rest: asked of the trainer
            elif moved.kind == FAILED and error is None:
                error = moved.error
        if error is not None:
            raise error
        return back

    def _returned(self, moved) -> None:
        chunks = moved.chunks
        for c in chunks:
            if c in self._lending:
                self._lending.discard(c)
            elif self._lent[c]:
                self._lent[c] = False
                self._num_lent -= 1
        self._release_slots(chunks)
        if moved.kind == CANCELLED:
            self.num_lends_cancelled_total += len(chunks)
        elif moved.kind == RECLAIMED:
            self.num_reclaimed_total += len(chunks)
            self.reclaim_s_total += moved.seconds
            if self.metrics is not None:
                self.metrics.reclaimed(moved.seconds / len(chunks), len(chunks))

    def lend(self, chunks) -> None:
        """Take these whole free chunks out of SGLang's free lists and lend them: at once
        if decode's queued work has passed the lend's fences, else when it has (the
        lending thread, or a later :meth:`finish_lends`). Never waits."""
        chunks = [c for c in chunks if not self._lent[c] and c not in self._lending]
        if not chunks:
            return
        ids, taken = self._free_slots_in(chunks)
        if int(taken.sum()) != len(chunks) * self.tokens_per_chunk:
            raise RuntimeError(f"lend {chunks}: not every slot of these chunks is free (SGLang state changed under us)")
        self.tokens.free_pages = ids[~taken]
        self._record_moves(chunks, 1)
        self._lending.update(chunks)
        self._submit(Lend(tuple(chunks)))

    def _free_slots_in(self, chunks) -> tuple[torch.Tensor, torch.Tensor]:
        """SGLang's free list (merged first) and the mask of its slots in ``chunks``."""
        self.tokens.merge_and_sort_free()
        ids = self.tokens.free_pages
        chunk_of = torch.div(ids, self.tokens_per_chunk, rounding_mode="floor")
        return ids, torch.isin(chunk_of, torch.tensor(chunks, dtype=chunk_of.dtype, device=chunk_of.device))

    def finish_lends(self) -> list[int]:
        """Complete the lends whose fences have passed (queries, no wait; the lending
        thread does this itself); returns the chunks lent by the results applied now. If
        the allocator fails, every pending lend is cancelled (its slots go back to SGLang)
        and the error is raised."""
        if not self._lending:
            return []
        before = set(self._lending)
        self.mover.poll()
        self._drain()
        return sorted(c for c in before if self._lent[c])

    def _lent_now(self, chunks) -> None:
        for c in chunks:
            self._lent[c] = True
        self._num_lent += len(chunks)
        self.num_lent_total += len(chunks)
        if self.metrics is not None:
            self.metrics.lent(len(chunks))
        self._publish(self._wanted_back)

    def _record_moves(self, chunks, direction: int) -> None:
        for chunk in chunks:
            self.moves_digest = (self.moves_digest * 31 + (chunk + 1) * direction) % 2147483647

    def _release_slots(self, chunks) -> None:
        self._record_moves(chunks, 2)
        slots = torch.cat([torch.arange(c * self.tokens_per_chunk, (c + 1) * self.tokens_per_chunk, dtype=torch.int64)
                           for c in chunks])
        slots = slots.to(self.tokens.free_pages.device)
        self.tokens.release_pages = torch.cat((self.tokens.release_pages, slots))

    def reclaim(self, count: int, wait: bool = True) -> list[int]:
        """Take ``count`` chunks back (fewer only if fewer are lent, or not yet free);
        publish the rest as wanted back (0 withdraws an earlier request). Returns the
        chunks whose slots rejoined the free lists by this call.

        Pending lends go first: cancelled, their pages never reached the trainer. Lent
        chunks the trainer's window still uses come back only after it shrinks, at its
        next unit boundary. ``wait=True`` (an allocation would fail otherwise) publishes
        the request and waits for the trainer's acknowledgement, at most
        ``urgent_wait_s``; ``wait=False`` never waits for the trainer (a later call takes
        the chunks) nor, with the lending thread, for the driver: its results are applied
        at a later call (and while it still runs a job, nothing new is asked). (The
        allocator's reclaim itself waits on the fences of the trainer's frees before it
        unmaps the arena run; never on decode's queued work.)"""
        if self.ranks is not None:
            return self._reclaim_agreed(count, wait)
        if not wait:
            if count <= 0:
                self._publish_on_done = 0
                self._publish(0)
                return self._drain()
            if self.mover.busy:
                return self._drain()
            mover = self._mover()
            self._publish_on_done = mover.submit(TakeBack(count))
            return self._drain()
        self._publish_on_done = 0
        count = min(count, self.num_taken)
        goal = self.num_taken - count
        back = self._submit(TakeBack(count), wait=True) if count > 0 else self._drain()
        short = self.num_taken - goal
        if short > 0 and self.budget.followed:
            acknowledged = self.budget.wait_acknowledged(self._publish(short), self.urgent_wait_s)
            back += self._submit(TakeBack(self.num_taken - goal), wait=True)
            if not acknowledged:
                logger.warning("the trainer did not give lent KV memory back within %.1f s; %d chunk(s) short",
                               self.urgent_wait_s, self.num_taken - goal)
        self._publish(self.num_taken - goal)
        return back

    def _reclaim_agreed(self, count: int, wait: bool) -> list[int]:
        """Tensor-parallel :meth:`reclaim` (harvest.sglang.agreed_reclaim)."""
        from harvest.sglang.agreed_reclaim import reclaim_agreed

        return reclaim_agreed(self, count, wait)

    def return_all(self) -> None:
        """Operator pause or stop: lend nothing more, and take every chunk back as the
        trainer lets go of it. Pending lends and unused lent chunks come back now; the
        rest is published as wanted back (a paused trainer empties its window while
        parked, a stopping one when it leaves its loop) and taken at later steps and idle
        ticks. Never waits."""
        self.returning = True
        if self.num_taken:
            self.reclaim(self.num_taken, wait=False)

    def resume_lending(self) -> None:
        """Operator resume: lend again as the policy says."""
        self.returning = False
        if self._wanted_back:
            self._publish(0)  # the trainer may grow its window again

    def reclaim_all(self) -> None:
        """Every lent chunk back, lending off (a trainer fault). A trainer that left its
        loop has released its window; one still running is asked and waited for."""
        self.enabled = False
        while self.num_taken:  # tensor-parallel: equal on every rank, every rank runs the same rounds
            if not self.reclaim(self.num_taken):
                logger.error("could not reclaim %d lent KV chunks%s (a trainer still holds them)", self.num_taken,
                             "" if self.ranks is None else " on every rank")
                break

    def _publish(self, wanted_back: int) -> int:
        self._wanted_back = max(0, min(wanted_back, self._num_lent))
        return self.budget.publish(lent_bytes=self._num_lent * self.chunk_bytes,
                                   wanted_back_bytes=self._wanted_back * self.chunk_bytes)

    # -- integrity ------------------------------------------------------------------------
    def maybe_check_integrity(self) -> bool:
        """`check_integrity` at most every ``integrity_interval_s`` (the runtime's idle
        tick runs in a tight loop), and only while the lending thread is idle (else at a
        later tick). Returns whether it ran."""
        if time.monotonic() - self._last_integrity_check < self.integrity_interval_s:
            return False
        return self._check_integrity(blocking=False)

    def check_integrity(self) -> None:
        """Raise (VmmIntegrityError from the allocator, else KvIntegrityError) naming the
        first inconsistency between the allocator's own pools, its chunk states, this
        controller's cache of them and SGLang's free lists (harvest.sglang.kv_integrity).
        Waits for the lending thread's jobs first. Scheduler thread, between steps, idle
        only on a GPU (it waits for the decode stream). Cost: docs/measurements.md, 'The KV
        integrity check'."""
        self.settle()
        self._check_integrity(blocking=True)

    def _check_integrity(self, blocking: bool) -> bool:
        self._drain()
        with self.mover.quiet(blocking) as quiet:
            if not quiet:
                return False
            self._drain()  # what the thread reported before it was held off
            self._last_integrity_check = time.monotonic()
            self.num_integrity_checks += 1
            kv_integrity.check(self.allocator, self.tokens, self._free_ids(), lent=self._lent,
                               num_lent=self._num_lent, lending=self._lending, num_chunks=self.policy.num_chunks,
                               tokens_per_chunk=self.tokens_per_chunk)
        return True

    def stats(self) -> dict:
        alloc = self.allocator.stats()
        return {
            "chunks_total": self.policy.num_chunks, "chunks_lent": self.num_lent, "chunks_lending": self.num_lending,
            "tokens_per_chunk": self.tokens_per_chunk, "reserve_tokens": self.policy.reserve_tokens,
            "reserve_reason": self.reserve_reason, "free_target_tokens": self.free_target(),
            "free_target_reason": demand.free_target_reason(self.policy.reserve_tokens,
                                                            promised_tokens=self.promised_tokens,
                                                            held_tokens=self.held_tokens),
            "reclaim_ahead": self.reclaim_ahead, "lending_thread": self.lending_thread,
            "urgent_reclaims_total": self.num_urgent_reclaims_total,
            "urgent_reclaim_s_total": round(self.urgent_reclaim_s_total, 6),
            "admissions_held_total": self.num_admissions_held_total,
            "lends_total": self.num_lent_total, "reclaims_total": self.num_reclaimed_total,
            "reclaim_s_total": round(self.reclaim_s_total, 6),
            "lends_cancelled_total": self.num_lends_cancelled_total,
            "integrity_checks_total": self.num_integrity_checks,
            "fragmentation_bytes": getattr(alloc, "fragmentation_bytes", 0),
        }
