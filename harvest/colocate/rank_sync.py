"""The decode ranks of one tensor-parallel instance, agreeing at every step.

SGLang relies on its TP ranks' schedulers staying identical; harvest keeps them so.
Everything a rank's own clock or trainer could make different crosses over here, once per
step and per idle tick, in one ``all_gather`` of one row per rank on a gloo group of
harvest's own: rank 0's decision, operator commands and lend clock; every rank's step
times, trainer fault, lending counts and moves digest, and whether its trainer has ended.
KV chunks move in or out of SGLang's free lists only at the same points on every rank and
only with agreement (:meth:`RankSync.all_of`).

Rules: docs/tensor-parallel.md, 'The rule everything follows' and 'The step exchange'.
"""

from __future__ import annotations

import dataclasses
import enum

import torch


class Field(enum.IntEnum):
    """The columns of a rank's row in the step exchange."""

    LEVEL = 0  # rank 0: the level applied (-1: none yet)
    RUN = 1  # rank 0: the trainer may run
    TAG = 2  # rank 0: the step's decision number (-1: an idle tick)
    MEASURED_TAG_1 = 3  # this rank: up to two steps it measured since the last exchange
    MEASURED_S_1 = 4
    MEASURED_TAG_2 = 5
    MEASURED_S_2 = 6
    FAULT = 7  # this rank's trainer faulted (by itself, not because a peer's did)
    OPERATOR = 8  # rank 0: an operator action for every rank (OperatorCode)
    LENDING_REQUEST = 9  # rank 0: "return" or "resume" lending (LendingRequest)
    LEND_TICK = 10  # rank 0: time to look for chunks to lend
    NUM_TAKEN = 11  # this rank: chunks lent or being lent
    LENDING_OK = 12  # this rank: its KV integrity checks pass
    MOVES_DIGEST = 13  # this rank: which chunks left and rejoined SGLang's free lists, in order
    TRAINER_ENDED = 14  # this rank: no trainer job's thread runs (its jobs ended, or none started)


NUM_FIELDS = len(Field)


class OperatorCode(enum.IntEnum):
    NONE = 0
    PAUSE = 1
    RESUME = 2
    STOP = 3


class LendingRequest(enum.IntEnum):
    NONE = 0
    RETURN = 1
    RESUME = 2


@dataclasses.dataclass(frozen=True)
class Agreement:
    """What the ranks agreed on in one exchange."""

    level: int
    run: bool
    tag: int
    operator: OperatorCode
    lending_request: LendingRequest
    lend_tick: bool
    faulted_ranks: tuple[int, ...]
    lending_broken_ranks: tuple[int, ...]
    taken_by_rank: tuple[int, ...]
    digests_by_rank: tuple[int, ...]
    measurements: tuple[tuple[int, int, float], ...]  # (rank, tag, seconds)
    trainers_ended: bool  # on every rank

    @property
    def diverged(self) -> bool:
        return len(set(self.taken_by_rank)) > 1 or len(set(self.digests_by_rank)) > 1


class RankSync:
    """One process's end of the exchange (all ranks call every method at the same point)."""

    def __init__(self, rank: int, size: int, group=None):
        self.rank = rank
        self.size = size
        self.group = group
        self.exchanges = 0
        self.exchange_s = 0.0

    @property
    def leader(self) -> bool:
        return self.rank == 0

    def exchange(self, row: list[float]) -> Agreement:
        import time

        import torch.distributed as dist

        started = time.perf_counter()
        mine = torch.tensor(row, dtype=torch.float64)
        rows = [torch.empty_like(mine) for _ in range(self.size)]
        dist.all_gather(rows, mine, group=self.group)
        self.exchange_s += time.perf_counter() - started
        self.exchanges += 1
        return agreement([r.tolist() for r in rows])

    def all_of(self, mask: torch.Tensor) -> torch.Tensor:
        """Elementwise AND of every rank's boolean ``mask`` (same length everywhere)."""
        import torch.distributed as dist

        values = mask.to(torch.uint8).cpu()
        dist.all_reduce(values, dist.ReduceOp.MIN, group=self.group)
        return values.bool()


def new_row() -> list[float]:
    row = [0.0] * NUM_FIELDS
    row[Field.LEVEL] = row[Field.TAG] = row[Field.MEASURED_TAG_1] = row[Field.MEASURED_TAG_2] = -1.0
    row[Field.LENDING_OK] = 1.0
    return row


def agreement(rows: list[list[float]]) -> Agreement:
    """The agreement of the ranks' rows (rank order): rank 0's decisions, everyone's facts."""
    lead = rows[0]
    measurements = []
    for rank, row in enumerate(rows):
        for tag_field, s_field in ((Field.MEASURED_TAG_1, Field.MEASURED_S_1), (Field.MEASURED_TAG_2, Field.MEASURED_S_2)):
            if row[tag_field] >= 0:
                measurements.append((rank, int(row[tag_field]), row[s_field]))
    return Agreement(
        level=int(lead[Field.LEVEL]), run=bool(lead[Field.RUN]), tag=int(lead[Field.TAG]),
        operator=OperatorCode(int(lead[Field.OPERATOR])),
        lending_request=LendingRequest(int(lead[Field.LENDING_REQUEST])), lend_tick=bool(lead[Field.LEND_TICK]),
        faulted_ranks=tuple(r for r, row in enumerate(rows) if row[Field.FAULT]),
        lending_broken_ranks=tuple(r for r, row in enumerate(rows) if not row[Field.LENDING_OK]),
        taken_by_rank=tuple(int(row[Field.NUM_TAKEN]) for row in rows),
        digests_by_rank=tuple(int(row[Field.MOVES_DIGEST]) for row in rows),
        measurements=tuple(measurements), trainers_ended=all(row[Field.TRAINER_ENDED] for row in rows))


class SlowestRank:
    """Rank 0: a step's measurement is the slowest rank's, once every rank reported it."""

    MAX_OPEN = 64

    def __init__(self, size: int):
        self.size = size
        self._open: dict[int, list] = {}  # tag -> [ranks reported, slowest seconds]

    def add(self, measurements) -> list[tuple[int, float]]:
        """The (tag, seconds) now complete, oldest first."""
        done = []
        for _, tag, seconds in measurements:
            entry = self._open.setdefault(tag, [0, 0.0])
            entry[0] += 1
            entry[1] = max(entry[1], seconds)
            if entry[0] == self.size:
                done.append((tag, entry[1]))
                del self._open[tag]
        if len(self._open) > self.MAX_OPEN:  # a rank's measurement was lost: give the oldest up
            for tag in sorted(self._open)[: len(self._open) - self.MAX_OPEN]:
                del self._open[tag]
        return sorted(done)
