"""The minimum-progress floor: after K steps of a runnable but paused trainer, one step
on the safest level predicted under the floor's relaxed target — never over it."""

from __future__ import annotations

import pytest

from harvest.schedule import DecisionReason, TrainerAction, TrainerState, choose
from tests.schedule.helpers import LADDER, WHOLE, controller, ladder, snap, state

FLOOR, NONE_FITS, HOLD = DecisionReason.FLOOR, DecisionReason.NONE_FITS, DecisionReason.HYSTERESIS_HOLD
# Over the margin budget (38 ms) everywhere, under the raw target (40 ms) on levels 0 and 1.
SLACK = snap(39.5, 38.5, 41.0, 45.0)
NO_SLACK = snap(40.5, 41.0, 45.0, 50.0)


def test_floor_fires_once_every_k_plus_one_paused_steps():
    k = 4
    ctl = controller(floor_after_paused_steps=k)
    got = [ctl.decide(SLACK) for _ in range(3 * (k + 1))]
    assert [d.reason for d in got] == ([NONE_FITS] * k + [FLOOR]) * 3
    floor = got[k]
    # Safest level under the raw target: 38.5 ms (level 1), not the closest (39.5 ms).
    assert (floor.level_index, floor.trainer_action, floor.predicted_ms) == (1, TrainerAction.RUN, 38.5)
    assert floor.budget_ms == 40.0 and floor.margin == 0.05


def test_floor_never_runs_a_level_predicted_over_the_floor_target():
    ctl = controller(floor_after_paused_steps=2)
    got = [ctl.decide(NO_SLACK) for _ in range(50)]
    assert all(d.reason is NONE_FITS and d.level_index == WHOLE for d in got)
    assert ctl.state.paused_steps == 50


def test_floor_margin_tightens_the_floor_target():
    ctl = controller(floor_after_paused_steps=1, floor_margin=0.02)  # floor target 39.2 ms
    got = [ctl.decide(snap(39.5, 39.3, 41.0, 45.0)) for _ in range(4)]
    assert all(d.reason is NONE_FITS for d in got)
    ctl = controller(floor_after_paused_steps=1, floor_margin=0.02)
    got = [ctl.decide(snap(39.5, 39.1, 41.0, 45.0)) for _ in range(2)]
    assert [d.reason for d in got] == [NONE_FITS, FLOOR] and got[1].budget_ms == pytest.approx(39.2)


def test_violations_tighten_the_floor_as_they_tighten_the_rule():
    # Margin growth 0.05 per co-located violation: after one, the floor keeps 5% of the
    # 40 ms target (38 ms): level 1's 38.5 ms no longer fits; 37.5 ms does.
    ctl = controller(floor_after_paused_steps=1)
    got = [ctl.decide(SLACK) for _ in range(2)]
    assert [d.reason for d in got] == [NONE_FITS, FLOOR]
    assert ctl.observe_measurement(41.0)  # the floor step ran over the target
    assert ctl.margin == pytest.approx(0.10)
    got = [ctl.decide(SLACK) for _ in range(6)]
    assert all(d.reason is NONE_FITS for d in got)
    floor = ctl.decide(snap(39.5, 37.5, 41.0, 45.0))
    assert floor.reason is FLOOR and floor.budget_ms == pytest.approx(38.0) and floor.predicted_ms == 37.5
    # On-target co-located steps decay the margin back, and the floor target with it.
    for _ in range(2000):
        ctl.decide(snap(37.0, 30.0, 41.0, 45.0))
        ctl.observe_measurement(30.0)
    assert ctl.margin == pytest.approx(0.05)
    got = [ctl.decide(SLACK) for _ in range(2)]
    assert FLOOR in [d.reason for d in got] and [d for d in got if d.reason is FLOOR][0].budget_ms == pytest.approx(40.0)


def test_floor_disabled():
    ctl = controller(floor_after_paused_steps=None)
    assert all(ctl.decide(SLACK).reason is NONE_FITS for _ in range(100))


def test_steps_the_trainer_could_not_run_neither_count_nor_reset():
    ctl = controller(floor_after_paused_steps=3)
    starved = snap(39.5, 38.5, 41.0, 45.0, trainer=TrainerState.STARVED)
    seq = [SLACK, SLACK, starved, starved, SLACK, SLACK]
    assert [ctl.decide(inp).reason for inp in seq] == [
        NONE_FITS, NONE_FITS, DecisionReason.TRAINER_STARVED, DecisionReason.TRAINER_STARVED, NONE_FITS, FLOOR
    ]


def test_floor_also_ends_a_long_resume_wait():
    # Hysteresis longer than the floor: the floor lets the trainer make progress meanwhile.
    ctl = controller(hysteresis_steps=10, floor_after_paused_steps=2)
    fits = snap(20.0, 30.0, 37.0, 45.0)
    got = [ctl.decide(fits) for _ in range(3)]
    assert [d.reason for d in got] == [HOLD, HOLD, FLOOR]
    assert got[2].level_index == 0  # the safest level (20 ms), not Harli's choice


def test_after_a_floor_step_an_over_budget_level_is_left_at_once():
    ctl = controller(floor_after_paused_steps=1)
    got = [ctl.decide(SLACK) for _ in range(3)]
    assert [d.reason for d in got] == [NONE_FITS, FLOOR, NONE_FITS]
    assert ctl.state.reference_level is None and ctl.state.paused_steps == 1


def test_floor_ignores_levels_without_trainer_sms():
    one_partition = ladder((100, 32))  # and the whole device, 132/0, predicted safest at 20 ms
    cfg_ctl = controller(ladder=one_partition, floor_after_paused_steps=1)
    d = choose(cfg_ctl.config, one_partition, state(paused=1), snap(39.0, whole_device_ms=20.0))
    assert (d.reason, d.level_index) == (FLOOR, 0)


def test_floor_needs_k_paused_steps_exactly():
    ctl = controller(floor_after_paused_steps=5)
    assert choose(ctl.config, LADDER, state(paused=4), SLACK).reason is NONE_FITS
    assert choose(ctl.config, LADDER, state(paused=5), SLACK).reason is FLOOR
