"""Ladder planning (harvest.compute.ladder_planning): realistic GPUs, odd SM counts, bad input.

Invariants checked for every plan: at most MAX_LEVELS levels, ascending decode SMs, the
last level is the whole device (trainer 0), every partial level is realisable (decode a
multiple of the step and >= the minimum, the remainder >= the trainer minimum) and the
two sides add up to the device.
"""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap

import pytest

from harvest.compute.ladder_planning import (
    MAX_LEVELS,
    arch_constraints,
    check_driver_version,
    device_constraints,
    parse_levels,
    plan_ladder,
    realisable_decode_counts,
)
from harvest.ladder import GREEN_CONTEXTS, WHOLE_DEVICE, Ladder, LadderError, PartitionConstraints

GPUS = {
    "H100 SXM": (132, (9, 0)),
    "H200": (132, (9, 0)),
    "H100 PCIe": (114, (9, 0)),
    "A100": (108, (8, 0)),
    "RTX 6000 Ada": (142, (8, 9)),
    "L4": (58, (8, 9)),
    "B200": (148, (10, 0)),
    "odd 57 SMs cc 8.6": (57, (8, 6)),
    "odd 33 SMs cc 7.5": (33, (7, 5)),
    "odd 13 SMs cc 6.1": (13, (6, 1)),
    "odd 75 SMs cc 9.0": (75, (9, 0)),
}


def assert_valid(plan, total_sms, constraints):
    levels = plan.levels
    assert plan.total_sms == total_sms and plan.spatial and plan.realisation == GREEN_CONTEXTS
    assert 2 <= len(levels) <= MAX_LEVELS
    assert (levels[-1].decode_sms, levels[-1].trainer_sms) == (total_sms, 0)
    assert plan.whole_device_index == len(levels) - 1
    decodes = [level.decode_sms for level in levels]
    assert decodes == sorted(set(decodes)), "strictly ascending decode SMs"
    for level in levels[:-1]:
        assert level.decode_sms + level.trainer_sms == total_sms
        assert level.decode_sms >= constraints.min_decode_sms
        assert level.decode_sms % constraints.step_sms == 0
        assert level.trainer_sms >= constraints.min_trainer_sms


@pytest.mark.parametrize("gpu", sorted(GPUS))
@pytest.mark.parametrize("num_levels", range(2, MAX_LEVELS + 1))
def test_auto_ladder_is_valid_on_real_gpus(gpu, num_levels):
    total_sms, cc = GPUS[gpu]
    plan = plan_ladder(total_sms, cc, num_levels)
    assert_valid(plan, total_sms, arch_constraints(cc))
    assert len(plan.levels) <= num_levels
    if total_sms >= 100:  # big GPUs have room for every requested level
        assert len(plan.levels) == num_levels
    assert plan_ladder(total_sms, cc, num_levels) == plan  # deterministic


@pytest.mark.parametrize(
    "total_sms, cc, num_levels, expected_decode",
    [
        # Hopper: multiples of 8; the trainer takes the remainder (108, 84, 68, 44, 20 SMs).
        (132, (9, 0), 6, [24, 48, 64, 88, 112, 132]),
        (132, (9, 0), 2, [64, 132]),
        (132, (9, 0), 8, [16, 32, 48, 64, 80, 96, 112, 132]),
        # Ampere / Ada: minimum 4, step 2, so i/N of the device is hit almost exactly.
        (108, (8, 0), 6, [18, 36, 54, 72, 90, 108]),
        (142, (8, 9), 6, [24, 48, 72, 94, 118, 142]),
        (58, (8, 9), 4, [14, 30, 44, 58]),
        # Small devices collapse to the levels that exist.
        (24, (9, 0), 6, [8, 16, 24]),
        (16, (9, 0), 8, [8, 16]),
    ],
)
def test_auto_ladder_gives_decode_about_i_over_n_of_the_device(total_sms, cc, num_levels, expected_decode):
    plan = plan_ladder(total_sms, cc, num_levels)
    assert [level.decode_sms for level in plan.levels] == expected_decode
    assert [level.trainer_sms for level in plan.levels] == [total_sms - d for d in expected_decode]


def test_hopper_remainder_need_not_be_a_multiple_of_eight():
    plan = plan_ladder(132, (9, 0), [8, 64, 120])
    assert [(lv.decode_sms, lv.trainer_sms) for lv in plan.levels] == [(8, 124), (64, 68), (120, 12), (132, 0)]


def test_explicit_levels_are_sorted_and_the_whole_device_is_added_once():
    plan = plan_ladder(108, (8, 0), [80, 20, 108, 54])
    assert [lv.decode_sms for lv in plan.levels] == [20, 54, 80, 108]
    assert plan_ladder(108, (8, 0), [54]).levels[-1].decode_sms == 108


