"""LentMemoryBudget: what the memory side publishes (lent, wanted back) and the one
follower's acknowledgements. Threaded tests run under timeouts."""

from __future__ import annotations

import threading
import time

import pytest

from harvest.memory.lent_budget import BudgetSnapshot, LentMemoryBudget
from tests.metrics.test_control import wait_for


def test_publish_bumps_the_generation_only_on_a_change_and_wakes_the_follower():
    budget = LentMemoryBudget()
    wakes = []
    budget.follow(lambda: wakes.append(budget.snapshot))
    assert budget.snapshot == BudgetSnapshot(0, 0, 0)
    assert budget.publish(lent_bytes=100, wanted_back_bytes=0) == 1
    assert budget.publish(lent_bytes=100, wanted_back_bytes=0) == 1  # unchanged: no wake-up
    assert budget.publish(lent_bytes=100, wanted_back_bytes=40) == 2
    assert [w.generation for w in wakes] == [1, 2]  # each wake sees the snapshot it announces
    assert budget.snapshot.limit_bytes == 60
    with pytest.raises(ValueError, match="wanted_back_bytes=101"):
        budget.publish(lent_bytes=100, wanted_back_bytes=101)
    assert budget.snapshot.generation == 2


def test_one_follower_at_a_time():
    budget = LentMemoryBudget()
    unfollow = budget.follow(lambda: None)
    with pytest.raises(RuntimeError, match="already"):
        budget.follow(lambda: None)
    unfollow()
    budget.follow(lambda: None)()


@pytest.mark.timeout(20)
def test_several_jobs_follow_and_a_wait_waits_for_every_one():
    """The job queue: one trainer thread per job follows; each is woken by a publish, and
    a wait ends when all of them applied the generation (or left)."""
    budget = LentMemoryBudget()
    woken = {"a": threading.Event(), "b": threading.Event()}
    acknowledge = {"a": threading.Event(), "b": threading.Event()}
    leave = threading.Event()

    def follower(name):
        unfollow = budget.follow(woken[name].set)
        acknowledge[name].wait(10)
        budget.acknowledge(budget.snapshot.generation)
        leave.wait(10)
        unfollow()

    threads = [threading.Thread(target=follower, args=(name,)) for name in ("a", "b")]
    for thread in threads:
        thread.start()
    assert wait_for(lambda: len(budget._followers) == 2)
    generation = budget.publish(lent_bytes=100, wanted_back_bytes=50)
    assert woken["a"].wait(5) and woken["b"].wait(5)
    acknowledge["a"].set()
    assert budget.wait_acknowledged(generation, timeout_s=0.2) is False  # b has not applied it
    acknowledge["b"].set()
    assert budget.wait_acknowledged(generation, timeout_s=5)
    leave.set()
    for thread in threads:
        thread.join(10)
    assert not budget.followed


def test_waits_end_at_the_acknowledgement_at_the_bound_or_when_nobody_follows():
    budget = LentMemoryBudget()
    generation = budget.publish(lent_bytes=100, wanted_back_bytes=100)
    assert budget.wait_acknowledged(generation, timeout_s=5)  # no follower: nobody holds anything
    unfollow = budget.follow(lambda: None)
    generation = budget.publish(lent_bytes=100, wanted_back_bytes=50)
    started = time.monotonic()
    assert budget.wait_acknowledged(generation, timeout_s=0.1) is False
    assert time.monotonic() - started >= 0.1
    threading.Timer(0.05, budget.acknowledge, (generation,)).start()
    assert budget.wait_acknowledged(generation, timeout_s=5)
    assert budget.acknowledged_generation == generation
    generation = budget.publish(lent_bytes=100, wanted_back_bytes=100)
    threading.Timer(0.05, unfollow).start()  # a follower that leaves has let go of everything
    assert budget.wait_acknowledged(generation, timeout_s=5)
    assert not budget.followed
