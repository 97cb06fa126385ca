"""Hysteresis over sequences of steps: QoS-required moves are immediate, optional ones
wait ``hysteresis_steps`` consecutive steps (or a large enough gain)."""

from __future__ import annotations

from harvest.schedule import DecisionReason, TrainerAction, TrainerState
from tests.schedule.helpers import WHOLE, controller, settle, snap

FITS, HOLD, NONE_FITS = DecisionReason.FITS, DecisionReason.HYSTERESIS_HOLD, DecisionReason.NONE_FITS
AT_1 = snap(20.0, 30.0, 39.0, 45.0)  # best: level 1 (budget 38)
AT_2 = snap(20.0, 30.0, 35.0, 45.0)  # best: level 2, level 1 still fits
AT_3 = snap(20.0, 30.0, 35.0, 37.0)  # best: level 3


def reasons_and_levels(ctl, inputs):
    return [(d.reason, d.level_index) for d in (ctl.decide(inp) for inp in inputs)]


def test_trainer_starts_after_the_hysteresis_wait():
    ctl = controller(hysteresis_steps=3)
    assert reasons_and_levels(ctl, [AT_1] * 4) == [(HOLD, WHOLE), (HOLD, WHOLE), (FITS, 1), (FITS, 1)]
    held = ctl.recent_decisions()[0]
    assert held.trainer_action is TrainerAction.PAUSE and held.predicted_ms == 10.0


def test_one_step_hysteresis_is_no_hysteresis():
    ctl = controller(hysteresis_steps=1, hysteresis_gain=None)
    assert reasons_and_levels(ctl, [AT_1, AT_2, AT_1, AT_3]) == [(FITS, 1), (FITS, 2), (FITS, 1), (FITS, 3)]


def test_optional_upgrade_waits_n_consecutive_steps_holding_the_current_level():
    ctl = controller(hysteresis_steps=3, hysteresis_gain=None)
    settle(ctl, AT_1)
    got = [ctl.decide(AT_2) for _ in range(4)]
    assert [(d.reason, d.level_index) for d in got] == [(HOLD, 1), (HOLD, 1), (FITS, 2), (FITS, 2)]
    assert got[0].trainer_action is TrainerAction.RUN and got[0].predicted_ms == 30.0  # the held level's prediction
    assert ctl.state.hold_streak == 0


def test_streak_breaks_when_the_current_level_is_best_again():
    ctl = controller(hysteresis_steps=3, hysteresis_gain=None)
    settle(ctl, AT_1)
    seq = [AT_2, AT_2, AT_1, AT_2, AT_2, AT_2]
    assert reasons_and_levels(ctl, seq) == [(HOLD, 1), (HOLD, 1), (FITS, 1), (HOLD, 1), (HOLD, 1), (FITS, 2)]


def test_streak_counts_steps_with_any_better_level_and_moves_to_the_current_best():
    ctl = controller(hysteresis_steps=3, hysteresis_gain=None)
    settle(ctl, AT_1)
    assert reasons_and_levels(ctl, [AT_2, AT_3, AT_2]) == [(HOLD, 1), (HOLD, 1), (FITS, 2)]


def test_a_move_qos_requires_is_immediate():
    ctl = controller(hysteresis_steps=5)
    settle(ctl, AT_3, 5)
    assert ctl.state.reference_level == 3
    # Level 3 now predicts over budget: move down at once, even mid-streak.
    got = ctl.decide(snap(20.0, 30.0, 37.5, 38.5))
    assert (got.reason, got.level_index) == (FITS, 2)
    got = ctl.decide(snap(20.0, 30.0, 38.5, 41.0))
    assert (got.reason, got.level_index) == (FITS, 1)


def test_a_qos_pause_is_immediate_and_resuming_waits_again():
    ctl = controller(hysteresis_steps=3)
    settle(ctl, AT_1)
    over = snap(39.0, 40.0, 45.0, 50.0)
    assert reasons_and_levels(ctl, [over, AT_1, AT_1, AT_1]) == [
        (NONE_FITS, WHOLE), (HOLD, WHOLE), (HOLD, WHOLE), (FITS, 1)
    ]