@pytest.mark.parametrize(
    "levels, message",
    [
        ([140], "more SMs than the device's 132"),
        ([4], "fewer decode SMs than the minimum partition of 8"),
        ([60], r"must be a multiple of 8 .*nearest realisable: 56 or 64"),
        ([127], r"nearest realisable: 120$"),
        ([128], "leaves the trainer 4 SMs, under its minimum of 8; the largest realisable decode count is 120"),
        ([132], r"levels=\[132\] has no partial level: the trainer would never get SMs"),
        ([], "levels is empty"),
        ([64, 64], r"lists \[64\] more than once"),
        (list(range(8, 72, 8)), "8 partial levels: at most 7"),
        (1, "ask for 2 to 8 levels"),
        (9, "ask for 2 to 8 levels"),
        (0, "ask for 2 to 8 levels"),
        ("64", "give a number of levels or a list"),
        ([64.0], "must be integers"),
        ([True], "must be integers"),
        (None, "give a number of levels or a list"),
    ],
)
def test_bad_levels_name_the_constraint(levels, message):
    with pytest.raises(LadderError, match=message):
        plan_ladder(132, (9, 0), levels)


@pytest.mark.parametrize(
    "total_sms, cc, message",
    [
        (0, (9, 0), "total_sms=0: must be a positive integer"),
        (-8, (9, 0), "total_sms=-8"),
        (True, (9, 0), "total_sms=True"),
        (132, (5, 2), "compute capability 5.2: green contexts need compute capability 6.0"),
        (132, "nine", r"compute_capability='nine': give \(major, minor\)"),
        (132, (9,), "compute_capability"),
        (12, (9, 0), "no partial level fits 12 SMs: decode needs >= 8 and the trainer >= 8"),
        (7, (8, 0), "no partial level fits 7 SMs"),
    ],
)
def test_bad_device_description_names_the_constraint(total_sms, cc, message):
    with pytest.raises(LadderError, match=message):
        plan_ladder(total_sms, cc, 4)


def test_compute_capability_accepts_text():
    assert plan_ladder(132, "9.0", 4) == plan_ladder(132, (9, 0), 4)


@pytest.mark.parametrize(
    "cc, rule",
    [((6, 1), (1, 1)), ((7, 0), (2, 2)), ((7, 5), (2, 2)), ((8, 0), (4, 2)), ((8, 9), (4, 2)),
     ((9, 0), (8, 8)), ((10, 0), (8, 8)), ((12, 0), (8, 8))],
)
def test_arch_rules(cc, rule):
    constraints = arch_constraints(cc)
    assert (constraints.min_decode_sms, constraints.step_sms) == rule
    assert constraints.min_trainer_sms == rule[0]
    assert f"cc {cc[0]}.x" in constraints.source


def test_driver_reported_constraints_win_over_arch_rules():
    reported = device_constraints((9, 0), min_sm_partition_size=4, sm_coscheduled_alignment=2)
    assert (reported.min_decode_sms, reported.step_sms) == (4, 2)
    assert reported.source.startswith("driver")
    plan = plan_ladder(132, (9, 0), [6, 66], reported)  # not realisable under the arch rule
    assert [lv.decode_sms for lv in plan.levels] == [6, 66, 132]
    with pytest.raises(LadderError, match=r"multiple of 2 \(driver"):
        plan_ladder(132, (9, 0), [7], reported)
    # Not reported (0) -> arch rules; one reported -> that one, the other from the rule.
    assert device_constraints((9, 0), 0, 0) == arch_constraints((9, 0))
    partly = device_constraints((8, 0), min_sm_partition_size=6)
    assert (partly.min_decode_sms, partly.step_sms) == (6, 2)


def test_trainer_minimum_can_be_raised():
    constraints = device_constraints((9, 0), min_trainer_sms=16)
    with pytest.raises(LadderError, match="leaves the trainer 12 SMs, under its minimum of 16"):
        plan_ladder(132, (9, 0), [120], constraints)
    assert plan_ladder(132, (9, 0), 8, constraints).levels[-2].trainer_sms >= 16


@pytest.mark.parametrize(
    "field, value", [("min_decode_sms", 0), ("step_sms", 0), ("min_trainer_sms", -1), ("step_sms", 2.0)]
)
def test_constraints_are_validated(field, value):
    fields = {"min_decode_sms": 8, "step_sms": 8, "min_trainer_sms": 8, "source": "test"}
    fields[field] = value
    with pytest.raises(LadderError, match=f"PartitionConstraints.{field}"):
        PartitionConstraints(**fields)


def test_exhaustive_single_level_requests_match_the_realisable_set():
    """For every device size up to 160 SMs and every architecture rule, a single-level
    request succeeds exactly for the realisable counts."""
    for cc in ((6, 0), (7, 0), (8, 0), (9, 0)):
        c = arch_constraints(cc)
        for total in range(1, 161):
            realisable = set(realisable_decode_counts(total, c))
            for decode in range(1, total + 1):
                try:
                    plan = plan_ladder(total, cc, [decode])
                except LadderError:
                    assert decode not in realisable, (total, cc, decode)
                    continue
                assert decode in realisable, (total, cc, decode)
                assert_valid(plan, total, c)


