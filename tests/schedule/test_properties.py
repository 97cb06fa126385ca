"""Randomised sequences (seeded, reproducible): random ladders, configs, predictions
(NaN, ±inf, ≤ 0 and ties included), trainer states and measurements, checked against an
independent brute-force statement of the rule after every step."""

from __future__ import annotations

import collections
import math
import random

import pytest

from harvest.ladder import GREEN_CONTEXTS, Ladder, Level
from harvest.schedule import (
    DecisionReason as R,
    QoSController,
    SchedulerConfig,
    SchedulerInput,
    TrainerAction,
    TrainerState,
)

IDLE_REASON = {
    TrainerState.STARVED: R.TRAINER_STARVED,
    TrainerState.PAUSED: R.TRAINER_PAUSED,
    TrainerState.STOPPED: R.TRAINER_STOPPED,
    TrainerState.FINISHED: R.TRAINER_STOPPED,
    TrainerState.FAILED: R.TRAINER_STOPPED,
    TrainerState.BUILDING: R.NO_TRAINER,
    TrainerState.ABSENT: R.NO_TRAINER,
}


def fits(ms: float, budget: float) -> bool:
    return math.isfinite(ms) and 0.0 < ms <= budget


def brute_closest(ladder: Ladder, colo, budget):
    """max by (latency, trainer SMs, −index) over trainer levels that fit; None if none."""
    keys = [(ms, t, -i) for i, (ms, t) in enumerate(zip(colo, ladder.trainer_sms)) if t > 0 and fits(ms, budget)]
    return -max(keys)[2] if keys else None


def brute_safest(ladder: Ladder, colo, budget):
    keys = [(ms, -t, i) for i, (ms, t) in enumerate(zip(colo, ladder.trainer_sms)) if t > 0 and fits(ms, budget)]
    return min(keys)[2] if keys else None


def random_ladder(rng: random.Random) -> Ladder:
    """A one-level shared ladder, or 1-9 partitions in any order (decode SMs not sorted,
    trainer-less ones included, at least one with trainer SMs) plus the whole device."""
    total = rng.randint(1, 132)
    if rng.random() < 0.15:
        return Ladder.whole_device(total)
    n = rng.randint(1, 9)
    decode = [rng.randint(1, total) for _ in range(n)]
    trainer = [rng.choice([0, rng.randint(1, total)]) for _ in range(n)]
    trainer[rng.randrange(n)] = rng.randint(1, total)
    levels = tuple(Level(d, t) for d, t in zip(decode, trainer)) + (Level(total, 0),)
    return Ladder(total, levels, GREEN_CONTEXTS)


def random_config(rng: random.Random) -> SchedulerConfig:
    initial = rng.choice([0.0, rng.uniform(0.0, 0.3)])
    backoff = rng.choice([None, rng.randint(1, 8)])
    return SchedulerConfig(
        target_tpot_ms=rng.uniform(5.0, 100.0),
        initial_margin=initial,
        max_margin=rng.uniform(initial, 0.9),
        margin_growth=rng.choice([0.0, rng.uniform(0.0, 0.2)]),
        margin_decay=rng.choice([0.0, rng.uniform(0.0, 0.05)]),
        hysteresis_steps=rng.randint(1, 5),
        hysteresis_gain=rng.choice([None, rng.uniform(0.01, 1.0)]),
        floor_after_paused_steps=rng.choice([None, rng.randint(1, 6)]),
        floor_margin=rng.uniform(0.0, initial),
        backoff_steps=backoff,
        max_backoff_steps=rng.randint(backoff or 1, 40),
        ring_size=rng.randint(1, 50),
    )


def random_prediction(rng: random.Random, target: float, pool: list[float]) -> float:
    roll = rng.random()
    if roll < 0.06:
        return rng.choice([math.nan, math.inf, -math.inf, 0.0, -rng.uniform(0.0, target)])
    if roll < 0.25:
        return rng.choice(pool)  # repeated values make ties
    return rng.uniform(0.5, 1.3) * target


