"""The job queue's policy without threads (harvest.colocate.job_queue): which job is built
next, who holds the trainer, what an end, a cancellation, a stop or a weight change does,
and seeded random sequences of all of them checked against the queue's invariants."""

from __future__ import annotations

import random
from pathlib import Path

import pytest

from harvest.colocate.job_queue import Handover, JobQueue, JobRefused, JobSpec
from harvest.schedule import TrainerState
from harvest.schedule.fair_share import FairShare

QUANTUM_S = 0.5
STARVATION_S = 30.0


def spec(name, weight=1.0, output_dir=None):
    return JobSpec(Path(f"/jobs/{name}.yaml"), name, weight, None, Path(output_dir) if output_dir else None)


def queue(*names, max_running=4, weights=None):
    weights = weights or {}
    return JobQueue([spec(n, weights.get(n, 1.0)) for n in names], max_running=max_running,
                    fair=FairShare(QUANTUM_S, STARVATION_S))


def start_all(q):
    started = []
    while (run := q.next_to_start()) is not None:
        started.append(run)
    return started


def build(q, run, now=0.0, baseline=(0, 0, 0)):
    return q.built(run, object(), baseline, now)


def run_named(q, name):
    return next(r for r in q.runs if r.name == name and not r.ended)


# -- which job is built next ---------------------------------------------------------------
def test_jobs_start_in_submission_order_up_to_max_running():
    q = queue("a", "b", "c", max_running=2)
    started = start_all(q)
    assert [r.name for r in started] == ["a", "b"]
    assert [r.state for r in q.runs] == ["building", "building", "queued"]
    assert all(r.started_at is not None for r in started) and q.runs[2].started_at is None
    assert q.next_to_start() is None  # full: c waits


def test_an_ended_job_frees_its_place_for_the_next_queued_one():
    q = queue("a", "b", "c", max_running=2)
    a, b = start_all(q)
    build(q, a)
    assert q.next_to_start() is None
    q.end(a, "finished", 1.0)
    assert q.next_to_start().name == "c"
    q.end(b, "failed", 2.0)  # a build that failed frees its place too
    assert q.next_to_start() is None  # nothing queued


def test_instances_count_every_submission():
    q = queue("a")
    q.end(start_all(q)[0], "finished", 0.0)
    again = q.submit(spec("a"))
    assert [r.instance for r in q.runs] == [1, 2] and again.state == "queued"


# -- who holds the trainer ---------------------------------------------------------------------
def test_the_first_built_job_takes_the_trainer_and_the_next_waits_for_its_slice():
    q = queue("a", "b")
    a, b = start_all(q)
    assert build(q, a, 0.0) == Handover(None, a)
    assert q.active is a and q.last_active is a and a.state == "running" and a.running_since == 0.0
    assert build(q, b, 0.1) is None  # a holds it: b is runnable and waits for a's slice to end
    assert q.active is a and set(q.fair.accounts) == {"a", "b"}


def test_the_built_job_records_its_trainer_and_baseline():
    q = queue("a")
    (a,) = start_all(q)
    trainer = object()
    q.built(a, trainer, (100, 10, 3), 5.0)
    assert a.trainer is trainer and a.baseline == (100, 10, 3)


def test_a_lone_job_keeps_the_trainer_whatever_its_units_cost():
    q = queue("a")
    (a,) = start_all(q)
    build(q, a)
    for i in range(10):
        assert q.unit_done(a, 1.0, float(i)) is None
    assert a.trainer_s == 10.0 and q.active is a


def test_the_slice_ends_after_the_quantum_and_the_trainer_goes_to_the_job_behind():
    q = queue("a", "b")
    a, b = start_all(q)
    build(q, a, 0.0)
    build(q, b, 0.0)
    assert q.unit_done(a, 0.2, 0.2) is None  # within the quantum
    handover = q.unit_done(a, 0.4, 0.6)  # past it: b is behind
    assert handover == Handover(a, b)
    assert q.active is b and q.last_active is b and q.fair.running == "b"
    assert a.trainer_s == pytest.approx(0.6)


def test_a_unit_of_a_job_not_holding_the_trainer_is_charged_without_a_handover():
    q = queue("a", "b")
    a, b = start_all(q)
    build(q, a)
    build(q, b)
    assert q.unit_done(b, 5.0, 1.0) is None  # e.g. its last unit, finishing after the handover
    assert b.trainer_s == 5.0 and q.active is a


