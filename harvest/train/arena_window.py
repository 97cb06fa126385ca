"""The unified allocator's general arena as the memory of the trainer's weight window.

When harvest backs SGLang's KV cache, the window's frozen-weight buffers come from KV
chunks that decode lent (``UnifiedAllocator.arena_allocate``): whole pages, so every
buffer is page-aligned. ``None`` from the arena is the transient shortage the window
already handles (skip a prefetch, evict, retry). Releasing records a fence on each stream
that used the buffer; a chunk is reclaimed only after its pages' fences have passed.

The memory side's :class:`~harvest.memory.lent_budget.LentMemoryBudget` rides along: the
trainer reads it through this allocator and resizes the window itself. While memory is
wanted back, no new buffer is handed out, so the chunks the trainer has just let go of
stay free until the lender has taken them (the window treats it as the usual shortage).
A released chunk goes back to the lender whatever still views it (``reuses_viewed_memory``
is True), so autograd never keeps a window tensor here (the window's saved-tensor hooks).
"""

from __future__ import annotations

from typing import Iterable

import torch

from harvest.train.window_memory import BaseWindowAllocator


class ArenaWindowAllocator(BaseWindowAllocator):
    def __init__(self, allocator, device: torch.device | str, budget=None):
        self._allocator = allocator
        self.device = torch.device(device)
        self.budget = budget
        self._blocks: dict[int, object] = {}  # buffer data_ptr -> harvest.memory.Allocation
        self._held_bytes = 0

    def allocate(self, num_bytes: int) -> torch.Tensor | None:
        if num_bytes <= 0:
            raise ValueError(f"num_bytes must be > 0, got {num_bytes}")
        if self.budget is not None and self.budget.snapshot.wanted_back_bytes:
            return None
        block = self._allocator.arena_allocate(num_bytes)
        if block is None:
            return None
        buffer = block.tensor()
        self._blocks[buffer.data_ptr()] = block
        self._held_bytes += num_bytes
        return buffer

    def release(self, buffer: torch.Tensor, streams: Iterable = ()) -> None:
        block = self._blocks.pop(buffer.data_ptr(), None)
        if block is None:
            raise ValueError(f"buffer at {buffer.data_ptr():#x} was not allocated by this window allocator")
        handles = [stream.cuda_stream for stream in streams]
        block.free(streams=handles if self.device.type == "cuda" else [])
        self._held_bytes -= block.num_bytes

    @property
    def held_bytes(self) -> int:
        return self._held_bytes

    def reclaimable_bytes(self) -> int:
        """Whole lent chunks no buffer uses (one ``hvmm_stats`` call, asked only when
        memory is wanted back)."""
        return self._allocator.stats().chunks_lent_idle * self._allocator.geometry.chunk_bytes
