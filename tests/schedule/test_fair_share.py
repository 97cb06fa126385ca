"""The fair-share rule between a server's jobs (harvest.schedule.fair_share), driven by a
simulated trainer: every property over many seeds, weights and unit lengths."""

from __future__ import annotations

import random

import pytest

from harvest.schedule.fair_share import FairShare, JobQueueConfig


def simulate(share: FairShare, seconds: float, unit_s, *, now: float = 0.0, on_unit=None) -> float:
    """Run the trainer for ``seconds``: at each unit boundary ask for the next slice and
    charge one unit (``unit_s(name)`` seconds) to it. Returns the clock at the end."""
    end = now + seconds
    while now < end:
        name = share.next_slice(now)
        if name is None:
            now += 0.01
            continue
        took = unit_s(name)
        share.charge(name, took)
        now += took
        if on_unit is not None:
            on_unit(now, name)
    return now


def started(weights: dict, **kwargs) -> FairShare:
    share = FairShare(**kwargs)
    for name, weight in weights.items():
        share.add(name, weight)
        share.set_runnable(name, True, 0.0)
    return share


def test_weights_1_and_3_get_a_quarter_and_three_quarters():
    share = started({"a": 1, "b": 3}, quantum_s=0.5)
    simulate(share, 120.0, lambda name: 0.01)
    shares = share.shares()
    assert shares["a"] == pytest.approx(0.25, abs=0.01) and shares["b"] == pytest.approx(0.75, abs=0.01)


@pytest.mark.parametrize("seed", range(20))
def test_virtual_times_of_runnable_jobs_stay_within_one_slice(seed):
    """The fair-queueing bound: between two jobs runnable throughout, virtual times never
    drift apart by more than a slice (quantum plus one unit) over the smaller weight."""
    rng = random.Random(seed)
    weights = {f"j{i}": rng.choice([0.5, 1, 2, 3, 7]) for i in range(rng.randint(2, 5))}
    quantum = rng.choice([0.05, 0.2, 0.5])
    longest_unit = rng.choice([0.002, 0.01, 0.03])
    share = started(weights, quantum_s=quantum, starvation_s=1e9)
    bound = (quantum + longest_unit) / min(weights.values()) + 1e-9

    def check(now, name):
        virtual = [account.virtual_s for account in share.accounts.values()]
        assert max(virtual) - min(virtual) <= bound

    simulate(share, 30.0, lambda name: rng.uniform(longest_unit / 10, longest_unit), on_unit=check)
    total = sum(account.service_s for account in share.accounts.values())
    for name, weight in weights.items():
        fair = total * weight / sum(weights.values())
        assert abs(share.accounts[name].service_s - fair) <= bound * sum(weights.values())


def test_deficits_sum_to_zero_and_say_who_is_behind():
    share = started({"a": 1, "b": 1})
    share.charge("a", 2.0)
    assert share.deficit_s("a") == pytest.approx(-1.0) and share.deficit_s("b") == pytest.approx(1.0)
    share.add("c", 2)  # not runnable yet: no deficit, not counted
    assert share.deficit_s("c") == 0.0
    assert sum(share.deficit_s(name) for name in ("a", "b")) == pytest.approx(0.0)
    assert share.deficit_s("nobody") == 0.0


def test_a_late_job_gets_its_share_from_now_on_not_back_pay():
    share = started({"a": 1}, quantum_s=0.2)
    now = simulate(share, 60.0, lambda name: 0.01)
    share.add("b", 1)
    share.set_runnable("b", True, now)
    before = {name: account.service_s for name, account in share.accounts.items()}
    simulate(share, 20.0, lambda name: 0.01, now=now)
    gained = {name: share.accounts[name].service_s - before[name] for name in ("a", "b")}
    assert gained["b"] == pytest.approx(10.0, abs=0.5) and gained["a"] == pytest.approx(10.0, abs=0.5)


def test_the_starvation_guard_runs_a_tiny_weight_every_starvation_interval():
    share = started({"small": 0.001, "big": 1000}, quantum_s=0.5, starvation_s=5.0)
    runs = []
    simulate(share, 60.0, lambda name: 0.01, on_unit=lambda now, name: runs.append((now, name)))
    small = [now for now, name in runs if name == "small"]
    assert small, "the small job never ran"
    starts = [small[0]] + [b for a, b in zip(small, small[1:]) if b - a > 0.1]
    gaps = [b - a for a, b in zip(starts, starts[1:])]
    # start to start: its own slice, then at most starvation_s plus the rest of the big job's slice
    assert gaps and max(gaps) <= 0.5 + 5.0 + 0.5 + 0.02


def test_a_slice_lasts_a_quantum_before_switching():
    share = started({"a": 1, "b": 1}, quantum_s=0.5)
    runs = []
    simulate(share, 5.0, lambda name: 0.01, on_unit=lambda now, name: runs.append(name))
    switches = sum(a != b for a, b in zip(runs, runs[1:]))
    assert 8 <= switches <= 10  # 5 s of 0.5 s slices


def test_one_job_never_switches_and_nothing_runnable_is_none():
    share = started({"only": 2})
    assert all(share.next_slice(t) == "only" for t in range(100))
    share.set_runnable("only", False, 100.0)
    assert share.next_slice(101.0) is None and share.running is None


def test_a_weight_change_takes_effect_at_the_next_choice():
    share = started({"a": 1, "b": 1}, quantum_s=0.1)
    now = simulate(share, 10.0, lambda name: 0.01)
    share.set_weight("a", 3)
    before = {name: account.service_s for name, account in share.accounts.items()}
    simulate(share, 40.0, lambda name: 0.01, now=now)
    gained_a = share.accounts["a"].service_s - before["a"]
    gained_b = share.accounts["b"].service_s - before["b"]
    assert gained_a / (gained_a + gained_b) == pytest.approx(0.75, abs=0.02)


def test_removing_the_running_job_frees_the_trainer():
    share = started({"a": 1, "b": 1})
    first = share.next_slice(0.0)
    share.remove(first)
    assert share.running is None and share.next_slice(0.1) != first
    share.charge(first, 1.0)  # its last unit, charged after it left: ignored


@pytest.mark.parametrize(("call", "message"), [
    (lambda s: s.add("a", 0), "weight must be a positive number"),
    (lambda s: s.add("a", float("inf")), "weight must be a positive number"),
    (lambda s: s.add("a", True), "weight must be a positive number"),
    (lambda s: (s.add("a", 1), s.add("a", 2)), "already shares the trainer"),
    (lambda s: (s.add("a", 1), s.charge("a", -1.0)), "finite non-negative"),
    (lambda s: (s.add("a", 1), s.set_weight("a", -2)), "weight must be a positive number"),
])
def test_bad_input_is_refused_with_the_reason(call, message):
    with pytest.raises(ValueError, match=message):
        call(FairShare())


def test_bad_rule_settings_are_refused():
    with pytest.raises(ValueError, match="quantum_s"):
        FairShare(quantum_s=0)
    with pytest.raises(ValueError, match="starvation_s"):
        FairShare(starvation_s=-1)
    with pytest.raises(ValueError, match="max_running"):
        JobQueueConfig(max_running=0)
