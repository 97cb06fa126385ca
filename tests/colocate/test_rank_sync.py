"""The tensor-parallel ranks' step agreement (harvest.colocate.rank_sync): rank 0's decision
travels, every rank's facts are kept, the slowest rank's time is a step's, and the
exchange and the chunk agreement work over a real gloo group of two processes."""

from __future__ import annotations

import json

import pytest

from harvest.colocate.rank_sync import (Field, LendingRequest, OperatorCode, RankSync, SlowestRank, agreement,
                                        new_row)


def _row(**values):
    row = new_row()
    for name, value in values.items():
        row[Field[name]] = value
    return row


def test_rank_0_decides_and_every_rank_reports():
    lead = _row(LEVEL=3, RUN=1, TAG=17, OPERATOR=OperatorCode.PAUSE, LENDING_REQUEST=LendingRequest.RETURN,
                LEND_TICK=1, NUM_TAKEN=4, MOVES_DIGEST=99, MEASURED_TAG_1=16, MEASURED_S_1=0.010)
    # Another rank's own "decision" columns are ignored: only rank 0's travel.
    other = _row(LEVEL=0, RUN=0, TAG=5, FAULT=1, NUM_TAKEN=4, MOVES_DIGEST=99, MEASURED_TAG_1=16,
                 MEASURED_S_1=0.012, MEASURED_TAG_2=17, MEASURED_S_2=0.011, LENDING_OK=0)
    agreed = agreement([lead, other])
    assert (agreed.level, agreed.run, agreed.tag) == (3, True, 17)
    assert agreed.operator is OperatorCode.PAUSE and agreed.lending_request is LendingRequest.RETURN
    assert agreed.lend_tick and agreed.faulted_ranks == (1,) and agreed.lending_broken_ranks == (1,)
    assert agreed.measurements == ((0, 16, 0.010), (1, 16, 0.012), (1, 17, 0.011))
    assert not agreed.diverged


def test_the_trainers_ended_only_when_every_ranks_did():
    assert agreement([_row(TRAINER_ENDED=1), _row(TRAINER_ENDED=1)]).trainers_ended
    assert not agreement([_row(TRAINER_ENDED=1), _row(TRAINER_ENDED=0)]).trainers_ended
    assert not agreement([_row(TRAINER_ENDED=0), _row(TRAINER_ENDED=1)]).trainers_ended


@pytest.mark.parametrize("field", ["NUM_TAKEN", "MOVES_DIGEST"])
def test_ranks_whose_lending_differs_are_seen(field):
    assert agreement([_row(**{field: 1}), _row(**{field: 2})]).diverged


def test_a_step_is_the_slowest_ranks_once_every_rank_reported():
    slowest = SlowestRank(2)
    assert slowest.add([(0, 7, 0.010)]) == []
    assert slowest.add([(1, 7, 0.013), (0, 8, 0.009)]) == [(7, 0.013)]
    assert slowest.add([(1, 8, 0.008)]) == [(8, 0.009)]


def test_measurements_a_rank_never_sends_are_given_up():
    slowest = SlowestRank(2)
    for tag in range(SlowestRank.MAX_OPEN + 10):
        slowest.add([(0, tag, 0.01)])
    assert len(slowest._open) == SlowestRank.MAX_OPEN and min(slowest._open) == 10


def _rank(rank: int, store_file: str, out: str) -> None:
    import torch
    import torch.distributed as dist

    # A file store: no TCP port picked free here and bound again by the spawned rank 0 later.
    dist.init_process_group("gloo", init_method=f"file://{store_file}", rank=rank, world_size=2)
    ranks = RankSync(rank, 2, dist.new_group([0, 1], backend="gloo"))
    agreed = ranks.exchange(_row(LEVEL=rank + 1, TAG=10 * (rank + 1), NUM_TAKEN=rank, FAULT=rank))
    mask = torch.tensor([True, True, rank == 0, False, rank == 1])
    both = ranks.all_of(mask).tolist()
    with open(f"{out}.{rank}", "w") as f:
        json.dump({"level": agreed.level, "tag": agreed.tag, "taken": agreed.taken_by_rank,
                   "faulted": agreed.faulted_ranks, "both": both, "exchanges": ranks.exchanges}, f)
    dist.destroy_process_group()


@pytest.mark.timeout(120)
def test_two_processes_exchange_and_agree_on_chunks(tmp_path):
    import torch.multiprocessing as mp

    out = str(tmp_path / "rank")
    mp.start_processes(_rank, args=(str(tmp_path.resolve() / "store"), out), nprocs=2, start_method="spawn")
    results = [json.loads(open(f"{out}.{rank}").read()) for rank in range(2)]
    for result in results:  # both ranks see the same agreement: rank 0's decision, everyone's facts
        assert result == {"level": 1, "tag": 10, "taken": [0, 1], "faulted": [1],
                          "both": [True, True, False, False, False], "exchanges": 1}
