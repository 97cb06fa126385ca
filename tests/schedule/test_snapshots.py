"""SchedulerLadder validation and the JSON form of decisions."""

from __future__ import annotations

import json
import math
from types import SimpleNamespace

import pytest

from harvest.schedule import WHOLE_GPU, Decision, DecisionReason, SchedulerLadder, TrainerAction


def test_ladder_from_pairs_objects_and_mixed():
    from_pairs = SchedulerLadder.from_levels([(100, 32), [64, 68]])
    from_objects = SchedulerLadder.from_levels([SimpleNamespace(decode_sms=100, trainer_sms=32), (64, 68)])
    assert from_pairs == from_objects == SchedulerLadder((100, 64), (32, 68))
    assert from_pairs.num_levels == 2
    assert from_pairs.trainer_levels == (0, 1)


def test_levels_without_trainer_sms_are_kept_but_never_candidates():
    ladder = SchedulerLadder((132, 100, 64), (0, 32, 68))
    assert ladder.num_levels == 3
    assert ladder.trainer_levels == (1, 2)


def test_single_shared_whole_device_level():
    ladder = SchedulerLadder((1,), (1,))
    assert ladder.trainer_levels == (0,)


@pytest.mark.parametrize(
    "decode,trainer,message",
    [
        ((), (), "empty"),
        ((100, 64), (32,), "2 decode_sms but 1 trainer_sms"),
        ((0,), (32,), r"decode_sms\[0\]=0: must be an integer >= 1"),
        ((100, 64.0), (32, 68), r"decode_sms\[1\]=64.0"),
        ((100,), (-1,), r"trainer_sms\[0\]=-1: must be an integer >= 0"),
        ((100,), (True,), r"trainer_sms\[0\]=True"),
        ((132, 132), (0, 0), "no level gives the trainer SMs"),
    ],
)
def test_bad_ladders_are_refused(decode, trainer, message):
    with pytest.raises(ValueError, match=message):
        SchedulerLadder(decode, trainer)


@pytest.mark.parametrize("level", [(100,), (100, 32, 1), "100/32", 7, SimpleNamespace(decode_sms=1)])
def test_from_levels_refuses_unreadable_levels(level):
    with pytest.raises(ValueError, match=r"levels\[1\]="):
        SchedulerLadder.from_levels([(100, 32), level])


def test_decision_to_dict_is_strict_json():
    paused = Decision(3, WHOLE_GPU, TrainerAction.PAUSE, DecisionReason.NONE_FITS, 0.1, 36.0, math.nan)
    data = json.loads(json.dumps(paused.to_dict(), allow_nan=False))
    assert data == {
        "step": 3,
        "level_index": -1,
        "trainer_action": "pause",
        "reason": "none_fits",
        "margin": 0.1,
        "budget_ms": 36.0,
        "predicted_ms": None,
    }
    running = Decision(4, 2, TrainerAction.RUN, DecisionReason.FITS, 0.05, 38.0, 37.5)
    assert running.runs_trainer and not paused.runs_trainer
    assert running.to_dict()["predicted_ms"] == 37.5
