"""Lend whole free KV chunks of SGLang's token allocator to the trainer; take them back.

Mechanism only; the rule is :mod:`harvest.memory.lending`. SGLang's token allocator
(``TokenToKVPoolAllocator``; pages of one token) keeps free slots in ``free_pages`` and,
when ``need_sort`` (decode instances), recently freed ones in ``release_pages``, merged
and sorted on demand, so allocation takes the lowest free slots and high chunks empty out
(FineServe's "fill partial slabs first"; the runtime turns ``need_sort`` on everywhere).

- Lend: a chunk all of whose slots are free leaves the free lists (SGLang can no longer
  hand its slots out), then the unified allocator unmaps its pages from every K/V range
  (a dummy page takes their place) and maps them into the general arena, and the
  trainer's window may grow into them.
- Reclaim: chunks whose arena pages the trainer no longer uses go back (fences waited
  on); if too few are free, the trainer's window shrinks first, at its next unit
  boundary (the reserve covers decode meanwhile; the scheduler thread does not wait),
  and a later step takes the chunks; the slots rejoin the free list. Decode never fails
  for lack of lent memory: an allocation that fails reclaims synchronously and runs
  again (hook on ``alloc``), waiting for the trainer's running unit if it must.

Called on the scheduler thread: the urgent check (``available_size`` against the reserve,
no device sync) after every step; the lending plan (one ``bincount`` over the free list)
at most every ``lend_interval_s``, after a step or when idle, so that a server that is
never idle still lends the chunks its batches leave free.
"""

from __future__ import annotations

import math
import time

import torch

from harvest.logs import get_logger
from harvest.memory.lending import LendingPolicy, plan, reclaim_count

logger = get_logger(__name__)


