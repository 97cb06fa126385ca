"""harvest.ladder: the one ladder/level type family (validation, identity, JSON form)."""

from __future__ import annotations

import json

import pytest

from harvest.ladder import GREEN_CONTEXTS, WHOLE_DEVICE, Ladder, LadderError, Level, PartitionConstraints
from tests.blocked_imports import run_with_blocked

SPATIAL = Ladder(132, (Level(32, 100), Level(64, 68), Level(132, 0)), GREEN_CONTEXTS)


def test_a_spatial_ladder_and_what_is_derived_from_it():
    assert SPATIAL.num_levels == 3 and SPATIAL.whole_device_index == 2 and SPATIAL.spatial
    assert SPATIAL.decode_sms == (32, 64, 132) and SPATIAL.trainer_sms == (100, 68, 0)
    assert SPATIAL.trainer_levels == (0, 1)
    assert [level.runs_trainer for level in SPATIAL.levels] == [True, True, False]
    assert SPATIAL.decode_fraction(1) == pytest.approx(64 / 132) and SPATIAL.trainer_fraction(2) == 0.0
    assert SPATIAL.describe() == "green-context ladder of 132 SMs, levels (decode/trainer) [32/100, 64/68, 132/0]"


def test_the_whole_device_ladder_is_one_shared_level():
    shared = Ladder.whole_device(1, "CPU device")
    assert shared.realisation == WHOLE_DEVICE and not shared.spatial
    assert shared.levels == (Level(1, 1),) and shared.whole_device_index == 0 and shared.trainer_levels == (0,)
    assert shared.decode_fraction(0) == shared.trainer_fraction(0) == 1.0
    assert "no spatial partitioning" in shared.describe() and "(CPU device)" in shared.describe()


def test_streams_and_the_planning_record_take_no_part_in_equality_or_json():
    built = Ladder(
        132,
        (Level(32, 100, "decode stream", "trainer stream"), Level(64, 68, 1, 2), Level(132, 0, 3, None)),
        GREEN_CONTEXTS,
        constraints=PartitionConstraints(8, 8, 8, "arch rules"),
        note="planned",
    )
    assert built == SPATIAL and built.to_dict() == SPATIAL.to_dict()
    assert built.levels[0].decode_stream == "decode stream"  # carried along all the same
    assert Level(32, 100, "a") == Level(32, 100, "b") and Level(32, 100) != Level(32, 99)
    assert Ladder(132, SPATIAL.levels, "other") != SPATIAL  # the realisation is part of the split


def test_json_form_is_the_profile_format_and_round_trips():
    data = json.loads(json.dumps(SPATIAL.to_dict()))
    assert data == {
        "total_sms": 132,
        "partitioner": GREEN_CONTEXTS,
        "levels": [{"decode_sms": 32, "trainer_sms": 100}, {"decode_sms": 64, "trainer_sms": 68},
                   {"decode_sms": 132, "trainer_sms": 0}],
    }
    assert Ladder.from_dict(data) == SPATIAL
    legacy = {"total_sms": 1, "levels": [{"decode_sms": 1, "trainer_sms": 1}]}  # no realisation: whole device
    assert Ladder.from_dict(legacy) == Ladder.whole_device(1)


@pytest.mark.parametrize(
    "build, message",
    [
        (lambda: Ladder(132, ()), "empty"),
        (lambda: Ladder(0, (Level(1, 1),)), r"total_sms=0: must be an integer >= 1"),
        (lambda: Ladder(132, ((64, 68), Level(132, 0)), GREEN_CONTEXTS), r"levels\[0\]=\(64, 68\): must be a Level"),
        (lambda: Ladder(132, (Level(140, 0),), GREEN_CONTEXTS), "more SMs than the device's 132"),
        (lambda: Ladder(132, (Level(64, 68),), GREEN_CONTEXTS), "the last level must give decode the whole device"),
        (lambda: Ladder(132, (Level(64, 68), Level(132, 132)), WHOLE_DEVICE), "one level where decode and trainer share"),
        (lambda: Ladder(132, (Level(132, 0),), WHOLE_DEVICE), "one level where decode and trainer share"),
        (lambda: Ladder(132, (Level(132, 0),), ""), "realisation=''"),
        (lambda: Level(0, 132), r"Level.decode_sms=0: must be an integer >= 1"),
        (lambda: Level(64.0, 68), r"Level.decode_sms=64.0"),
        (lambda: Level(64, -1), r"Level.trainer_sms=-1: must be an integer >= 0"),
        (lambda: Level(64, True), r"Level.trainer_sms=True"),
        (lambda: Ladder.from_dict({"total_sms": 1, "levels": [{"decode_sms": 1}]}), "expected exactly decode_sms"),
        (lambda: Ladder.from_dict({"total_sms": 1, "partitioner": 7, "levels": []}), r"ladder.partitioner=7"),
    ],
)
def test_bad_ladders_are_refused_naming_the_field(build, message):
    with pytest.raises(LadderError, match=message):
        build()


def test_the_ladder_imports_nothing_outside_the_standard_library():
    code = """
        import harvest.ladder
        loaded = sorted(m for m in sys.modules if m.split(".")[0] in BLOCKED)
        assert not loaded, loaded
        print("ok")
        """
    out = run_with_blocked(["torch", "numpy", "sklearn"], code, timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "ok"
