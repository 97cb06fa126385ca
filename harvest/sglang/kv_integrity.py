"""The idle integrity check of KV lending: SGLang's free lists, the unified allocator's
chunk states and the lending controller's cache of them agree
(:meth:`harvest.sglang.kv_lending.KvLendingController.check_integrity` calls it with the
lending thread held off). Rules: docs/sglang-integration.md, 'KV lending'."""

from __future__ import annotations

import torch

from harvest.memory.stats import ChunkState


class KvIntegrityError(RuntimeError):
    """SGLang's free lists, the allocator's chunk states and the controller's cache disagree."""


def lent_chunks(allocator) -> list[int]:
    """The chunks lent now, as the allocator (the authority) says."""
    return [info.chunk for info in allocator.chunk_table() if info.state == ChunkState.LENT]


def check(allocator, tokens, free_ids: torch.Tensor, *, lent: list[bool], num_lent: int, lending: set[int],
          num_chunks: int, tokens_per_chunk: int) -> None:
    """Raise (VmmIntegrityError from the allocator, else KvIntegrityError) naming the
    first inconsistency:

    - the allocator's invariants (``hvmm_check_integrity``);
    - the chunks the allocator has lent, and those it is lending, are exactly the
      cached ones (``lent``, ``lending``);
    - no live-slot count in the allocator (SGLang's slots are never marked there);
    - every free slot (``free_ids``: SGLang's free lists) is in a mapped chunk (none in a
      lent, moving or broken one), in the pool (not the padding slot 0), and free once;
    - free slots + lent and lending slots <= the pool's slots (``tokens.size``).
    """
    allocator.check_integrity()
    n, per = num_chunks, tokens_per_chunk
    table = allocator.chunk_table()
    allocator_lent = [info.chunk for info in table if info.state == ChunkState.LENT]
    cached = [c for c in range(n) if lent[c]]
    if allocator_lent != cached or len(cached) != num_lent:
        raise KvIntegrityError(f"lent chunks: the allocator has {allocator_lent}, the lending controller's cache "
                               f"{cached} (count {num_lent})")
    allocator_lending = [info.chunk for info in table if info.state == ChunkState.LENDING]
    if allocator_lending != sorted(lending):
        raise KvIntegrityError(f"chunks being lent: the allocator has {allocator_lending}, the lending controller's "
                               f"cache {sorted(lending)}")
    marked = [info.chunk for info in table if info.live_slots]
    if marked:
        raise KvIntegrityError(f"chunks {marked[:8]} count live slots in the allocator; SGLang's slots are never "
                               "marked there (its free lists say which are free), so something else marked them")
    num_free = int(free_ids.numel())
    if num_free:
        lowest, highest = int(free_ids.min()), int(free_ids.max())
        if lowest < 1 or highest > tokens.size:
            raise KvIntegrityError(f"SGLang's free lists hold slot {lowest if lowest < 1 else highest}, outside "
                                   f"the pool's slots 1..{tokens.size}")
        per_slot = torch.bincount(free_ids, minlength=n * per)
        if int(per_slot.max()) > 1:
            raise KvIntegrityError(f"SGLang's free lists hold slot {int(per_slot.argmax())} more than once")
        per_chunk = per_slot[: n * per].view(n, per).sum(dim=1).tolist()
        for chunk, free in enumerate(per_chunk):
            if free and table[chunk].state != ChunkState.MAPPED:
                state = ChunkState(table[chunk].state).name.lower()
                raise KvIntegrityError(f"SGLang's free lists hold {free} slot(s) of chunk {chunk}, which is {state} "
                                       f"(slots {chunk * per}..{(chunk + 1) * per - 1}; SGLang could hand them out)")
    taken = num_lent + len(lending)
    if num_free + taken * per > tokens.size:
        raise KvIntegrityError(f"{num_free} free + {taken * per} lent and lending slots exceed the pool's "
                               f"{tokens.size}")