def test_exhaustive_auto_ladders_are_valid_or_refused_with_the_reason():
    for cc in ((6, 0), (7, 0), (8, 0), (9, 0)):
        c = arch_constraints(cc)
        for total in range(1, 161):
            for num_levels in range(2, MAX_LEVELS + 1):
                if not realisable_decode_counts(total, c):
                    with pytest.raises(LadderError, match="no partial level fits"):
                        plan_ladder(total, cc, num_levels)
                    continue
                assert_valid(plan_ladder(total, cc, num_levels), total, c)


@pytest.mark.parametrize(
    "version, message",
    [(None, "no CUDA driver: green contexts need a CUDA driver >= 12.4"),
     (12020, r"CUDA driver 12.2 is too old: green contexts need a CUDA driver >= 12.4"),
     (11080, "11.8 is too old")],
)
def test_old_or_missing_driver_is_refused(version, message):
    with pytest.raises(LadderError, match=message):
        check_driver_version(version)


@pytest.mark.parametrize("version", [12040, 12080, 13000])
def test_green_context_drivers_pass(version):
    check_driver_version(version)


def test_whole_device_ladder_is_one_shared_level():
    plan = Ladder.whole_device(132, "driver 12.2")
    assert not plan.spatial and plan.constraints is None and plan.realisation == WHOLE_DEVICE
    assert [(lv.decode_sms, lv.trainer_sms) for lv in plan.levels] == [(132, 132)]
    assert plan.whole_device_index == 0 and plan.trainer_levels == (0,)
    assert "no spatial partitioning" in plan.describe() and "driver 12.2" in plan.describe()
    with pytest.raises(LadderError, match="total_sms=0"):
        Ladder.whole_device(0, "x")


def test_plans_serialise_to_json():
    plan = plan_ladder(132, (9, 0), 4)
    spatial = json.loads(json.dumps(plan.to_dict()))
    assert spatial["partitioner"] == GREEN_CONTEXTS and spatial["levels"][-1] == {"decode_sms": 132, "trainer_sms": 0}
    assert plan.constraints.step_sms == 8
    assert Ladder.from_dict(spatial) == plan  # the planning record (constraints) is not part of the split
    shared = json.loads(json.dumps(Ladder.whole_device(1, "CPU device").to_dict()))
    assert shared == {"total_sms": 1, "partitioner": WHOLE_DEVICE, "levels": [{"decode_sms": 1, "trainer_sms": 1}]}


def test_planning_imports_and_runs_with_torch_unimportable():
    code = textwrap.dedent(
        """
        import importlib.abc, sys
        class Refuse(importlib.abc.MetaPathFinder):
            def find_spec(self, name, path=None, target=None):
                if name.split(".")[0] in ("torch", "numpy", "sglang"):
                    raise ImportError(name + " is blocked for this test")
        sys.meta_path.insert(0, Refuse())
        from harvest.compute.ladder_planning import plan_ladder
        import harvest.compute  # the whole package imports torch only where streams are made
        plan = plan_ladder(132, (9, 0), 6)
        partitioner = harvest.compute.create_partitioner("cpu")
        assert partitioner.ladder.levels[0].decode_stream is None
        assert "torch" not in sys.modules
        print(plan.describe())
        """
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert "132/0" in out.stdout


@pytest.mark.parametrize("text, levels", [("5", 5), ("2", 2), ("8", 8), ("24,40,56", (56, 40, 24)),
                                          (" 132, 96,64 ,32", (132, 96, 64, 32)), ("24,32,40,48,56,80,104,132",
                                                                                   (132, 104, 80, 56, 48, 40, 32, 24))])
def test_levels_on_a_command_line_are_a_count_or_decode_sm_counts(text, levels):
    parsed = parse_levels(text)
    assert parsed == levels
    if isinstance(parsed, tuple):  # what the planner takes, as harvest.yaml's `ladder` gives it
        assert [lv.decode_sms for lv in plan_ladder(132, (9, 0), levels=list(parsed)).levels] == \
            sorted(set(parsed) | {132})


@pytest.mark.parametrize("text, message", [("1", "ask for 2 to 8 levels"), ("9", "ask for 2 to 8 levels"),
                                           ("", "a number of levels, or decode SM counts"),
                                           ("24,,40", "a number of levels, or decode SM counts"),
                                           ("24,24", "distinct integers >= 1"), ("-8,16", "distinct integers >= 1"),
                                           ("8,16,24,32,40,48,56,64,72", "at most 8 levels")])
def test_bad_levels_on_a_command_line_say_what_is_wrong(text, message):
    with pytest.raises(ValueError, match=message):
        parse_levels(text)