def random_input(rng: random.Random, ladder: Ladder, cfg: SchedulerConfig, pool) -> SchedulerInput:
    colo = tuple(random_prediction(rng, cfg.target_tpot_ms, pool) for _ in range(ladder.num_levels))
    trainer = TrainerState.RUNNING if rng.random() < 0.8 else rng.choice(list(IDLE_REASON))
    return SchedulerInput(colo, trainer, rng.choice([math.nan, rng.uniform(0.3, 1.0) * cfg.target_tpot_ms]))


def check_step(ctl: QoSController, before, inp: SchedulerInput, d) -> None:
    cfg, ladder, colo = ctl.config, ctl.ladder, inp.predicted_colo_ms
    budget = cfg.target_tpot_ms * (1.0 - before.margin)
    # The floor's target: without the initial headroom, with what the margin learned.
    floor_budget = cfg.target_tpot_ms * (1.0 - cfg.floor_margin - (before.margin - cfg.initial_margin))
    best = brute_closest(ladder, colo, budget)
    after = ctl.state

    assert d.step == before.step and after.step == before.step + 1
    # A pause puts decode on the whole-device level; on a spatial ladder only a pause does
    # (the trainer has no SMs there), on a shared one the trainer also runs on it.
    if d.trainer_action is TrainerAction.PAUSE:
        assert d.level_index == ladder.whole_device_index
    elif ladder.spatial:
        assert d.level_index != ladder.whole_device_index
    assert d.margin == before.margin and cfg.initial_margin <= d.margin <= cfg.max_margin

    if inp.trainer_state is not TrainerState.RUNNING:
        assert d.reason is IDLE_REASON[inp.trainer_state] and d.trainer_action is TrainerAction.PAUSE
        assert after[1:] == before[1:]
        return
    # Deciding never moves the margin or the backoff: only measurements do.
    assert (after.margin, after.backoff_until, after.backoff_length) == before[4:]
    if before.step < before.backoff_until:
        assert d.reason is R.QOS_BACKOFF and d.trainer_action is TrainerAction.PAUSE and d.budget_ms == budget
        assert (after.reference_level, after.hold_streak, after.paused_steps) == (None, 0, 0)
        return
    assert d.reason is not R.QOS_BACKOFF

    if d.trainer_action is TrainerAction.RUN:
        # Never run the trainer on a level predicted over the target it was checked against,
        # and never over the floor's relaxed target (the loosest bound there is).
        assert ladder.trainer_sms[d.level_index] > 0
        assert d.predicted_ms == colo[d.level_index]
        assert fits(d.predicted_ms, d.budget_ms) and d.budget_ms <= floor_budget
        if d.reason is not R.FLOOR:
            assert d.budget_ms == budget
    else:
        whole = inp.predicted_whole_device_ms
        assert d.predicted_ms == whole or (math.isnan(d.predicted_ms) and math.isnan(whole))

    ref = before.reference_level
    ref_fits = ref is not None and fits(colo[ref], budget)
    if d.reason is R.FITS:
        assert d.level_index == best
        if ref is not None and ref_fits and best != ref:  # an optional move: hysteresis satisfied
            gain = cfg.hysteresis_gain
            assert before.hold_streak + 1 >= cfg.hysteresis_steps or (
                gain is not None and colo[best] - colo[ref] >= gain * cfg.target_tpot_ms
            )
        if ref is None:
            assert before.hold_streak + 1 >= cfg.hysteresis_steps
    elif d.reason is R.HYSTERESIS_HOLD:
        assert best is not None and best != ref and before.hold_streak + 1 < cfg.hysteresis_steps
        if d.trainer_action is TrainerAction.RUN:
            assert d.level_index == ref and ref_fits  # QoS first: a held level always fits
        else:
            assert ref is None and d.level_index == ladder.whole_device_index
        assert after.hold_streak == before.hold_streak + 1
    elif d.reason is R.NONE_FITS:
        assert best is None
        k = cfg.floor_after_paused_steps
        assert k is None or before.paused_steps < k or brute_safest(ladder, colo, floor_budget) is None
        assert after.reference_level is None and after.paused_steps == before.paused_steps + 1
    elif d.reason is R.FLOOR:
        k = cfg.floor_after_paused_steps
        assert k is not None and before.paused_steps >= k
        assert best is None or ref is None  # the floor only replaces a pause
        assert d.level_index == brute_safest(ladder, colo, floor_budget)
        assert d.budget_ms == floor_budget and after.paused_steps == 0
    else:
        pytest.fail(f"unexpected reason {d.reason} for a running trainer")


