"""The fleet's parts on one machine, fast: the shared step queue, the round arithmetic on
real gloo groups (one thread per rank), and members' rounds against a stand-in trainer."""

from __future__ import annotations

import contextlib
import datetime
import threading
import time

import pytest
import torch
import torch.distributed as dist

from harvest.fleet import averaging
from harvest.fleet.member import FleetMember
from harvest.fleet.options import FleetOptions
from harvest.fleet.store import FleetError
from harvest.fleet.work import ROUND, StepQueue, as_ranges, expand_ranges
from harvest.settings import SettingError
from tests.threads import on_threads


@pytest.fixture()
def store():
    return dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=datetime.timedelta(seconds=10))


def _client(store, prefix="harvest/t/"):
    return dist.PrefixStore(prefix, dist.TCPStore("127.0.0.1", store.port, is_master=False,
                                                  timeout=datetime.timedelta(seconds=10)))


def test_claims_are_disjoint_and_complete_and_a_dead_members_steps_come_back(store):
    a, b = StepQueue(_client(store), "a", 10), StepQueue(_client(store), "b", 10)
    assert a.initialize({"lr": 1}, None, 5) is True and b.initialize({"lr": 1}, None, 5) is False
    claimed = {"a": [], "b": []}
    for _ in range(5):
        claimed["a"].append(a.claim())
        claimed["b"].append(b.claim())
    assert sorted(claimed["a"] + claimed["b"]) == list(range(10)) and a.claim() is None and a.all_claimed
    a.synced(claimed["a"][:3])
    assert a.committed == 3 and a.unsynced == claimed["a"][3:]
    # b dies: what it had not synced goes back, once, and a trains it.
    assert sorted(a.requeue_member("b")) == sorted(claimed["b"]) and a.requeue_member("b") == []
    assert not a.all_claimed
    again = [a.claim() for _ in range(5)]
    assert sorted(again) == sorted(claimed["b"]) and a.claim() is None
    # Leaving gives the unsynced steps back to whoever stays.
    assert sorted(a.give_back()) == sorted(claimed["a"][3:] + again) and a.unsynced == []
    assert a.committed_steps() == sorted(claimed["a"][:3]) and not a.finished


def test_a_restarted_fleet_queues_again_what_its_checkpoint_did_not_hold(store):
    resumed = {"committed_steps": as_ranges([0, 1, 2, 5, 6]), "round": 7}
    assert resumed["committed_steps"] == [[0, 2], [5, 6]] and expand_ranges(resumed["committed_steps"]) == {0, 1, 2, 5, 6}
    queue = StepQueue(_client(store), "a", 9)
    queue.initialize({}, resumed, 5)
    assert queue.committed == 5 and queue.store.get("round") == b"7"
    assert [queue.claim() for _ in range(5)] == [3, 4, 7, 8, None]


def test_a_member_of_another_job_is_refused(store):
    StepQueue(_client(store), "a", 10).initialize({"lr": 1}, None, 5)
    with pytest.raises(FleetError, match="the fleet's job differs"):
        StepQueue(_client(store), "b", 10).initialize({"lr": 2}, None, 5)


def _ranks(store, size, work):
    """Run ``work(group, rank)`` on ``size`` gloo ranks, a thread each; their results."""
    def one(rank):
        group = dist.ProcessGroupGloo(dist.PrefixStore("pg/", _client(store, "")), rank, size,
                                      datetime.timedelta(seconds=20))
        return work(group, rank)

    results, errors = on_threads(one, size, timeout_s=60)
    assert not errors, errors
    return results


def test_weighted_average_weighs_members_by_their_tokens(store):
    weights = [torch.tensor([1.0, 2.0]), torch.tensor([3.0, 6.0]), torch.tensor([10.0, 10.0])]
    tokens = [100, 300, 0]
    results = _ranks(store, 3, lambda g, r: averaging.weighted_average(g, 3, weights[r].clone(), tokens[r], 10))
    for mean, total in results:
        assert total == 400 and torch.allclose(mean, torch.tensor([2.5, 5.0]))  # the member with 0 tokens weighs 0


