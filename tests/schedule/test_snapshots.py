"""What the scheduler reads off the shared ladder, and the JSON form of decisions."""

from __future__ import annotations

import json
import math

from harvest.ladder import Ladder
from harvest.schedule import Decision, DecisionReason, TrainerAction
from tests.schedule.helpers import LADDER, WHOLE, ladder


def test_the_scheduler_reads_per_level_counts_off_the_ladder():
    assert LADDER.num_levels == 5 and WHOLE == 4
    assert LADDER.decode_sms == (120, 96, 64, 32, 132)
    assert LADDER.trainer_sms == (12, 36, 68, 100, 0)
    assert LADDER.trainer_levels == (0, 1, 2, 3)


def test_levels_without_trainer_sms_are_kept_but_never_candidates():
    with_idle_partition = ladder((100, 0), (64, 68))
    assert with_idle_partition.num_levels == 3
    assert with_idle_partition.trainer_levels == (1,)


def test_single_shared_whole_device_level():
    shared = Ladder.whole_device(1)
    assert shared.trainer_levels == (0,) and shared.whole_device_index == 0


def test_decision_to_dict_is_strict_json():
    paused = Decision(3, WHOLE, TrainerAction.PAUSE, DecisionReason.NONE_FITS, 0.1, 36.0, math.nan)
    data = json.loads(json.dumps(paused.to_dict(), allow_nan=False))
    assert data == {
        "step": 3,
        "level_index": WHOLE,
        "trainer_action": "pause",
        "reason": "none_fits",
        "margin": 0.1,
        "budget_ms": 36.0,
        "predicted_ms": None,
    }
    running = Decision(4, 2, TrainerAction.RUN, DecisionReason.FITS, 0.05, 38.0, 37.5)
    assert running.runs_trainer and not paused.runs_trainer
    assert running.to_dict()["predicted_ms"] == 37.5
