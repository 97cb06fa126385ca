"""The lending controller's reclaim on tensor-parallel ranks
(:meth:`~harvest.sglang.kv_lending.KvLendingController.reclaim` with ``ranks`` set): every
rank calls it at the same point of the scheduler loop with the same ``count``, and every
rank's free lists change the same way. Always on the scheduler thread (the controller's
mover is inline on tensor-parallel ranks: results arriving from a lending thread at any
time would change the ranks' free lists at different steps). Rules:
docs/tensor-parallel.md."""

from __future__ import annotations

import math
import time

import torch

from harvest.logs import get_logger
from harvest.sglang.lending_thread import GiveBack

logger = get_logger(__name__)

AGREED_ROUND_S = 0.05  # tensor-parallel urgent reclaim: the ranks compare notes this often


def reclaim_agreed(lending, count: int, wait: bool) -> list[int]:
    """The chunks every rank can give back now (a pending lend, or a lent chunk no
    trainer buffer uses) come back on every rank, lowest first. ``wait``: until
    ``urgent_wait_s``, rounds of asking the trainer and comparing again; every rank sees
    the same agreed masks, so every rank ends after the same round."""
    count = min(count, lending.num_taken)
    if count <= 0:
        lending._publish(0)
        return []
    rounds = max(1, math.ceil(lending.urgent_wait_s / AGREED_ROUND_S)) if wait else 1
    chosen: list[int] = []
    for round_number in range(rounds):
        returnable = torch.zeros(lending.policy.num_chunks, dtype=torch.bool)
        pending = lending._lending
        mine = list(pending) + list(lending.allocator.reclaimable_chunks())
        if mine:
            returnable[torch.tensor(mine, dtype=torch.int64)] = True
        agreed = lending.ranks.all_of(returnable)
        if chosen:
            agreed[torch.tensor(chosen, dtype=torch.int64)] = False
        now = agreed.nonzero().flatten().tolist()[: count - len(chosen)]
        if now:  # a pending lend here is cancelled, a lent one reclaimed; their slots rejoin the free lists
            lending._submit(GiveBack(tuple(c for c in now if c in pending), tuple(c for c in now if c not in pending)),
                            wait=True)
        chosen += now
        if len(chosen) >= count or round_number == rounds - 1:
            break
        generation = lending._publish(count - len(chosen))
        if lending.budget.followed:
            lending.budget.wait_acknowledged(generation, AGREED_ROUND_S)
        else:
            time.sleep(AGREED_ROUND_S)
    if wait and len(chosen) < count:
        logger.warning("the trainers did not give lent KV memory back on every rank within %.1f s; %d chunk(s) short",
                       lending.urgent_wait_s, count - len(chosen))
    lending._publish(count - len(chosen))
    return chosen