def test_a_round_where_nobody_trained_takes_the_plain_mean(store):
    results = _ranks(store, 2, lambda g, r: averaging.weighted_average(g, 2, torch.tensor([float(r)]), 0, 10))
    assert [float(mean) for mean, _ in results] == [0.5, 0.5]


def test_outer_nesterov_steps_from_the_fleets_anchor_and_a_fresh_member_adopts_it(store):
    outer = [averaging.OuterNesterov(lr=0.7, momentum=0.9) for _ in range(2)]
    outer[0].anchor, outer[0].velocity = torch.tensor([1.0]), torch.tensor([0.5])
    mean = torch.tensor([0.0])

    def work(group, rank):
        return outer[rank].step(group, 2, mean, torch.tensor([42.0]), fresh=rank == 1, timeout_s=10)

    results = _ranks(store, 2, work)
    delta = 1.0 - 0.0
    velocity = 0.9 * 0.5 + delta
    expected = 1.0 - 0.7 * (delta + 0.9 * velocity)
    assert [float(r) for r in results] == pytest.approx([expected, expected])
    assert float(outer[1].velocity) == pytest.approx(velocity)  # the fresh member's outer state is the fleet's now


def test_every_step_gradients_are_the_whole_steps(store):
    params = [[torch.nn.Parameter(torch.zeros(2))] for _ in range(2)]
    grads = [torch.tensor([1.0, 0.0]), torch.tensor([0.0, 4.0])]
    label_tokens, losses = [10, 30], [2.0, 1.0]
    for p, g in zip(params, grads):
        p[0].grad = g.clone()

    results = _ranks(store, 2, lambda g, r: averaging.sum_gradients(g, params[r], label_tokens[r], losses[r], 10))
    for (loss, total), p in zip(results, params):
        assert total == 40 and loss == pytest.approx((2.0 * 10 + 1.0 * 30) / 40)
        assert torch.allclose(p[0].grad, torch.tensor([10 / 40, 4.0 * 30 / 40]))


class StandInTrainer:
    """What a member needs of a trainer: weights as a vector, tokens and steps per round."""

    def __init__(self, value: float):
        self.weights = torch.tensor([value])
        self.tokens, self.steps, self.checkpoints = 0, [], []
        self.lock = threading.Lock()
        self.dead = False  # as a killed process: no round gets its weights any more

    def train(self, step: int, tokens: int, change: float) -> None:
        with self.lock:
            self.weights += change
            self.tokens += tokens
            self.steps.append(step)

    def fleet_snapshot(self):
        with self.lock:
            if self.dead:
                raise RuntimeError("this member's process is dead")
            steps, self.steps, tokens, self.tokens = self.steps, [], self.tokens, 0
            return self.weights.clone(), tokens, steps

    def fleet_apply(self, result, snapshot):
        with self.lock:
            self.weights = result + (self.weights - snapshot)

    def fleet_checkpoint(self, state, final):
        self.checkpoints.append((state, final))


def _member(port, **options):
    settings = dict(rendezvous=f"127.0.0.1:{port}", job_id="t", sync_interval_s=0.3, heartbeat_s=0.1,
                    dead_after_s=1.0, collective_timeout_s=10.0)
    return FleetMember(FleetOptions(**{**settings, **options}), job_id="t", total_steps=6, fingerprint={})


def _until(predicate, timeout_s=30.0):
    deadline = time.monotonic() + timeout_s
    while not predicate():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.05)


@contextlib.contextmanager
def _between_rounds(store, *trainers, job_id="t"):
    """Hold every trainer's lock at a moment no round is between its members' snapshots.

    A round takes each member's snapshot at that member's own moment, once the round has
    closed (its size set): what is trained between two members' snapshots counts in one
    and not the other. So under the locks the current round must not have closed yet (the
    previous one had every snapshot taken: its all-reduce needed them); a round that closes
    meanwhile takes its snapshots after the locks are let go, all of them."""
    job = dist.PrefixStore(f"harvest/{job_id}/", store)
    while True:
        with contextlib.ExitStack() as locks:
            for trainer in trainers:
                locks.enter_context(trainer.lock)
            if not job.check([f"r{int(job.get(ROUND))}/size"]):
                yield
                return
        time.sleep(0.01)


