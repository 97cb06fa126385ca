"""Harli's rule, one decision at a time (``choose`` is pure; ``advance`` is checked where
a branch's effect on the next step matters)."""

from __future__ import annotations

import math

import pytest

from harvest.ladder import Ladder
from harvest.schedule import (
    DecisionReason,
    SchedulerInput,
    TrainerAction,
    TrainerState,
    advance,
    choose,
    closest_under,
    safest_under,
)
from tests.schedule.helpers import LADDER, NAN, RUNNING, WHOLE, config, ladder, snap, state

CFG = config(hysteresis_steps=1)  # no hysteresis: the bare rule


def test_picks_the_level_closest_under_target_times_one_minus_margin():
    # budget = 40 × 0.95 = 38: level 2 (37.9) is closest under it; level 3 (38.1) is over.
    d = choose(CFG, LADDER, state(), snap(20.0, 30.0, 37.9, 38.1))
    assert (d.level_index, d.trainer_action, d.reason) == (2, TrainerAction.RUN, DecisionReason.FITS)
    assert d.predicted_ms == 37.9
    assert d.budget_ms == pytest.approx(38.0) and d.margin == 0.05


def test_closest_under_does_not_assume_latency_ordered_levels():
    d = choose(CFG, LADDER, state(), snap(37.0, 12.0, 39.0, 25.0))
    assert d.level_index == 0 and d.predicted_ms == 37.0


def test_prediction_exactly_on_budget_fits():
    d = choose(CFG, LADDER, state(margin=0.0), snap(20.0, 40.0, 40.0000001, 50.0))
    assert d.level_index == 1 and d.budget_ms == 40.0


def test_margin_in_force_shrinks_the_budget():
    inp = snap(20.0, 30.0, 35.0, 37.0)
    assert choose(CFG, LADDER, state(margin=0.05), inp).level_index == 3  # budget 38
    tight = choose(CFG, LADDER, state(margin=0.1), inp)  # budget 36
    assert tight.level_index == 2 and tight.margin == 0.1 and tight.budget_ms == pytest.approx(36.0)


def test_none_fits_pauses_the_trainer_and_gives_decode_the_whole_gpu():
    d = choose(CFG, LADDER, state(2), snap(38.5, 41.0, 45.0, 60.0, whole_device_ms=30.0))
    assert (d.level_index, d.trainer_action, d.reason) == (WHOLE, TrainerAction.PAUSE, DecisionReason.NONE_FITS)
    assert d.predicted_ms == 30.0
    after = advance(state(2, hold=1), d)
    assert (after.reference_level, after.hold_streak, after.paused_steps, after.step) == (None, 0, 1, 1)


@pytest.mark.parametrize("bad", [NAN, math.inf, -math.inf, 0.0, -5.0])
def test_untrustworthy_predictions_never_fit(bad):
    d = choose(CFG, LADDER, state(), snap(bad, 30.0, bad, bad))
    assert d.level_index == 1
    assert choose(CFG, LADDER, state(), snap(bad, bad, bad, bad)).reason is DecisionReason.NONE_FITS


def test_all_nan_pauses_with_nan_whole_gpu_prediction():
    d = choose(CFG, LADDER, state(1), snap(NAN, NAN, NAN, NAN, whole_device_ms=NAN))
    assert d.reason is DecisionReason.NONE_FITS and d.level_index == WHOLE and math.isnan(d.predicted_ms)


def test_ties_go_to_more_trainer_sms_then_lower_index():
    assert choose(CFG, LADDER, state(), snap(30.0, 35.0, 35.0, 20.0)).level_index == 2
    same_sms = ladder((100, 32), (100, 32), (64, 32))
    assert choose(CFG, same_sms, state(), snap(35.0, 35.0, 35.0)).level_index == 0
    assert safest_under(LADDER, (30.0, 20.0, 20.0, 35.0, 10.0), 40.0) == 2
    assert safest_under(same_sms, (20.0, 20.0, 20.0, 10.0), 40.0) == 0


