"""QoSController: committing decisions, the ring buffer, counters, and bad input."""

from __future__ import annotations

import json
import threading
from types import SimpleNamespace

import pytest

from harvest.ladder import GREEN_CONTEXTS, Ladder, Level
from harvest.schedule import DecisionReason, QoSController, SchedulerConfig, TrainerState
from tests.schedule.helpers import LADDER, WHOLE, config, controller, snap


def test_the_ladder_is_the_shared_type_and_bad_ladders_or_config_are_refused():
    assert QoSController(config(), LADDER).ladder is LADDER
    levels = [SimpleNamespace(decode_sms=120, trainer_sms=12), SimpleNamespace(decode_sms=132, trainer_sms=0)]
    for not_a_ladder in ([(120, 12), (132, 0)], levels, []):
        with pytest.raises(ValueError, match="must be a harvest.ladder.Ladder"):
            QoSController(config(), not_a_ladder)  # type: ignore[arg-type]
    trainerless = Ladder(132, (Level(100, 0), Level(132, 0)), GREEN_CONTEXTS)
    with pytest.raises(ValueError, match="no level of the green-context ladder .* gives the trainer SMs"):
        QoSController(config(), trainerless)
    with pytest.raises(ValueError, match="must be a SchedulerConfig"):
        QoSController({"target_tpot_ms": 40}, LADDER)  # type: ignore[arg-type]


def test_choose_is_a_query_and_decide_commits_it():
    ctl = controller()
    inp = snap(20.0, 30.0, 35.0, 37.0)
    before = ctl.state
    preview = ctl.choose(inp)
    assert ctl.state == before and ctl.recent_decisions() == () and ctl.stats().num_decisions == 0
    assert ctl.decide(inp) == preview
    assert ctl.state.step == 1 and ctl.recent_decisions() == (preview,)


def test_steps_are_numbered_from_zero():
    ctl = controller()
    assert [ctl.decide(snap(20.0, 30.0, 35.0, 37.0)).step for _ in range(5)] == [0, 1, 2, 3, 4]


def test_ring_buffer_wraps_keeping_the_newest_in_order():
    ctl = controller(ring_size=5)
    for i in range(12):
        ctl.decide(snap(20.0, 30.0, 35.0, 37.0, trainer=TrainerState.RUNNING if i % 3 else TrainerState.STARVED))
    recent = ctl.recent_decisions()
    assert [d.step for d in recent] == [7, 8, 9, 10, 11]
    assert isinstance(recent, tuple)
    assert ctl.stats().num_decisions == 12  # counters are not limited by the ring


def test_ring_of_one():
    ctl = controller(ring_size=1)
    for _ in range(3):
        last = ctl.decide(snap(20.0, 30.0, 35.0, 37.0))
    assert ctl.recent_decisions() == (last,)


def test_counters_by_reason_and_level_match_the_decisions():
    ctl = controller(ring_size=100, hysteresis_steps=2, floor_after_paused_steps=3)
    inputs = [
        snap(20.0, 30.0, 35.0, 37.0),
        snap(39.0, 40.0, 45.0, 50.0),
        snap(39.5, 38.5, 41.0, 45.0),
        snap(20.0, 30.0, 35.0, 45.0, trainer=TrainerState.STARVED),
        snap(20.0, 30.0, 35.0, 45.0, trainer=TrainerState.ABSENT),
        snap(20.0, 30.0, 35.0, 45.0, trainer=TrainerState.PAUSED),
        snap(20.0, 30.0, 35.0, 45.0, trainer=TrainerState.STOPPED),
    ]
    for i in range(70):
        ctl.decide(inputs[(i * 7 + i // 5) % len(inputs)])
    decisions = ctl.recent_decisions()
    stats = ctl.stats()
    assert len(decisions) == stats.num_decisions == 70
    for reason in DecisionReason:
        assert stats.decisions_by_reason[reason] == sum(d.reason is reason for d in decisions), reason
    assert set(stats.decisions_by_level) == {0, 1, 2, 3, WHOLE}
    for level, count in stats.decisions_by_level.items():
        assert count == sum(d.level_index == level for d in decisions), level
    assert sum(stats.decisions_by_reason.values()) == sum(stats.decisions_by_level.values()) == 70
    # Several reasons were exercised, so the check above is not vacuous.
    assert sum(1 for count in stats.decisions_by_reason.values() if count) >= 6
    data = json.loads(json.dumps(stats.to_dict(), allow_nan=False))
    assert data["num_decisions"] == 70 and data["decisions_by_level"][str(WHOLE)] == stats.decisions_by_level[WHOLE]


def test_stats_are_a_snapshot():
    ctl = controller()
    ctl.decide(snap(20.0, 30.0, 35.0, 37.0))
    stats = ctl.stats()
    ctl.decide(snap(20.0, 30.0, 35.0, 37.0))
    assert stats.num_decisions == 1 and sum(stats.decisions_by_reason.values()) == 1


@pytest.mark.parametrize(
    "bad",
    [
        snap(20.0, 30.0, 35.0),
        snap(20.0, 30.0, 35.0, 37.0, trainer="running"),
        snap(20.0, "x", 35.0, 37.0),
    ],
)
def test_bad_input_raises_and_changes_nothing(bad):
    ctl = controller()
    ctl.decide(snap(20.0, 30.0, 35.0, 37.0))
    before = (ctl.state, ctl.stats(), ctl.recent_decisions())
    with pytest.raises(ValueError):
        ctl.decide(bad)
    assert (ctl.state, ctl.stats(), ctl.recent_decisions()) == before
    ctl.observe_measurement(30.0)  # the previous decision still awaits its measurement


def test_default_config_end_to_end():
    ctl = QoSController(SchedulerConfig(), LADDER)
    for _ in range(3):
        d = ctl.decide(snap(20.0, 30.0, 35.0, 37.0))
        ctl.observe_measurement(d.predicted_ms * 1.01 if d.runs_trainer else 9.0)
    assert (d.reason, d.level_index) == (DecisionReason.FITS, 3)


@pytest.mark.timeout(60)
def test_inspection_from_another_thread_while_deciding():
    ctl = controller(ring_size=64)
    inputs = [snap(20.0, 30.0, 35.0, 37.0), snap(39.0, 40.0, 45.0, 50.0),
              snap(20.0, 30.0, 35.0, 45.0, trainer=TrainerState.STARVED)]
    done = threading.Event()
    errors: list[BaseException] = []

    def inspect():
        try:
            while not done.is_set():
                steps = [d.step for d in ctl.recent_decisions()]
                assert steps == list(range(steps[0], steps[0] + len(steps))) if steps else True
                ctl.stats().to_dict()
        except BaseException as error:  # noqa: BLE001 - reported below
            errors.append(error)

    reader = threading.Thread(target=inspect)
    reader.start()
    try:
        for i in range(30000):
            ctl.decide(inputs[i % 3])
            ctl.observe_measurement(30.0)
    finally:
        done.set()
        reader.join(timeout=30)
    assert not reader.is_alive() and not errors
    assert ctl.stats().num_decisions == 30000