def test_members_average_a_joiner_gets_the_weights_and_a_dead_members_steps_are_trained_again(store):
    # Silent for 3 s is dead: a loaded machine can stall a heartbeat thread 1 s (a live
    # member dropped, its steps re-queued), and the test waits this long once.
    first, trainer_first = _member(store.port, dead_after_s=3.0), StandInTrainer(0.0)
    first.start(trainer_first, None)
    _until(first.joined.is_set)  # alone: its first round is its own
    step = first.claim()
    trainer_first.train(step, tokens=10, change=4.0)
    _until(lambda: first.stats()["committed_steps"] == 1)
    # A second member comes with other weights: its first round gives it the fleet's.
    second, trainer_second = _member(store.port, dead_after_s=3.0), StandInTrainer(100.0)
    second.start(trainer_second, None)
    _until(second.joined.is_set)
    assert float(trainer_second.weights) == pytest.approx(float(trainer_first.weights)) == pytest.approx(4.0)
    # Both train; the next round averages by tokens. (Both in one go: a round between the
    # two would average the first's 30 tokens against none.)
    with _between_rounds(store, trainer_first, trainer_second):
        for member, trainer, tokens, change in ((first, trainer_first, 30, 1.0), (second, trainer_second, 10, 5.0)):
            trainer.weights += change
            trainer.tokens += tokens
            trainer.steps.append(member.claim())
    _until(lambda: first.stats()["committed_steps"] == 3 and second.stats()["committed_steps"] == 3)
    assert float(trainer_first.weights) == pytest.approx(4.0 + (30 * 1.0 + 10 * 5.0) / 40)
    assert float(trainer_second.weights) == pytest.approx(float(trainer_first.weights))
    # The second member dies holding an unsynced step (its threads stop, nobody deregisters
    # it, and a round it had already closed gets no snapshot from it): no round syncs it.
    with _between_rounds(store, trainer_first, trainer_second):
        lost = second.claim()
        trainer_second.weights += 1.0
        trainer_second.tokens += 10
        trainer_second.steps.append(lost)
        trainer_second.dead = True
        second._stop.set()
    _until(lambda: first.stats()["steps_requeued"] == 1)
    # The first member trains the rest, the dead member's step included, and the job finishes.
    trained = []
    while (step := first.claim()) is not None:
        trained.append(step)
        trainer_first.train(step, tokens=10, change=0.0)
    assert lost in trained
    _until(lambda: first.done)
    assert [final for _, final in trainer_first.checkpoints] == [True]  # no save_steps: the final one only
    assert expand_ranges(trainer_first.checkpoints[-1][0]["committed_steps"]) == set(range(6))
    first.leave()


class EndOfJobTrainer(StandInTrainer):
    """A stand-in whose round of rank > 0 puts its weights back (and syncs its steps) only
    after the round's rank 0 is through (or 3 s): the ordering in which the fleet once
    finished with no adapter on disk, rank 0 deciding from the committed count before the
    others' steps were in it. ``on_final`` runs in place of writing the final adapter."""

    def __init__(self, value, rank0_through, finals, on_final=None):
        super().__init__(value)
        self.rank, self.snapshot_steps = None, []
        self.rank0_through, self.finals, self.on_final = rank0_through, finals, on_final

    def fleet_snapshot(self):
        weights, tokens, steps = super().fleet_snapshot()
        self.snapshot_steps = steps
        return weights, tokens, steps

    def fleet_apply(self, result, snapshot):
        if self.snapshot_steps and self.rank != 0:
            self.rank0_through.wait(3.0)
        super().fleet_apply(result, snapshot)

    def fleet_checkpoint(self, state, final):
        if final:
            self.finals.append(self)
            if self.on_final is not None:
                self.on_final(self)
        super().fleet_checkpoint(state, final)


