"""The backoff: co-located violations the feedback margin can no longer absorb pause a
runnable trainer for a while, twice as long each time, until steps on target have
decayed the margin again."""

from __future__ import annotations

import logging

import pytest

from harvest.schedule import DecisionReason, SchedulerConfig, TrainerAction, TrainerState, backoff_after
from tests.schedule.helpers import WHOLE, controller, snap

BACKOFF, FITS, FLOOR = DecisionReason.QOS_BACKOFF, DecisionReason.FITS, DecisionReason.FLOOR
CFG = SchedulerConfig(initial_margin=0.05, max_margin=0.2, margin_growth=0.05, margin_decay=0.01,
                      backoff_steps=4, max_backoff_steps=16)
FIT = snap(10.0, 15.0, 20.0, 25.0)  # level 3 fits even at the maximum margin (budget 32 ms)


def test_backoff_after_starts_doubles_caps_and_resets():
    # Margin below its maximum: a violation grows the margin instead.
    assert backoff_after(CFG, 0.10, 41.0, True, 0) == (0, False)
    assert backoff_after(CFG, 0.10, 41.0, True, 8) == (8, False)
    # At (or within half a growth step of) the maximum: start, then double, capped.
    assert backoff_after(CFG, 0.2, 41.0, True, 0) == (4, True)
    assert backoff_after(CFG, 0.19, 41.0, True, 4) == (8, True)
    assert backoff_after(CFG, 0.2, 41.0, True, 8) == (16, True)
    assert backoff_after(CFG, 0.2, 41.0, True, 16) == (16, True)
    # Paused steps say nothing about co-location; a disabled backoff never starts.
    assert backoff_after(CFG, 0.2, 99.0, False, 8) == (8, False)
    disabled = SchedulerConfig(max_margin=0.2, backoff_steps=None)
    assert backoff_after(disabled, 0.2, 99.0, True, 0) == (0, False)
    # On target: the length stays until the margin is a full growth step under its maximum.
    assert backoff_after(CFG, 0.2, 30.0, True, 8) == (8, False)  # margin 0.19 after it
    assert backoff_after(CFG, 0.16, 30.0, True, 8) == (0, False)  # margin 0.15 after it
    assert backoff_after(CFG, 0.16, 30.0, True, 0) == (0, False)


def test_fixed_margin_at_its_maximum_backs_off_on_every_colocated_violation():
    fixed = SchedulerConfig(initial_margin=0.1, max_margin=0.1, margin_growth=0.0, margin_decay=0.0, backoff_steps=2)
    assert backoff_after(fixed, 0.1, 41.0, True, 0) == (2, True)
    assert backoff_after(fixed, 0.1, 30.0, True, 2) == (0, False)


def walk(ctl, inp, measured):
    """Decide and measure each of ``measured`` (None: no measurement); the decisions."""
    got = []
    for ms in measured:
        got.append(ctl.decide(inp))
        if ms is not None:
            ctl.observe_measurement(ms)
    return got