def check_measurement(ctl: QoSController, before, d, measured: float) -> None:
    """The margin and the backoff after a measurement, stated independently."""
    cfg, after = ctl.config, ctl.state
    assert after[:4] == before[:4]
    colocated, violated = d.trainer_action is TrainerAction.RUN, measured > cfg.target_tpot_ms
    assert cfg.initial_margin <= after.margin <= cfg.max_margin
    if not colocated:
        assert after.margin == before.margin
    elif violated:
        assert after.margin == min(cfg.max_margin, before.margin + cfg.margin_growth)
    else:
        assert after.margin == max(cfg.initial_margin, before.margin - cfg.margin_decay)
    unchanged = (before.backoff_until, before.backoff_length)
    if cfg.backoff_steps is None or not colocated:
        assert after[5:] == unchanged
    elif violated and before.margin >= cfg.max_margin - cfg.margin_growth / 2:  # the margin could not absorb it
        length = cfg.backoff_steps if before.backoff_length == 0 else min(cfg.max_backoff_steps, 2 * before.backoff_length)
        assert after[5:] == (before.step + length, length)
    elif not violated and after.margin <= cfg.max_margin - cfg.margin_growth:
        assert after[5:] == (before.backoff_until, 0)
    else:
        assert after[5:] == unchanged
    assert 0 <= after.backoff_length <= cfg.max_backoff_steps


def run_random_sequences(seed: int) -> collections.Counter:
    """Random ladders, configs and steps, every invariant checked; the reasons decided."""
    rng = random.Random(seed)
    reasons: collections.Counter = collections.Counter()
    for _ in range(10):
        ladder, cfg = random_ladder(rng), random_config(rng)
        ctl = QoSController(cfg, ladder)
        pool = [rng.uniform(0.5, 1.2) * cfg.target_tpot_ms for _ in range(3)]
        for _ in range(rng.randint(1, 120)):
            inp = random_input(rng, ladder, cfg, pool)
            before = ctl.state
            preview = ctl.choose(inp)
            assert ctl.state == before
            d = ctl.decide(inp)
            assert d == preview
            check_step(ctl, before, inp, d)
            reasons[d.reason] += 1
            assert ctl.recent_decisions()[-1] == d and len(ctl.recent_decisions()) <= cfg.ring_size
            if rng.random() < 0.8:
                measured = rng.uniform(0.3, 1.6) * cfg.target_tpot_ms
                before_measurement = ctl.state
                violated = ctl.observe_measurement(measured)
                assert violated == (measured > cfg.target_tpot_ms)
                check_measurement(ctl, before_measurement, d, measured)
        stats = ctl.stats()
        assert sum(stats.decisions_by_reason.values()) == sum(stats.decisions_by_level.values()) == stats.num_decisions
    return reasons


@pytest.mark.parametrize("seed", range(40))
def test_random_sequences_keep_every_invariant(seed):
    run_random_sequences(seed)


def test_random_sequences_reach_every_reason():
    """The invariants above are checked on every path: the sequences decide every reason."""
    reasons = sum((run_random_sequences(seed) for seed in range(40)), collections.Counter())
    assert set(reasons) == set(R), set(R) - set(reasons)