def test_levels_without_trainer_sms_are_never_chosen():
    # The whole-device level (132/0) predicts 37.9, closest under 38, but cannot run the trainer.
    spatial = ladder((100, 32), (64, 68))
    d = choose(CFG, spatial, state(), snap(20.0, 30.0, whole_device_ms=37.9))
    assert d.level_index == 1
    assert choose(CFG, spatial, state(), snap(45.0, 50.0, whole_device_ms=37.9)).reason is DecisionReason.NONE_FITS
    assert closest_under(spatial, (45.0, 50.0, 37.9), 38.0) is None


def test_single_shared_whole_device_level():
    shared = Ladder.whole_device(1)
    over = choose(CFG, shared, state(), SchedulerInput((39.0,), RUNNING, 30.0))
    assert over.reason is DecisionReason.NONE_FITS and over.predicted_ms == 30.0  # 39 > 38
    assert (over.level_index, over.trainer_action) == (0, TrainerAction.PAUSE)  # the whole device is level 0
    runs = choose(CFG, shared, state(), SchedulerInput((31.0,), RUNNING, 30.0))
    assert (runs.level_index, runs.trainer_action, runs.reason) == (0, TrainerAction.RUN, DecisionReason.FITS)


@pytest.mark.parametrize(
    "trainer,reason",
    [
        (TrainerState.STARVED, DecisionReason.TRAINER_STARVED),
        (TrainerState.PAUSED, DecisionReason.TRAINER_PAUSED),
        (TrainerState.STOPPED, DecisionReason.TRAINER_STOPPED),
        (TrainerState.FINISHED, DecisionReason.TRAINER_STOPPED),
        (TrainerState.FAILED, DecisionReason.TRAINER_STOPPED),
        (TrainerState.BUILDING, DecisionReason.NO_TRAINER),
        (TrainerState.ABSENT, DecisionReason.NO_TRAINER),
    ],
)
def test_a_trainer_that_cannot_run_gives_decode_the_whole_gpu(trainer, reason):
    assert {state for state in TrainerState if state is not TrainerState.RUNNING} == {
        TrainerState.STARVED, TrainerState.PAUSED, TrainerState.STOPPED, TrainerState.FINISHED, TrainerState.FAILED,
        TrainerState.BUILDING, TrainerState.ABSENT}  # every other state is in this table
    before = state(2, hold=1, paused=4, step=9)
    d = choose(CFG, LADDER, before, snap(20.0, 30.0, 35.0, 37.0, trainer=trainer, whole_device_ms=12.5))
    assert (d.level_index, d.trainer_action, d.reason) == (WHOLE, TrainerAction.PAUSE, reason)
    assert d.predicted_ms == 12.5 and d.step == 9
    # Neither progress nor a QoS pause: only the step count moves.
    assert advance(before, d) == state(2, hold=1, paused=4, step=10)


def test_choose_is_pure_and_deterministic():
    before = state(1, hold=1)
    inp = snap(20.0, 30.0, 35.0, 37.0)
    cfg = config()
    assert choose(cfg, LADDER, before, inp) == choose(cfg, LADDER, before, inp)
    assert before == state(1, hold=1)


def test_prediction_count_must_match_the_ladder():
    with pytest.raises(ValueError, match="4 entries for a ladder of 5 levels"):
        choose(CFG, LADDER, state(), snap(20.0, 30.0, 35.0))


@pytest.mark.parametrize("bad_state", ["running", "starved", None, 1])
def test_trainer_state_must_be_the_enum(bad_state):
    with pytest.raises(ValueError, match="trainer_state=.*must be a TrainerState"):
        choose(CFG, LADDER, state(), snap(20.0, 30.0, 35.0, 37.0, trainer=bad_state))


def test_predictions_must_be_numbers():
    with pytest.raises(ValueError, match="every entry must be a number"):
        choose(CFG, LADDER, state(), snap(20.0, None, 35.0, 37.0))


def test_advance_after_fits_resets_counters_and_sets_the_reference():
    d = choose(CFG, LADDER, state(None, hold=2, paused=3, step=4), snap(20.0, 30.0, 35.0, 39.0))
    assert advance(state(None, hold=2, paused=3, step=4), d) == state(2, step=5)