def test_resume_wait_restarts_after_another_pause():
    ctl = controller(hysteresis_steps=3)
    over = snap(39.0, 40.0, 45.0, 50.0)
    seq = [AT_1, AT_1, over, AT_1, AT_1, AT_1]
    assert [r for r, _ in reasons_and_levels(ctl, seq)] == [HOLD, HOLD, NONE_FITS, HOLD, HOLD, FITS]


def test_large_gain_skips_the_wait():
    # gain 0.25 × 40 ms = 10 ms: 20 → 35 gains 15 ms, 30 → 35 gains only 5.
    ctl = controller(hysteresis_steps=10, hysteresis_gain=0.25)
    settle(ctl, snap(20.0, 39.0, 45.0, 50.0), 10)
    assert ctl.state.reference_level == 0
    assert reasons_and_levels(ctl, [snap(20.0, 30.0, 35.0, 45.0)]) == [(FITS, 2)]
    ctl = controller(hysteresis_steps=10, hysteresis_gain=0.25)
    settle(ctl, AT_1, 10)
    assert reasons_and_levels(ctl, [AT_2]) == [(HOLD, 1)]
    # Exactly the threshold counts as enough.
    ctl = controller(hysteresis_steps=10, hysteresis_gain=0.125)
    settle(ctl, AT_1, 10)
    assert reasons_and_levels(ctl, [AT_2]) == [(FITS, 2)]


def test_gain_does_not_shortcut_resuming_from_a_pause():
    ctl = controller(hysteresis_steps=3, hysteresis_gain=0.01)
    assert reasons_and_levels(ctl, [AT_3])[0] == (HOLD, WHOLE)


def test_starvation_keeps_the_level_and_the_streak():
    ctl = controller(hysteresis_steps=3, hysteresis_gain=None)
    settle(ctl, AT_1)
    starved = snap(20.0, 30.0, 35.0, 45.0, trainer=TrainerState.STARVED)
    seq = [AT_2, starved, starved, AT_2]
    got = reasons_and_levels(ctl, seq)
    # Two holds in a row, the starved steps in between neither count nor reset them.
    assert got == [(HOLD, 1), (DecisionReason.TRAINER_STARVED, WHOLE),
                   (DecisionReason.TRAINER_STARVED, WHOLE), (HOLD, 1)]
    assert reasons_and_levels(ctl, [AT_2]) == [(FITS, 2)]


def test_trainer_returns_to_its_level_at_once_after_starvation_or_operator_pause():
    for idle in (TrainerState.STARVED, TrainerState.PAUSED, TrainerState.STOPPED, TrainerState.ABSENT):
        ctl = controller(hysteresis_steps=3)
        settle(ctl, AT_1)
        away = snap(20.0, 30.0, 39.0, 45.0, trainer=idle)
        got = reasons_and_levels(ctl, [away] * 5 + [AT_1])
        assert got[-1] == (FITS, 1), idle


def test_hysteresis_bounds_flapping():
    # Predictions alternate so the best level alternates between 1 and 2 while both fit.
    a = snap(20.0, 37.0, 33.0, 45.0)
    b = snap(20.0, 33.0, 37.0, 45.0)
    steps = [a, b] * 60

    def changes(ctl):
        levels = [d.level_index for d in (ctl.decide(inp) for inp in steps)]
        return sum(x != y for x, y in zip(levels, levels[1:]))

    assert changes(controller(hysteresis_steps=1, hysteresis_gain=None)) == len(steps) - 1
    # With hysteresis the only change is the start-up resume: each alternative is best for
    # one step at a time, never for the consecutive steps a move needs.
    for n in (2, 4):
        assert changes(controller(hysteresis_steps=n, hysteresis_gain=None)) == 1


def test_hold_reports_running_trainer_and_the_held_level_prediction():
    ctl = controller(hysteresis_steps=2, hysteresis_gain=None)
    settle(ctl, AT_1)
    d = ctl.decide(AT_3)
    assert (d.reason, d.level_index, d.trainer_action, d.predicted_ms) == (HOLD, 1, TrainerAction.RUN, 30.0)
    assert ctl.state.paused_steps == 0
