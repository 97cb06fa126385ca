"""Lend whole free KV chunks of SGLang's token allocator to the trainer; take them back.

Mechanism only; the rule is :mod:`harvest.memory.lending`. One source of truth per fact:
slot liveness is SGLang's free lists (a slot is free iff it is in them; a chunk is lent
only after all its slots were taken out of them, on the scheduler thread that alone
changes them); chunk state is the unified allocator (the controller's cache of lent and
being-lent chunks changes only after the allocator succeeded; :meth:`check_integrity`
verifies it). Decode never fails or retracts for lack of lent memory: ``ensure_available``
takes lent chunks back first. The controller lives on its token allocator (``LENDING_ATTR``).

Rules: docs/sglang-integration.md, 'KV lending (harvest/sglang/kv_lending.py)'.
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
from harvest.memory.stats import ChunkState

logger = get_logger(__name__)

LENDING_ATTR = "_harvest_lending"  # on SGLang's token allocator: its KvLendingController

def lending_of(token_allocator) -> "KvLendingController | None":
    """The controller lending from this SGLang token allocator, if any."""
    return getattr(token_allocator, LENDING_ATTR, None)


class KvIntegrityError(RuntimeError):
    """SGLang's free lists, the allocator's chunk states and the controller's cache disagree."""


class KvLendingController:
    def __init__(self, token_allocator, allocator, policy: LendingPolicy, budget: LentMemoryBudget, memory, *,
                 metrics=None):
        """``memory``: harvest.yaml's ``memory`` section (harvest.config.MemoryConfig), for
        its intervals and the urgent wait."""
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
        g = allocator.geometry
        self.tokens_per_chunk = g.tokens_per_chunk
        self.chunk_bytes = g.chunk_bytes
        self._lent = [False] * policy.num_chunks  # cache of the allocator's LENT chunks
        self._num_lent = 0  # sum(self._lent)
        self._lending: set[int] = set()  # cache of the allocator's LENDING chunks (out of the free lists)
        self._wanted_back = 0  # chunks published as wanted back and not yet reclaimed
        self.enabled = True  # False after a trainer fault: everything comes back, nothing is lent
        # True while the operator has the trainer paused or stopped: nothing is lent and
        # every chunk comes back as the trainer lets go of it (never waited for).
        self.returning = False
        self.num_lent_total = 0
        self.num_lends_cancelled_total = 0
        self.num_reclaimed_total = 0
        self.reclaim_s_total = 0.0
        self.num_integrity_checks = 0
        self.num_urgent_reclaims_total = 0  # allocations that waited for lent chunks to come back
        self.urgent_reclaim_s_total = 0.0
        # harvest.memory.demand.DemandReserve (reserve_tokens: auto, one rank): the reserve
        # follows the demand seen, at every lending pass. None: the policy's stays.
        self.reserve = None
        self.reserve_reason = "memory.reserve_tokens"
        self._reserve_updated = -math.inf
        self._last_lend = -math.inf  # monotonic() starts near 0 at boot
        self._last_integrity_check = -math.inf
        # harvest.colocate.rank_sync.RankSync on a tensor-parallel instance: every rank's
        # free lists change only together (the same chunks, at the same point of the
        # scheduler loop), as SGLang's ranks need them equal. None: one rank.
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
        """Chunks whose lend waits for decode's queued work (out of the free lists, not lent yet)."""
        return len(self._lending)

    @property
    def num_taken(self) -> int:
        """Chunks out of SGLang's free lists: lent or being lent (SGLang's leak check
        counts their slots as accounted for)."""
        return self._num_lent + len(self._lending)

    def lent_chunks(self) -> list[int]:
        """The chunks lent now, as the allocator (the authority) says."""
        return [info.chunk for info in self.allocator.chunk_table() if info.state == ChunkState.LENT]

    # -- per step / idle ------------------------------------------------------------------
    def after_step(self) -> None:
        """Non-urgent path: free mapped slots under the reserve -> take chunks back now,
        or ask the trainer for them (never waits)."""
        if not self.num_taken:
            return
        if self.returning:
            count = self.num_taken
        else:
            count = reclaim_count(self.policy, self.tokens.available_size(), self.num_taken)
        if count or self._wanted_back:
            self.reclaim(count, wait=False)  # count 0 withdraws a request no longer needed

    def lend_due(self) -> bool:
        """Whether ``lend_interval_s`` has passed since lending was last looked at."""
        return self.enabled and time.monotonic() - self._last_lend >= self.lend_interval_s

    def maybe_lend(self, force: bool = False, tick: bool | None = None) -> None:
        """Finish the lends whose fences have passed (every call), then, at most every
        ``lend_interval_s``, lend or reclaim as the policy says. ``tick``: tensor-parallel
        ranks look when rank 0's clock says (the agreement's), not their own."""
        if self._lending and self.enabled and not self.returning:
            self.finish_lends()
        now = time.monotonic()
        if tick is not None:
            if not (tick and self.enabled):
                return
        elif not self.enabled or (not force and now - self._last_lend < self.lend_interval_s):
            return
        self._last_lend = now
        if tick is None:
            self._follow_demand(now)
        if self.returning:
            if self.num_taken:
                self.reclaim(self.num_taken, wait=False)  # what the trainer let go of since
            return
        taken = [lent or chunk in self._lending for chunk, lent in enumerate(self._lent)]
        decision = plan(self.policy, self.free_per_chunk(), taken)
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
        short = need_tokens - self.tokens.available_size()
        if short <= 0:
            return False
        started = time.perf_counter()
        took = bool(self.reclaim(min(self.num_taken, math.ceil(short / self.tokens_per_chunk))))
        waited = time.perf_counter() - started
        self.num_urgent_reclaims_total += 1
        self.urgent_reclaim_s_total += waited
        if self.metrics is not None:
            self.metrics.urgent_reclaim(waited)
        return took


    def record_allocation(self, tokens: int) -> None:
        """SGLang allocated ``tokens`` slots (decode's growth or an arrival's prompt): the
        demand the auto reserve follows."""
        if self.reserve is not None:
            self.reserve.demand.record(time.monotonic(), tokens)

    def _follow_demand(self, now: float) -> None:
        """The auto reserve, from the demand recorded (one rank: tensor-parallel ranks keep
        the reserve they started with, which every rank has alike)."""
        if self.reserve is None or self.ranks is not None or now - self._reserve_updated < demand.UPDATE_INTERVAL_S:
            return
        self._reserve_updated = now
        decision = self.reserve.update(now)
        self.reserve_reason = decision.reason
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
        after any step). Nothing waits and nothing moves in memory."""
        taken = [c for c in range(len(self._lent)) if self._lent[c] or c in self._lending]
        if not taken:
            return
        ids, out = self._free_slots_in(taken)
        self.tokens.free_pages = ids[~out]
        logger.info("SGLang cleared its KV pool: the %d chunk(s) lent or being lent stay out of its free list", len(taken))

    # -- mechanism ------------------------------------------------------------------------
    def lend(self, chunks) -> None:
        """Take these whole free chunks out of SGLang's free lists and lend them: at once
        if decode's queued work has passed the lend's fences, else at a later
        :meth:`finish_lends`. Never waits."""
        chunks = [c for c in chunks if not self._lent[c] and c not in self._lending]
        if not chunks:
            return
        ids, taken = self._free_slots_in(chunks)
        if int(taken.sum()) != len(chunks) * self.tokens_per_chunk:
            raise RuntimeError(f"lend {chunks}: not every slot of these chunks is free (SGLang state changed under us)")
        self.tokens.free_pages = ids[~taken]
        self._record_moves(chunks, 1)
        try:
            lent_now = self.allocator.lend(chunks, wait=False)
        except Exception:
            self.tokens.free_pages = ids  # nothing lent: the slots are SGLang's again
            self._record_moves(chunks, 2)
            raise
        if lent_now:
            self._lent_now(chunks)
        else:
            self._lending.update(chunks)  # the next maybe_lend finishes them

    def _free_slots_in(self, chunks) -> tuple[torch.Tensor, torch.Tensor]:
        """SGLang's free list (merged first) and the mask of its slots in ``chunks``."""
        self.tokens.merge_and_sort_free()
        ids = self.tokens.free_pages
        chunk_of = torch.div(ids, self.tokens_per_chunk, rounding_mode="floor")
        return ids, torch.isin(chunk_of, torch.tensor(chunks, dtype=chunk_of.dtype, device=chunk_of.device))

    def finish_lends(self) -> list[int]:
        """Complete the lends whose fences have passed (queries, no wait); returns the chunks
        lent now. If the allocator fails, every pending lend is cancelled (its slots go back
        to SGLang) and the error is raised."""
        if not self._lending:
            return []
        try:
            done = self.allocator.finish_lends()
        except Exception:
            self._cancel_lends(len(self._lending))  # nothing lent: the slots are SGLang's again
            raise
        if done:
            self._lending.difference_update(done)
            self._lent_now(done)
        return done

    def _lent_now(self, chunks) -> None:
        for c in chunks:
            self._lent[c] = True
        self._num_lent += len(chunks)
        self.num_lent_total += len(chunks)
        if self.metrics is not None:
            self.metrics.lent(len(chunks))
        self._publish(self._wanted_back)

    def _cancel_lends(self, count: int) -> list[int]:
        """Up to ``count`` pending lends back to SGLang's free lists (highest chunks first,
        as lending chose them); their pages never left the KV cache."""
        chosen = sorted(self._lending, reverse=True)[:count]
        if not chosen:
            return []
        self.allocator.cancel_lends(chosen)
        self._lending.difference_update(chosen)
        self._release_slots(chosen)
        self.num_lends_cancelled_total += len(chosen)
        return chosen

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
        publish the rest as wanted back (0 withdraws an earlier request).

        Pending lends go first: cancelled, their pages never left the KV cache. Lent
        chunks the trainer's window still uses come back only after it shrinks, at its
        next unit boundary. ``wait=True`` (an allocation would fail otherwise) publishes
        the request and waits for the trainer's acknowledgement, at most
        ``urgent_wait_s``; ``wait=False`` never waits for the trainer: a later call takes
        the chunks. (The allocator's reclaim itself waits on its fences: the trainer's
        frees and decode's queued work, before it unmaps.)"""
        if self.ranks is not None:
            return self._reclaim_agreed(count, wait)
        started = time.perf_counter()
        cancelled = self._cancel_lends(count)
        count = min(count - len(cancelled), self._num_lent)
        chosen = self._reclaimable()[:count] if count else []
        if len(chosen) < count and wait and self.budget.followed:
            generation = self._publish(count)
            acknowledged = self.budget.wait_acknowledged(generation, self.urgent_wait_s)
            chosen = self._reclaimable()[:count]
            if not acknowledged:
                logger.warning("the trainer did not give lent KV memory back within %.1f s; %d chunk(s) short",
                               self.urgent_wait_s, count - len(chosen))
        if chosen:
            self.allocator.reclaim(chosen)
            self._release_slots(chosen)
            for c in chosen:
                self._lent[c] = False
            self._num_lent -= len(chosen)
            elapsed = time.perf_counter() - started
            self.num_reclaimed_total += len(chosen)
            self.reclaim_s_total += elapsed
            if self.metrics is not None:
                self.metrics.reclaimed(elapsed / len(chosen), len(chosen))
        self._publish(count - len(chosen))
        return cancelled + chosen

    AGREED_ROUND_S = 0.05  # tensor-parallel urgent reclaim: the ranks compare notes this often

    def _reclaim_agreed(self, count: int, wait: bool) -> list[int]:
        """Tensor-parallel :meth:`reclaim` (every rank calls it at the same point with the
        same ``count``): the chunks every rank can give back now (a pending lend, or a lent
        chunk no trainer buffer uses) come back on every rank, lowest first. ``wait``: until
        ``urgent_wait_s``, rounds of asking the trainer and comparing again; every rank
        sees the same agreed masks, so every rank ends after the same round."""
        started = time.perf_counter()
        count = min(count, self.num_taken)
        if count <= 0:
            self._publish(0)
            return []
        rounds = max(1, math.ceil(self.urgent_wait_s / self.AGREED_ROUND_S)) if wait else 1
        chosen: list[int] = []
        for round_number in range(rounds):
            returnable = torch.zeros(self.policy.num_chunks, dtype=torch.bool)
            mine = list(self._lending) + list(self.allocator.reclaimable_chunks())
            if mine:
                returnable[torch.tensor(mine, dtype=torch.int64)] = True
            agreed = self.ranks.all_of(returnable)
            if chosen:
                agreed[torch.tensor(chosen, dtype=torch.int64)] = False
            now = agreed.nonzero().flatten().tolist()[: count - len(chosen)]
            self._give_back(now)
            chosen += now
            if len(chosen) >= count or round_number == rounds - 1:
                break
            generation = self._publish(count - len(chosen))
            if self.budget.followed:
                self.budget.wait_acknowledged(generation, self.AGREED_ROUND_S)
            else:
                time.sleep(self.AGREED_ROUND_S)
        if wait and len(chosen) < count:
            logger.warning("the trainers did not give lent KV memory back on every rank within %.1f s; %d chunk(s) "
                           "short", self.urgent_wait_s, count - len(chosen))
        if chosen:
            elapsed = time.perf_counter() - started
            self.reclaim_s_total += elapsed
            if self.metrics is not None:
                self.metrics.reclaimed(elapsed / len(chosen), len(chosen))
        self._publish(count - len(chosen))
        return chosen

    def _give_back(self, chunks: list[int]) -> None:
        """Chunks agreed to come back: a pending lend here is cancelled, a lent one reclaimed;
        either way their slots rejoin SGLang's free lists."""
        if not chunks:
            return
        cancels = [c for c in chunks if c in self._lending]
        reclaims = [c for c in chunks if c not in self._lending]
        if cancels:
            self.allocator.cancel_lends(cancels)
            self._lending.difference_update(cancels)
            self.num_lends_cancelled_total += len(cancels)
        if reclaims:
            self.allocator.reclaim(reclaims)
            for c in reclaims:
                self._lent[c] = False
            self._num_lent -= len(reclaims)
            self.num_reclaimed_total += len(reclaims)
        self._release_slots(chunks)

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
        if self.ranks is not None:
            while self.num_taken:  # equal on every rank: every rank runs the same rounds
                if not self.reclaim(self.num_taken):
                    logger.error("could not reclaim %d lent KV chunks on every rank (a trainer still holds them)",
                                 self.num_taken)
                    break
            return
        self._cancel_lends(len(self._lending))
        while self._num_lent:
            if not self.reclaim(self._num_lent):
                logger.error("could not reclaim %d lent KV chunks (trainer still holds them)", self._num_lent)
                break

    def _reclaimable(self) -> list[int]:
        return sorted(self.allocator.reclaimable_chunks())  # low chunks first: allocation fills low slots

    def _publish(self, wanted_back: int) -> int:
        self._wanted_back = wanted_back
        return self.budget.publish(lent_bytes=self._num_lent * self.chunk_bytes,
                                   wanted_back_bytes=wanted_back * self.chunk_bytes)

    # -- integrity ------------------------------------------------------------------------
    def maybe_check_integrity(self) -> bool:
        """`check_integrity` at most every ``integrity_interval_s`` (the runtime's idle
        tick runs in a tight loop). Returns whether it ran."""
        if time.monotonic() - self._last_integrity_check < self.integrity_interval_s:
            return False
        self.check_integrity()
        return True

    def check_integrity(self) -> None:
        """Raise (VmmIntegrityError from the allocator, else KvIntegrityError) naming the
        first inconsistency between the allocator's own pools, its chunk states, this
        controller's cache of them and SGLang's free lists:

        - the allocator's invariants (``hvmm_check_integrity``);
        - the chunks the allocator has lent, and those it is lending, are exactly the
          cached ones;
        - no live-slot count in the allocator (SGLang's slots are never marked there);
        - every free slot is in a mapped chunk (none in a lent, moving or broken one), in
          the pool (not the padding slot 0), and free once;
        - free slots + lent and lending slots <= the pool's slots.

        Scheduler thread, between steps, idle only on a GPU (it waits for the decode stream).
        Cost: docs/measurements.md, 'The KV integrity check'.
        """
        self._last_integrity_check = time.monotonic()
        self.num_integrity_checks += 1
        self.allocator.check_integrity()
        n, per = self.policy.num_chunks, self.tokens_per_chunk
        table = self.allocator.chunk_table()
        lent = [info.chunk for info in table if info.state == ChunkState.LENT]
        cached = [c for c in range(n) if self._lent[c]]
        if lent != cached or len(cached) != self._num_lent:
            raise KvIntegrityError(f"lent chunks: the allocator has {lent}, the lending controller's cache {cached} "
                                   f"(count {self._num_lent})")
        lending = [info.chunk for info in table if info.state == ChunkState.LENDING]
        if lending != sorted(self._lending):
            raise KvIntegrityError(f"chunks being lent: the allocator has {lending}, the lending controller's cache "
                                   f"{sorted(self._lending)}")
        marked = [info.chunk for info in table if info.live_slots]
        if marked:
            raise KvIntegrityError(f"chunks {marked[:8]} count live slots in the allocator; SGLang's slots are never "
                                   "marked there (its free lists say which are free), so something else marked them")
        ids = self._free_ids()
        num_free = int(ids.numel())
        if num_free:
            lowest, highest = int(ids.min()), int(ids.max())
            if lowest < 1 or highest > self.tokens.size:
                raise KvIntegrityError(f"SGLang's free lists hold slot {lowest if lowest < 1 else highest}, outside "
                                       f"the pool's slots 1..{self.tokens.size}")
            per_slot = torch.bincount(ids, minlength=n * per)
            if int(per_slot.max()) > 1:
                raise KvIntegrityError(f"SGLang's free lists hold slot {int(per_slot.argmax())} more than once")
            per_chunk = per_slot[: n * per].view(n, per).sum(dim=1).tolist()
            for chunk, free in enumerate(per_chunk):
                if free and table[chunk].state != ChunkState.MAPPED:
                    state = ChunkState(table[chunk].state).name.lower()
                    raise KvIntegrityError(f"SGLang's free lists hold {free} slot(s) of chunk {chunk}, which is {state} "
                                           f"(slots {chunk * per}..{(chunk + 1) * per - 1}; SGLang could hand them out)")
        if num_free + self.num_taken * per > self.tokens.size:
            raise KvIntegrityError(f"{num_free} free + {self.num_taken * per} lent and lending slots exceed the pool's "
                                   f"{self.tokens.size}")

    def stats(self) -> dict:
        alloc = self.allocator.stats()
        return {
            "chunks_total": self.policy.num_chunks, "chunks_lent": self.num_lent, "chunks_lending": self.num_lending,
            "tokens_per_chunk": self.tokens_per_chunk, "reserve_tokens": self.policy.reserve_tokens,
            "reserve_reason": self.reserve_reason, "urgent_reclaims_total": self.num_urgent_reclaims_total,
            "urgent_reclaim_s_total": round(self.urgent_reclaim_s_total, 6),
            "lends_total": self.num_lent_total, "reclaims_total": self.num_reclaimed_total,
            "lends_cancelled_total": self.num_lends_cancelled_total,
            "integrity_checks_total": self.num_integrity_checks,
            "fragmentation_bytes": getattr(alloc, "fragmentation_bytes", 0),
        }
