"""Device memory for the frozen-weight window, behind an allocator interface.

By default the window takes plain device memory from PyTorch. When harvest's unified
allocator is active, its general arena (memory lent from free KV-cache chunks) is adapted
to `BaseWindowAllocator` instead; the window does not know the difference.
"""

from __future__ import annotations

import abc
from typing import Iterable

import torch

ALIGNMENT_BYTES = 256  # every buffer and every tensor inside a stage buffer starts aligned


class BaseWindowAllocator(abc.ABC):
    """Gives the window one contiguous buffer per resident stage.

    Contract:
    - `device` is the torch device the buffers live on.
    - `allocate(num_bytes)` returns a 1-D ``torch.uint8`` tensor of exactly `num_bytes`
      on `device` whose data pointer is aligned to `ALIGNMENT_BYTES`, or None when that
      much memory is not available right now. None is transient (the window backs off:
      it skips a prefetch, or evicts and retries); nothing stays allocated after a None.
    - `release(buffer, streams)` gives a buffer back. The memory must not be handed out
      again before the work queued so far on every stream in `streams` has finished
      (CUDA: an event recorded on each stream, or ``record_stream``); on CPU `streams` is
      empty and the memory is free at once. The window drops every reference to the
      buffer before calling `release`.
    - `held_bytes` is the total of buffers allocated and not yet released.
    - `budget`: None for memory the trainer owns outright. For memory lent by the serving
      side, the :class:`~harvest.memory.lent_budget.LentMemoryBudget` it publishes; the
      trainer then fits the window to it at unit boundaries, and `reclaimable_bytes()`
      says how much of the lent memory no buffer touches (in the units the lender takes
      back), so the trainer can tell whether shrinking was enough.
    - `reuses_viewed_memory`: True when memory given back by `release` can be handed out
      again while a tensor still views it (memory lent by the serving side: its owner
      takes the chunks back whatever views them); False when a released buffer lives on
      for as long as any tensor views it (PyTorch's allocators). The window keeps
      autograd from viewing its buffers only where that matters
      (`WeightWindow.needs_saved_tensor_hooks`).
    - Calls come from one thread at a time (the trainer holds its unit lock).
    """

    device: torch.device
    budget = None  # LentMemoryBudget | None
    reuses_viewed_memory = True

    def reclaimable_bytes(self) -> int:
        """Lent bytes the lender could take back now; only asked when `budget` is set."""
        raise NotImplementedError(f"{type(self).__name__} has no lent-memory budget")

    @abc.abstractmethod
    def allocate(self, num_bytes: int) -> torch.Tensor | None:
        """A buffer of `num_bytes`, or None if the memory is not available now."""

    @abc.abstractmethod
    def release(self, buffer: torch.Tensor, streams: Iterable = ()) -> None:
        """Return `buffer`; fenced after the work already queued on `streams`."""

    @property
    @abc.abstractmethod
    def held_bytes(self) -> int:
        """Bytes currently allocated to the window."""


class TorchWindowAllocator(BaseWindowAllocator):
    """Plain device memory from PyTorch (its caching allocator on CUDA).

    An optional `limit_bytes` makes allocations beyond it return None, the same transient
    shortage the general arena reports when no lent chunk is left. A released buffer's
    memory goes back to PyTorch when the last tensor viewing it does.
    """

    reuses_viewed_memory = False

    def __init__(self, device: torch.device | str, limit_bytes: int | None = None):
        self.device = torch.device(device)
        self.limit_bytes = limit_bytes
        self._held_bytes = 0

    def allocate(self, num_bytes: int) -> torch.Tensor | None:
        if num_bytes <= 0:
            raise ValueError(f"num_bytes must be > 0, got {num_bytes}")
        if self.limit_bytes is not None and self._held_bytes + num_bytes > self.limit_bytes:
            return None
        # CUDA blocks are 512-byte aligned; CPU allocations only 64, so over-allocate and
        # slice (the slice keeps the whole allocation alive).
        slack = 0 if self.device.type == "cuda" else ALIGNMENT_BYTES
        try:
            raw = torch.empty(num_bytes + slack, dtype=torch.uint8, device=self.device)
        except torch.OutOfMemoryError:
            return None
        start = -raw.data_ptr() % ALIGNMENT_BYTES
        if start > slack:
            raise RuntimeError(f"torch returned a {self.device} buffer not aligned to {ALIGNMENT_BYTES} bytes")
        self._held_bytes += num_bytes
        return raw[start: start + num_bytes]

    def release(self, buffer: torch.Tensor, streams: Iterable = ()) -> None:
        for stream in streams:
            # The caching allocator then reuses the block only after `stream` passes here.
            buffer.record_stream(stream)
        self._held_bytes -= buffer.numel()

    @property
    def held_bytes(self) -> int:
        return self._held_bytes