class KvLendingController:
    def __init__(self, token_allocator, allocator, policy: LendingPolicy, *, trainer_host=None, metrics=None,
                 lend_interval_s: float = 0.05):
        self.tokens = token_allocator
        self.allocator = allocator
        self.policy = policy
        self.trainer_host = trainer_host
        self.metrics = metrics
        self.lend_interval_s = lend_interval_s
        g = allocator.geometry
        self.tokens_per_chunk = g.tokens_per_chunk
        self.chunk_bytes = g.chunk_bytes
        self.lent = [False] * policy.num_chunks
        self._num_lent = 0  # sum(self.lent), kept: read after every decode step
        self.enabled = True  # False after a trainer fault: everything comes back, nothing is lent
        self.num_lent_total = 0
        self.num_reclaimed_total = 0
        self.reclaim_s_total = 0.0
        self._last_lend = 0.0
        # Allocation takes the lowest free slots only if frees are merged and sorted.
        token_allocator.need_sort = True

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

    # -- per step / idle ------------------------------------------------------------------
    def after_step(self) -> None:
        """Urgent path: free mapped slots under the reserve -> reclaim now."""
        if not self._num_lent:
            return
        count = reclaim_count(self.policy, self.tokens.available_size(), self._num_lent)
        if count:
            self.reclaim(count, wait=False)

    def maybe_lend(self, force: bool = False) -> None:
        now = time.monotonic()
        if not self.enabled or (not force and now - self._last_lend < self.lend_interval_s):
            return
        self._last_lend = now
        decision = plan(self.policy, self.free_per_chunk(), self.lent)
        if decision.reclaim_count:
            self.reclaim(decision.reclaim_count, wait=False)
        elif decision.lend:
            self.lend(decision.lend)

    def ensure_available(self, need_tokens: int) -> bool:
        """Before an allocation of ``need_tokens``: reclaim synchronously if it would fail.
        Returns whether any chunk came back."""
        if not self._num_lent:
            return False
        short = need_tokens - self.tokens.available_size()
        if short <= 0:
            return False
        return bool(self.reclaim(min(self._num_lent, math.ceil(short / self.tokens_per_chunk))))

    # -- mechanism ------------------------------------------------------------------------
    def lend(self, chunks) -> None:
        chunks = [c for c in chunks if not self.lent[c]]
        if not chunks:
            return
        self.tokens.merge_and_sort_free()
        ids = self.tokens.free_pages
        chunk_of = torch.div(ids, self.tokens_per_chunk, rounding_mode="floor")
        taken = torch.isin(chunk_of, torch.tensor(chunks, dtype=chunk_of.dtype, device=chunk_of.device))
        if int(taken.sum()) != len(chunks) * self.tokens_per_chunk:
            raise RuntimeError(f"lend {chunks}: not every slot of these chunks is free (SGLang state changed under us)")
        self.tokens.free_pages = ids[~taken]
        try:
            self.allocator.lend(chunks)
        except Exception:
            self.tokens.free_pages = ids  # nothing lent: the slots are SGLang's again
            raise
        for c in chunks:
            self.lent[c] = True
        self._num_lent += len(chunks)
        self.num_lent_total += len(chunks)
        if self.metrics is not None:
            self.metrics.lent(len(chunks))
        self._resize_window()

    def reclaim(self, count: int, wait: bool = True) -> list[int]:
        """Take ``count`` lent chunks back (fewer only if fewer are lent, or not yet free).

        Chunks the trainer's window still uses need it to shrink first. ``wait=True`` (an
        allocation would fail otherwise) waits for the trainer's running unit to end;
        ``wait=False`` (after a step or when idle: the reserve still covers decode) never
        waits: the window shrinks now if no unit is running, else at the unit's end, and
        a later step takes the chunks."""
        started = time.perf_counter()
        count = min(count, self._num_lent)
        chosen = self._reclaimable()[:count]
        trainer = self.trainer_host.trainer if self.trainer_host is not None else None
        if len(chosen) < count and trainer is not None:
            # The trainer holds the pages: shrink its window to what will remain lent.
            stages = trainer.window.capacity_for_bytes((self._num_lent - count) * self.chunk_bytes)
            if wait:
                if stages >= 1:
                    trainer.set_window_stages(stages)
                    chosen = self._reclaimable()[:count]
                if len(chosen) < count:
                    trainer.release_window()
                    chosen = self._reclaimable()[:count]
            else:
                # Shrink to ``stages``; once W is that small and the chunks are still held
                # (the window's buffers straddle them), empty the window instead.
                request = stages if stages >= 1 and trainer.window.capacity > stages else 0
                if trainer.request_window_stages(request):
                    chosen = self._reclaimable()[:count]
                    if len(chosen) < count and request and trainer.request_window_stages(0):
                        chosen = self._reclaimable()[:count]
        if not chosen:
            return []
        self.allocator.reclaim(chosen)
        slots = torch.cat([torch.arange(c * self.tokens_per_chunk, (c + 1) * self.tokens_per_chunk, dtype=torch.int64) for c in chosen])
        slots = slots.to(self.tokens.free_pages.device)
        self.tokens.release_pages = torch.cat((self.tokens.release_pages, slots))
        for c in chosen:
            self.lent[c] = False
        self._num_lent -= len(chosen)
        elapsed = time.perf_counter() - started
        self.num_reclaimed_total += len(chosen)
        self.reclaim_s_total += elapsed
        if self.metrics is not None:
            self.metrics.reclaimed(elapsed / len(chosen), len(chosen))
        self._resize_window()
        return chosen

    def reclaim_all(self) -> None:
        self.enabled = False
        if self.trainer_host is not None and self.trainer_host.trainer is not None:
            self.trainer_host.trainer.release_window()
        while self.num_lent:
            if not self.reclaim(self.num_lent):
                logger.error("could not reclaim %d lent KV chunks (trainer still holds them)", self.num_lent)
                break

    def _reclaimable(self) -> list[int]:
        lent = [c for c in self.allocator.reclaimable_chunks() if c < len(self.lent) and self.lent[c]]
        return sorted(lent)  # low chunks first: allocation fills low slots

    def _resize_window(self) -> None:
        trainer = self.trainer_host.trainer if self.trainer_host is not None else None
        if trainer is None:
            return
        stages = trainer.window.capacity_for_bytes(self._num_lent * self.chunk_bytes)
        if stages >= 1 and stages != trainer.window.capacity:
            trainer.request_window_stages(stages)  # never waits for a running unit

    def stats(self) -> dict:
        alloc = self.allocator.stats()
        return {
            "chunks_total": self.policy.num_chunks, "chunks_lent": self.num_lent,
            "tokens_per_chunk": self.tokens_per_chunk, "reserve_tokens": self.policy.reserve_tokens,
            "lends_total": self.num_lent_total, "reclaims_total": self.num_reclaimed_total,
            "fragmentation_bytes": getattr(alloc, "fragmentation_bytes", 0),
        }