def test_the_trainer_time_follows_the_weights():
    q = queue("a", "b", weights={"a": 1.0, "b": 3.0})
    a, b = start_all(q)
    build(q, a)
    build(q, b)
    now = 0.0
    for _ in range(4000):
        now += 0.01
        q.unit_done(q.active, 0.01, now)
    assert b.trainer_s / (a.trainer_s + b.trainer_s) == pytest.approx(0.75, abs=0.02)
    shares = q.shares()
    assert shares[a.instance] + shares[b.instance] == pytest.approx(1.0)


def test_a_starving_job_gets_the_next_slice_whatever_its_weight():
    q = queue("heavy", "light", weights={"heavy": 100.0, "light": 0.01})
    heavy, light = start_all(q)
    build(q, heavy, 0.0)
    build(q, light, 0.0)
    now, holders = 0.0, []
    while now < 3 * STARVATION_S:
        now += 0.1
        handover = q.unit_done(q.active, 0.1, now)
        if handover is not None:
            holders.append((round(now, 1), handover.target.name))
    assert any(name == "light" for _, name in holders)  # light ran within every starvation_s


def test_the_end_of_the_active_job_hands_the_trainer_on_and_the_last_job_leaves_it_idle():
    q = queue("a", "b")
    a, b = start_all(q)
    build(q, a)
    build(q, b)
    assert q.end(a, "finished", 1.0) == Handover(None, b)  # a's thread ended: no gate to pause
    assert "a" not in q.fair.accounts and q.active is b
    assert q.end(b, "stopped", 2.0) == Handover(None, None)
    assert q.active is None and q.last_active is b and not q.fair.accounts


def test_the_end_of_a_job_not_holding_the_trainer_changes_no_hands():
    q = queue("a", "b", "c")
    a, b, c = start_all(q)
    build(q, a)
    build(q, b)
    assert q.end(b, "failed", 1.0) is None and q.active is a and "b" not in q.fair.accounts
    assert q.end(c, "failed", 1.0) is None  # failed while building: it never shared
    assert set(q.fair.accounts) == {"a"}


# -- operator commands -------------------------------------------------------------------------
def test_cancelling_a_queued_job_ends_it_at_once_and_a_built_one_is_left_to_its_gate():
    q = queue("a", "b", max_running=1)
    (a,) = start_all(q)
    build(q, a)
    b = q.cancel("b", 1.0)
    assert b.cancelled and b.state == "cancelled" and b.ended and b.ended_at is not None
    assert q.cancel("a", 1.0) is a and a.cancelled and a.state == "running"  # stops at its next unit boundary
    with pytest.raises(JobRefused, match="no live job named 'b'"):
        q.cancel("b", 1.0)


def test_a_cancelled_jobs_name_is_free_again():
    q = queue("a")
    q.cancel("a", 0.0)
    assert q.submit(spec("a")).state == "queued"


def test_names_and_output_folders_of_live_jobs_are_unique(tmp_path):
    q = JobQueue([spec("a", output_dir=tmp_path / "out")], max_running=4, fair=FairShare())
    with pytest.raises(JobRefused, match="a job named 'a' is already queued"):
        q.submit(spec("a"))
    with pytest.raises(JobRefused, match="is the output_dir of job 'a'"):
        q.submit(spec("b", output_dir=tmp_path / "x" / ".." / "out"))  # the same folder, spelled otherwise
    q.cancel("a", 0.0)
    assert q.submit(spec("b", output_dir=tmp_path / "out")).name == "b"  # an ended job clashes with nothing


def test_set_weight_on_a_sharing_a_waiting_and_an_unknown_job():
    q = queue("a", "b", max_running=1)
    (a,) = start_all(q)
    build(q, a)
    run, previous = q.set_weight("a", 4)
    assert run is a and previous == 1.0 and a.weight == 4.0 and q.fair.accounts["a"].weight == 4.0
    run, previous = q.set_weight("b", 2)  # queued: kept for when it shares
    assert run.name == "b" and run.weight == 2.0 and "b" not in q.fair.accounts
    for bad in (0, -1, float("inf"), float("nan"), True, "3"):
        with pytest.raises(ValueError, match="weight must be a positive number"):
            q.set_weight("a", bad)
        with pytest.raises(JobRefused, match="weight must be a positive number"):
            q.set_weight("b", bad)
    assert a.weight == 4.0 and run.weight == 2.0
    with pytest.raises(JobRefused, match=r"no live job named 'zzz' \(live: a, b\)"):
        q.set_weight("zzz", 1)


def test_a_stop_ends_the_queued_jobs_and_refuses_new_ones():
    q = queue("a", "b", max_running=1)
    (a,) = start_all(q)
    q.stop()
    assert q.stopped and a.state == "building" and q.runs[1].state == "stopped"
    assert q.next_to_start() is None
    with pytest.raises(JobRefused, match="has been stopped"):
        q.submit(spec("c"))