def _two_members_finish_together(store, on_final=None, dead_after_s=30.0):
    """Two members, each trains one of the job's two steps, one round commits both.
    ``on_final(trainer, pairs)`` runs where the final adapter would be written."""
    rank0_through, finals, pairs = threading.Event(), [], []
    for value in (0.0, 100.0):
        hook = (lambda trainer: on_final(trainer, pairs)) if on_final is not None else None
        member, trainer = _member(store.port, min_members=2, dead_after_s=dead_after_s), EndOfJobTrainer(value, rank0_through, finals, hook)
        member.total_steps = 2
        original = member._run_round

        def run_round(store_, number, rank, size, fresh, _original=original, _trainer=trainer):
            _trainer.rank = rank
            try:
                _original(store_, number, rank, size, fresh)
            finally:
                if rank == 0 and _trainer.snapshot_steps:
                    rank0_through.set()

        member._run_round = run_round
        member.start(trainer, None)
        pairs.append((member, trainer))
    for member, _ in pairs:
        _until(member.joined.is_set)
    # Both steps are trained before any round can take a snapshot: the round that takes
    # one holds both members and finishes the job.
    with pairs[0][1].lock, pairs[1][1].lock:
        for member, trainer in pairs:
            step = member.claim()
            trainer.weights += 1.0
            trainer.tokens += 10
            trainer.steps.append(step)
    return pairs, finals


def test_the_final_adapter_is_written_before_any_member_is_done_whichever_syncs_last(store):
    seen_done: list[list[bool]] = []
    pairs, finals = _two_members_finish_together(
        store, on_final=lambda trainer, pairs: seen_done.append([member.done for member, _ in pairs]))
    for member, _ in pairs:
        _until(lambda: member.done)
    assert len(finals) == 1 and seen_done == [[False, False]]  # one writer, and nobody was done before it wrote
    state, final = finals[0].checkpoints[-1]
    assert final and expand_ranges(state["committed_steps"]) == {0, 1}
    assert float(pairs[0][1].weights) == pytest.approx(float(pairs[1][1].weights))
    for member, _ in pairs:
        member.leave()


def test_a_holder_writes_the_final_adapter_when_the_elected_writer_dies(store):
    released = threading.Event()

    def die(trainer, pairs):  # the elected writer's process dies before its adapter is on disk
        if len(trainer.finals) == 1:
            next(member for member, t in pairs if t is trainer)._stop.set()  # its heartbeat stops
            released.wait(60)
            raise RuntimeError("killed")

    # A member silent for 3 s is gone: long enough that a loaded machine's stalls do not
    # drop a live one, short enough to wait for the killed writer.
    pairs, finals = _two_members_finish_together(store, on_final=die, dead_after_s=3.0)
    try:
        _until(lambda: len(finals) == 2, timeout_s=60)
        survivor = next(member for member, trainer in pairs if trainer is finals[1])
        _until(lambda: survivor.done)
        assert finals[0] is not finals[1] and finals[1].checkpoints[-1][1] is True
        assert not next(member for member, trainer in pairs if trainer is finals[0]).done
    finally:
        released.set()
    for member, _ in pairs:
        member.leave()


def test_fleet_options_are_checked():
    with pytest.raises(SettingError, match="max_members"):
        FleetOptions(rendezvous="h:1", min_members=3, max_members=2)
    with pytest.raises(SettingError, match="dead_after_s"):
        FleetOptions(rendezvous="h:1", heartbeat_s=5, dead_after_s=5)
    with pytest.raises(SettingError, match="HOST:PORT"):
        FleetOptions(rendezvous="no-port")
    assert FleetOptions(rendezvous="[::1]:29500").host_port == ("::1", 29500)
    assert not FleetOptions().enabled


def test_what_a_fleet_member_cannot_run_is_refused_by_key(tiny_llama_path, tmp_path):
    from harvest.train.errors import JobError
    from harvest.train.job import load_job
    from harvest.train.plan import check_job
    from tests.fleet.helpers import write_fleet_job

    for keys, key in (({"eval_strategy": "steps", "eval_steps": 2, "val_size": 0.2}, "eval_strategy"),
                      ({"overwrite_output_dir": True}, "overwrite_output_dir"),
                      ({"lr_scheduler_type": "reduce_lr_on_plateau"}, "lr_scheduler_type")):
        job = write_fleet_job(tmp_path / key, tiny_llama_path, port=29500, max_steps=4, **keys)
        with pytest.raises(JobError, match=f"{key}: "):
            check_job(load_job(job))
    fine = write_fleet_job(tmp_path / "fine", tiny_llama_path, port=29500, max_steps=4)
    assert check_job(load_job(fine)).total_steps == 4
