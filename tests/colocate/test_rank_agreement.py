"""Colocation on tensor-parallel ranks (harvest.colocate.rank_sync): two ranks, each a
Colocation on a thread, exchanging through an in-process stand-in for the gloo group.

- rank 0's decision (level, trainer runs) is applied on rank 1 at the same step, and rank
  0's QoS feedback gets the slowest rank's time;
- an operator's pause, given to rank 0's endpoint only, pauses every rank's trainer and
  returns lent memory on every rank at the same exchange;
- a trainer fault on rank 1 aborts rank 0's trainer collectives and takes every chunk back
  on both ranks, once;
- ranks whose lent chunks differ stop lending and their trainers everywhere;
- every rank learns, at the same exchange, when every rank's trainer has ended.
"""

from __future__ import annotations

import threading
import types

from harvest.colocate.colocation import Colocation
from harvest.colocate.rank_sync import agreement
from harvest.schedule import TrainerState


class Group:
    """All-gather of rows between threads (what RankSync does over gloo)."""

    def __init__(self, size: int):
        self.size = size
        self.rows = [None] * size
        self.barrier = threading.Barrier(size)


class ThreadRanks:
    def __init__(self, group: Group, rank: int):
        self.group, self.rank, self.size = group, rank, group.size
        self.exchanges, self.exchange_s = 0, 0.0

    @property
    def leader(self):
        return self.rank == 0

    def exchange(self, row):
        self.group.rows[self.rank] = list(row)
        self.group.barrier.wait(timeout=10)
        rows = list(self.group.rows)
        self.group.barrier.wait(timeout=10)
        self.exchanges += 1
        return agreement(rows)


class Host:
    def __init__(self):
        self.calls, self.applied = [], []
        self.on_unit = self.on_fault = self.on_job_end = None
        self.runs = ["job"]
        self.ended = False

    def join(self, timeout_s=None):
        return self.ended

    def status(self):
        return types.SimpleNamespace(state=TrainerState.RUNNING)

    def operator_pause(self):
        self.calls.append("pause")

    def operator_resume(self):
        self.calls.append("resume")

    def operator_stop(self):
        self.calls.append("stop")


class Lending:
    def __init__(self):
        self.calls, self.num_lent, self.num_taken, self.moves_digest = [], 0, 0, 0
        self.enabled, self.ranks, self.due = True, None, False

    def return_all(self):
        self.calls.append("return")

    def resume_lending(self):
        self.calls.append("resume")

    def reclaim_all(self):
        self.calls.append("reclaim_all")

    def lend_due(self):
        return self.due

    def maybe_lend(self, force=False, tick=None):
        self.calls.append(("tick", tick))

    def after_step(self):
        pass

    def maybe_check_integrity(self):
        return False


class Control:
    def __init__(self, rank):
        self.rank, self.applied, self.steps, self.measured, self.decisions = rank, (0, False), 0, [], []

    def before_step(self, load):
        self.steps += 1
        self.applied = (2, True)
        return types.SimpleNamespace(step=100 + self.steps, level=2, stream=None)

    def apply_decision(self, level, run):
        self.applied = (level, run)
        self.decisions.append((level, run))

    def follow(self, step, level, run):
        self.apply_decision(level, run)
        return types.SimpleNamespace(step=step, level=level, stream=None)

    def after_step(self, tag, seconds):
        self.measured.append((tag, seconds))

    def on_idle(self):
        pass

    def forget_unmeasured(self):
        pass


class Timer:
    """Each rank measures its steps; rank 1 is the slower."""

    outstanding = 0

    def __init__(self, rank):
        self.rank, self.done = rank, []

    def time(self, tag, stream, run, *args, **kwargs):
        self.done.append((tag, 0.010 + 0.005 * self.rank))
        return run(*args, **kwargs)

    def completed(self):
        done, self.done = self.done, []
        return done


class TrainerTp:
    def __init__(self):
        self.aborted = []

    def abort(self, reason):
        self.aborted.append(reason)


def _ranks(size=2):
    group = Group(size)
    built = []
    for rank in range(size):
        config = types.SimpleNamespace(memory=types.SimpleNamespace(release_on_pause=True),
                                       trainer=types.SimpleNamespace(cpu_threads=1, nice=2))
        colo = Colocation(config=config, partitioner=None, step_controller=Control(rank), trainer_host=Host(),
                          lending=Lending(), timer=Timer(rank), metrics=None, refiner=None,
                          ranks=ThreadRanks(group, rank), trainer_tp=TrainerTp())
        built.append(colo)
    return built


def _on_every_rank(colos, action):
    errors = []

    def run(colo):
        try:
            action(colo)
        except BaseException as exc:  # noqa: BLE001
            errors.append(exc)

    threads = [threading.Thread(target=run, args=(colo,)) for colo in colos]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=20)
    assert not errors, errors


def _step(colo):
    colo.run_step(types.SimpleNamespace(batch_size=4, sum_context=100, is_decode=True), lambda: None)


def test_rank_0_decides_and_hears_the_slowest_rank():
    colos = _ranks()
    colos[0].lending.due = True
    for _ in range(3):
        _on_every_rank(colos, _step)
    leader, follower = colos
    assert follower.step_controller.steps == 0 and follower.step_controller.decisions == [(2, True)] * 3  # rank 0's, every step
    # Each step's measurement reaches rank 0 at the next exchange, as the slower rank's.
    assert leader.step_controller.measured == [(101, 0.015), (102, 0.015)]
    assert follower.step_controller.measured == []
    for colo in colos:  # rank 0's lend clock ticks for both
        assert [c for c in colo.lending.calls if c[0] == "tick"] == [("tick", True)] * 3


def test_an_operators_pause_on_rank_0_pauses_and_returns_memory_everywhere():
    colos = _ranks()
    code, _ = colos[0].operator("pause")
    assert code == 200
    _on_every_rank(colos, lambda colo: colo.on_idle())
    for colo in colos:
        assert colo.trainer_host.calls == ["pause"]
        assert "return" in colo.lending.calls


def test_a_trainer_fault_on_rank_1_is_handled_on_both_once():
    colos = _ranks()
    colos[1]._on_trainer_fault(RuntimeError("boom"))
    _on_every_rank(colos, _step)
    colos[0]._on_trainer_fault(RuntimeError("peer"))  # rank 0's trainer then leaves too
    _on_every_rank(colos, _step)
    for colo in colos:
        assert colo.lending.calls.count("reclaim_all") == 1
        assert colo.trainer_tp.aborted == ["the trainer of rank 1 faulted"]


def test_ranks_whose_lending_differs_stop_lending_and_training_everywhere():
    colos = _ranks()
    colos[1].lending.moves_digest = 7
    _on_every_rank(colos, lambda colo: colo.on_idle())
    for colo in colos:
        assert not colo.lending.enabled and colo.trainer_host.calls == ["stop"]
        assert "digests (0, 7)" in colo.ranks_stopped_why
        assert colo.trainer_tp.aborted == []  # the trainers stop at a unit boundary and checkpoint


def test_every_rank_sees_every_ranks_trainer_end_at_the_same_exchange():
    colos = _ranks()
    colos[1].trainer_host.ended = True  # rank 0 still writes the collective checkpoint
    _on_every_rank(colos, lambda colo: colo.on_idle())
    assert [colo.every_ranks_trainer_ended for colo in colos] == [False, False]
    colos[0].trainer_host.ended = True
    _on_every_rank(colos, _step)
    assert [colo.every_ranks_trainer_ended for colo in colos] == [True, True]