# -- what the scheduler sees while nobody holds the trainer -------------------------------------
def test_idle_state():
    assert queue().idle_state(False) is TrainerState.ABSENT
    q = queue("a")
    assert q.idle_state(False) is TrainerState.BUILDING  # queued
    assert q.idle_state(True) is TrainerState.PAUSED
    (a,) = start_all(q)
    assert q.idle_state(False) is TrainerState.BUILDING
    q.end(a, "finished", 1.0)
    assert q.idle_state(False) is TrainerState.FINISHED
    q.submit(spec("b"))
    (b,) = start_all(q)
    q.end(b, "failed", 2.0)
    b.ended_at = a.ended_at + 1.0  # the latest end decides
    assert q.idle_state(False) is TrainerState.FAILED
    q.submit(spec("c"))
    q.cancel("c", 3.0)
    q.runs[-1].ended_at = b.ended_at + 1.0
    assert q.idle_state(False) is TrainerState.STOPPED  # cancelled: stopped
    q.stop()
    assert q.idle_state(False) is TrainerState.STOPPED


# -- random sequences --------------------------------------------------------------------------
def _check_invariants(q, started_order):
    built = [r for r in q.runs if r.state in ("building", "running")]
    assert len(built) <= q.max_running
    running = {r.name for r in q.runs if r.state == "running"}
    assert set(q.fair.accounts) == running  # exactly the running jobs share
    assert q.active is None or q.active.state == "running"
    if q.active is not None:
        assert q.fair.running == q.active.name
    live_names = [r.name for r in q.runs if not r.ended]
    assert len(live_names) == len(set(live_names))  # a name is live at most once
    # Jobs start in submission order.
    assert started_order == sorted(started_order)
    if q.stopped:
        assert not any(r.state == "queued" for r in q.runs)
    # Nobody holds the trainer while a job could: a running job gets it at once.
    if running:
        assert q.active is not None
    shares = q.shares()
    assert set(shares) == {r.instance for r in q.runs if r.state == "running"}
    assert all(0.0 <= s <= 1.0 for s in shares.values())


@pytest.mark.parametrize("seed", range(40))
def test_random_sequences_keep_the_queue_consistent(seed):
    rng = random.Random(seed)
    q = queue(*(f"j{i}" for i in range(rng.randint(0, 4))), max_running=rng.randint(1, 3))
    now, names, started_order = 0.0, 10, []
    for _ in range(300):
        now += rng.uniform(0.0, 0.3)
        op = rng.choice(["submit", "start", "build", "unit", "unit", "unit", "end", "cancel", "weight", "stop"])
        building = [r for r in q.runs if r.state == "building"]
        running = [r for r in q.runs if r.state == "running"]
        live = [r for r in q.runs if not r.ended]
        if op == "submit":
            name = f"j{rng.randint(0, names)}"
            try:
                q.submit(spec(name, rng.choice([0.5, 1.0, 3.0])))
            except JobRefused:
                assert q.stopped or any(r.name == name for r in live)
        elif op == "start":
            while (run := q.next_to_start()) is not None:
                started_order.append(run.instance)
        elif op == "build" and building:
            run = rng.choice(building)
            before = q.active
            handover = q.built(run, object(), (0, 0, 0), now)
            assert (handover is None) == (before is not None)
            if handover is not None:
                assert handover.previous is None and q.active is handover.target
        elif op == "unit" and running:
            run = q.active if q.active is not None and rng.random() < 0.9 else rng.choice(running)
            before = q.active
            handover = q.unit_done(run, rng.uniform(0.0, 0.4), now)
            if handover is not None:
                assert before is run and handover.previous is run and handover.target is q.active
                assert handover.target is not run
        elif op == "end" and (building or running):
            run = rng.choice(building + running)
            was_active = q.active is run
            handover = q.end(run, rng.choice(["finished", "stopped", "cancelled", "failed"]), now)
            assert run.ended and (handover is not None) == was_active
            if handover is not None:
                assert handover.previous is None and handover.target is q.active
        elif op == "cancel" and live:
            run = rng.choice(live)
            was = run.state
            assert q.cancel(run.name, now) is run and run.cancelled
            assert run.ended == (was == "queued")
        elif op == "weight" and live:
            run = rng.choice(live)
            got, previous = q.set_weight(run.name, 2.0)
            assert got is run and run.weight == 2.0
        elif op == "stop" and rng.random() < 0.1:
            q.stop()
        _check_invariants(q, started_order)
