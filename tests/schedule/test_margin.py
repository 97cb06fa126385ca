"""The feedback margin: growth after co-located violations, decay after successes,
bounds, and its effect on the next decisions."""

from __future__ import annotations

import logging
import math

import pytest

from harvest.schedule import DecisionReason, SchedulerConfig, TrainerState, is_violation, margin_after
from tests.schedule.helpers import controller, ladder, snap

CFG = SchedulerConfig(initial_margin=0.05, max_margin=0.2, margin_growth=0.05, margin_decay=0.01)


def test_is_violation_is_strictly_over_target():
    assert is_violation(CFG, 40.001) and not is_violation(CFG, 40.0) and not is_violation(CFG, 12.0)


def test_margin_after_grows_decays_and_stays_bounded():
    assert margin_after(CFG, 0.05, 41.0, colocated=True) == pytest.approx(0.10)
    assert margin_after(CFG, 0.18, 41.0, colocated=True) == 0.2  # capped
    assert margin_after(CFG, 0.2, 80.0, colocated=True) == 0.2
    assert margin_after(CFG, 0.10, 40.0, colocated=True) == pytest.approx(0.09)  # on target is a success
    assert margin_after(CFG, 0.055, 20.0, colocated=True) == 0.05  # floored at initial_margin
    assert margin_after(CFG, 0.05, 20.0, colocated=True) == 0.05
    # A step with the trainer paused says nothing about co-location error.
    assert margin_after(CFG, 0.10, 80.0, colocated=False) == 0.10
    assert margin_after(CFG, 0.10, 20.0, colocated=False) == 0.10


def test_zero_growth_and_decay_freeze_the_margin():
    frozen = SchedulerConfig(margin_growth=0.0, margin_decay=0.0)
    assert margin_after(frozen, 0.05, 99.0, True) == 0.05 and margin_after(frozen, 0.05, 1.0, True) == 0.05


def test_controller_margin_walk_up_to_max_and_back_to_initial():
    ctl = controller(initial_margin=0.05, max_margin=0.2, margin_growth=0.05, margin_decay=0.01, hysteresis_steps=1)
    inp = snap(10.0, 15.0, 20.0, 25.0)
    margins = []
    for measured in [41.0] * 5 + [30.0] * 20:
        ctl.decide(inp)
        ctl.observe_measurement(measured)
        margins.append(ctl.margin)
    assert margins[:5] == pytest.approx([0.10, 0.15, 0.20, 0.20, 0.20])
    assert margins[5] == pytest.approx(0.19)
    assert margins[-1] == 0.05 and min(margins) == 0.05 and max(margins) == 0.2
    stats = ctl.stats()
    assert (stats.num_measurements, stats.num_violations, stats.num_colocated_violations) == (25, 5, 5)
    assert stats.violation_rate == pytest.approx(0.2)


def test_violation_while_paused_is_counted_but_does_not_move_the_margin():
    ctl = controller()
    d = ctl.decide(snap(39.0, 45.0, 50.0, 60.0))  # none fits
    assert d.reason is DecisionReason.NONE_FITS
    assert ctl.observe_measurement(55.0) is True
    assert ctl.margin == 0.05
    assert ctl.stats().num_violations == 1 and ctl.stats().num_colocated_violations == 0
    ctl.decide(snap(20.0, 30.0, 35.0, 37.0, trainer=TrainerState.STARVED))
    assert ctl.observe_measurement(10.0) is False and ctl.margin == 0.05


def test_grown_margin_changes_the_next_choice():
    ctl = controller(hysteresis_steps=1)
    inp = snap(20.0, 30.0, 35.0, 37.0)
    assert ctl.decide(inp).level_index == 3  # 37 ≤ 38
    ctl.observe_measurement(42.0)  # margin 0.10: budget 36
    d = ctl.decide(inp)
    assert d.level_index == 2 and d.margin == pytest.approx(0.10) and d.budget_ms == pytest.approx(36.0)


@pytest.mark.parametrize("bad", [math.nan, math.inf, -1.0, 0.0, "30", None, True])
def test_bad_measurement_is_refused_with_state_unchanged(bad):
    ctl = controller()
    ctl.decide(snap(20.0, 30.0, 35.0, 37.0))
    before = (ctl.state, ctl.stats())
    with pytest.raises(ValueError, match="measured_ms=.* must be a finite number of ms > 0"):
        ctl.observe_measurement(bad)
    assert (ctl.state, ctl.stats()) == before
    ctl.observe_measurement(30.0)  # the decision still awaits its measurement


def test_measurement_needs_a_decision_and_is_taken_once():
    ctl = controller()
    with pytest.raises(RuntimeError, match="no decision awaits a measurement"):
        ctl.observe_measurement(30.0)
    ctl.decide(snap(20.0, 30.0, 35.0, 37.0))
    ctl.observe_measurement(30.0)
    with pytest.raises(RuntimeError, match="at most once"):
        ctl.observe_measurement(30.0)
    assert ctl.stats().num_measurements == 1


def test_an_unmeasured_decision_is_superseded_by_the_next():
    ctl = controller(hysteresis_steps=1)
    ctl.decide(snap(39.0, 45.0, 50.0, 60.0))  # paused
    ctl.decide(snap(20.0, 30.0, 35.0, 37.0))  # runs at level 3
    ctl.observe_measurement(45.0)  # belongs to the co-located step: the margin grows
    assert ctl.margin == pytest.approx(0.10)


def test_max_margin_warning_once_per_excursion():
    records = []
    handler = logging.Handler()
    handler.emit = records.append  # type: ignore[method-assign]
    logger = logging.getLogger("harvest.schedule.qos_controller")
    logger.addHandler(handler)
    try:
        ctl = controller(
            initial_margin=0.05, max_margin=0.15, margin_growth=0.05, margin_decay=0.05, hysteresis_steps=1
        )
        inp = snap(10.0, 15.0, 20.0, 25.0)
        for measured in [41.0] * 6 + [30.0, 41.0, 41.0] + [30.0] * 3 + [41.0, 41.0]:
            ctl.decide(inp)
            ctl.observe_measurement(measured)
    finally:
        logger.removeHandler(handler)
    warnings = [r for r in records if r.levelno == logging.WARNING]
    # First excursion reaches the cap twice (warned once); after decaying to initial, again.
    assert len(warnings) == 2
    assert "margin reached its maximum 0.15" in warnings[0].getMessage()


def test_closed_loop_violation_rate_settles_near_decay_over_growth_plus_decay():
    """A predictor that under-predicts co-located latency by 10%: the margin must rise to
    cover it, and violations then recur at about decay / (growth + decay)."""
    cfg = dict(margin_growth=0.05, margin_decay=0.00025, hysteresis_steps=1)
    levels = 64
    ctl = controller(ladder=ladder(*[(132 - 2 * i, 2 * i + 2) for i in range(levels)]), **cfg)
    colo = tuple(20.0 + 25.0 * i / (levels - 1) for i in range(levels))  # 20..45 ms, fine-grained
    inp = snap(*colo)
    num_steps, violations = 40000, 0
    for _ in range(num_steps):
        d = ctl.decide(inp)
        violations += ctl.observe_measurement(d.predicted_ms * 1.10 if d.runs_trainer else 15.0)
    expected = cfg["margin_decay"] / (cfg["margin_growth"] + cfg["margin_decay"])  # ≈ 0.5%
    assert expected / 2 <= violations / num_steps <= expected * 2
    assert 0.08 <= ctl.margin <= 0.2  # ≈ 1 − 1/1.1 = 0.091 plus a growth step at most