def test_controller_backs_off_after_a_violation_at_the_maximum_margin(caplog):
    ctl = controller(initial_margin=0.05, max_margin=0.2, margin_growth=0.05, margin_decay=0.01, hysteresis_steps=1,
                     backoff_steps=4, max_backoff_steps=16)
    with caplog.at_level(logging.WARNING, logger="harvest.schedule.qos_controller"):
        got = walk(ctl, FIT, [41.0] * 3)  # margin 0.10, 0.15, 0.20: absorbed
        assert [d.reason for d in got] == [FITS] * 3 and ctl.state.backoff_until == 0
        got = walk(ctl, FIT, [41.0])  # at the maximum: backoff for the next 4 decisions
    assert got[0].reason is FITS and ctl.state.backoff_length == 4 and ctl.state.backoff_until == 4 + 4  # decisions 4..7
    assert "QoS backoff" in caplog.text and "pauses for 4 decisions" in caplog.text
    paused = walk(ctl, FIT, [20.0] * 4)
    assert all(d.reason is BACKOFF and d.level_index == WHOLE and d.trainer_action is TrainerAction.PAUSE
               for d in paused)
    assert paused[0].predicted_ms == 10.0 and paused[0].budget_ms == pytest.approx(32.0)
    assert ctl.margin == pytest.approx(0.2)  # paused steps do not move the margin
    # Then the trainer resumes; the next violation doubles the backoff.
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="harvest.schedule.qos_controller"):
        got = walk(ctl, FIT, [41.0])
    assert got[0].reason is FITS and ctl.state.backoff_length == 8
    assert [r.levelname for r in caplog.records] == ["INFO"] and "pauses for 8 decisions" in caplog.text
    assert [d.reason for d in walk(ctl, FIT, [None] * 9)] == [BACKOFF] * 8 + [FITS]
    assert ctl.stats().num_backoffs == 2 and ctl.stats().to_dict()["num_backoffs"] == 2
    # At its maximum length, a backoff repeats without a log line at INFO or above.
    capped = controller(initial_margin=0.05, max_margin=0.2, margin_growth=0.05, margin_decay=0.01,
                        hysteresis_steps=1, backoff_steps=4, max_backoff_steps=4)
    walk(capped, FIT, [41.0] * 4 + [None] * 4)
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="harvest.schedule.qos_controller"):
        walk(capped, FIT, [41.0])
    assert capped.stats().num_backoffs == 2 and not caplog.records
    assert ctl.stats().decisions_by_reason[BACKOFF] == 12


def test_backoff_length_resets_once_steps_on_target_decay_the_margin():
    ctl = controller(initial_margin=0.05, max_margin=0.2, margin_growth=0.05, margin_decay=0.01, hysteresis_steps=1,
                     backoff_steps=4, max_backoff_steps=16)
    walk(ctl, FIT, [41.0] * 4 + [None] * 4)
    assert ctl.state.backoff_length == 4
    walk(ctl, FIT, [30.0] * 4)  # margin 0.16: still within a growth step of the maximum
    assert ctl.state.backoff_length == 4
    walk(ctl, FIT, [30.0])  # margin 0.15
    assert ctl.state.backoff_length == 0
    walk(ctl, FIT, [41.0, 41.0])  # margin 0.20 then a violation at it: a fresh, short backoff
    assert ctl.state.backoff_length == 4


def test_backoff_suppresses_the_floor_and_restarts_its_count():
    ctl = controller(initial_margin=0.05, max_margin=0.2, margin_growth=0.05, margin_decay=0.01, hysteresis_steps=1,
                     backoff_steps=4, floor_after_paused_steps=2)
    walk(ctl, FIT, [41.0] * 4)
    slack = snap(35.0, 39.5, 41.0, 45.0)  # nothing fits the 32 ms budget nor the floor's 34 ms target
    slack_floor = snap(33.0, 39.5, 41.0, 45.0)  # level 0 under the floor's target only
    got = walk(ctl, slack_floor, [None] * 4) + walk(ctl, slack, [None] * 2) + walk(ctl, slack_floor, [None])
    assert [d.reason for d in got] == [BACKOFF] * 4 + [DecisionReason.NONE_FITS] * 2 + [FLOOR]


def test_backoff_leaves_decisions_for_a_trainer_that_cannot_run_alone():
    ctl = controller(initial_margin=0.05, max_margin=0.2, margin_growth=0.05, margin_decay=0.01, hysteresis_steps=1,
                     backoff_steps=4)
    walk(ctl, FIT, [41.0] * 4)
    starved = snap(10.0, 15.0, 20.0, 25.0, trainer=TrainerState.STARVED)
    got = walk(ctl, starved, [None, None]) + walk(ctl, FIT, [None] * 3)
    # The backoff counts decisions: two starved ones, then two backoff ones, then the trainer runs.
    assert [d.reason for d in got] == [DecisionReason.TRAINER_STARVED] * 2 + [BACKOFF] * 2 + [FITS]


def test_disabled_backoff_keeps_colocating_at_the_maximum_margin():
    ctl = controller(initial_margin=0.05, max_margin=0.2, margin_growth=0.05, margin_decay=0.01, hysteresis_steps=1)
    got = walk(ctl, FIT, [41.0] * 20)
    assert all(d.reason is FITS for d in got) and ctl.stats().num_backoffs == 0
