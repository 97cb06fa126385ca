"""SchedulerConfig: defaults, and every bad value refused with field, value and fix."""

from __future__ import annotations

import dataclasses
import math

import pytest

from harvest.schedule import SchedulerConfig


def test_defaults_are_valid_and_documented_values():
    cfg = SchedulerConfig()
    assert cfg.target_tpot_ms == 40.0
    assert 0.0 <= cfg.initial_margin <= cfg.max_margin < 1.0
    assert cfg.hysteresis_steps >= 1
    assert cfg.floor_margin <= cfg.initial_margin
    assert cfg.budget_ms(cfg.initial_margin) == pytest.approx(38.0)
    # The documented equilibrium violation rate decay / (growth + decay) stays under 1%.
    assert cfg.margin_decay / (cfg.margin_growth + cfg.margin_decay) < 0.01


def test_frozen():
    with pytest.raises(dataclasses.FrozenInstanceError):
        SchedulerConfig().target_tpot_ms = 10.0  # type: ignore[misc]


def test_integers_given_for_float_fields_become_floats():
    cfg = SchedulerConfig(target_tpot_ms=50, initial_margin=0, max_margin=0, margin_growth=0, margin_decay=0)
    assert type(cfg.target_tpot_ms) is float and cfg.target_tpot_ms == 50.0
    assert type(cfg.max_margin) is float


def test_optional_features_can_be_disabled():
    cfg = SchedulerConfig(hysteresis_gain=None, floor_after_paused_steps=None, hysteresis_steps=1, backoff_steps=None)
    assert cfg.hysteresis_gain is None and cfg.floor_after_paused_steps is None and cfg.backoff_steps is None


BAD_VALUES = [
    ("target_tpot_ms", 0, "> 0"),
    ("target_tpot_ms", -40.0, "> 0"),
    ("target_tpot_ms", math.nan, "finite"),
    ("target_tpot_ms", math.inf, "finite"),
    ("target_tpot_ms", "40", "finite number"),
    ("target_tpot_ms", True, "finite number"),
    ("target_tpot_ms", None, "finite number"),
    ("initial_margin", -0.01, "[0.0, 1.0)"),
    ("initial_margin", 1.0, "[0.0, 1.0)"),
    ("max_margin", 0.01, "initial_margin=0.05"),
    ("max_margin", 1.0, "a finite number in [0.0, 1.0)"),
    ("margin_growth", -0.1, ">= 0.0"),
    ("margin_growth", math.nan, "finite"),
    ("margin_decay", -1e-6, ">= 0.0"),
    ("hysteresis_steps", 0, "integer >= 1"),
    ("hysteresis_steps", 2.0, "integer >= 1"),
    ("hysteresis_steps", True, "integer >= 1"),
    ("hysteresis_gain", 0.0, "(0.0, 1.0]"),
    ("hysteresis_gain", 1.5, "(0.0, 1.0]"),
    ("hysteresis_gain", "big", "finite number"),
    ("floor_after_paused_steps", 0, "integer >= 1"),
    ("floor_after_paused_steps", -3, "integer >= 1"),
    ("floor_after_paused_steps", 2.5, "integer >= 1"),
    ("floor_margin", -0.1, "a finite number in [0.0, 1.0)"),
    ("floor_margin", 0.06, "initial_margin=0.05"),
    ("backoff_steps", 0, "integer >= 1"),
    ("backoff_steps", 1.5, "integer >= 1"),
    ("max_backoff_steps", 16, "an integer >= backoff_steps=32; the longest backoff in decisions"),
    ("max_backoff_steps", None, "an integer >= 1"),
    ("ring_size", 0, "integer >= 1"),
    ("ring_size", 10.0, "integer >= 1"),
]


@pytest.mark.parametrize("field,value,expected", BAD_VALUES, ids=[f"{f}={v!r}" for f, v, _ in BAD_VALUES])
def test_bad_value_names_field_value_and_fix(field, value, expected):
    with pytest.raises(ValueError) as info:
        SchedulerConfig(**{field: value})
    message = str(info.value)
    assert message.startswith(f"SchedulerConfig.{field}={value!r}: "), message
    assert expected in message, message
    assert ";" in message  # the constraint, then the fix


def test_cross_field_bounds_follow_initial_margin():
    SchedulerConfig(initial_margin=0.2, max_margin=0.2, floor_margin=0.2)
    with pytest.raises(ValueError, match=r"max_margin=0\.1.*initial_margin=0\.2"):
        SchedulerConfig(initial_margin=0.2, max_margin=0.1)
    SchedulerConfig(backoff_steps=2048, max_backoff_steps=2048)
    with pytest.raises(ValueError, match=r"max_backoff_steps=1024: expected an integer >= backoff_steps=2048; "):
        SchedulerConfig(backoff_steps=2048)


def test_from_mapping_builds_and_refuses_unknown_keys():
    cfg = SchedulerConfig.from_mapping({"target_tpot_ms": 30, "hysteresis_steps": 5})
    assert cfg.target_tpot_ms == 30.0 and cfg.hysteresis_steps == 5
    assert SchedulerConfig.from_mapping({}) == SchedulerConfig()
    with pytest.raises(ValueError, match=r"^qos: unknown key\(s\) hysteresis, tpot \(known: target_tpot_ms, "):
        SchedulerConfig.from_mapping({"tpot": 40, "hysteresis": 2}, where="qos")
    with pytest.raises(ValueError, match=r"^qos: ring_size=-1: expected an integer >= 1; "):
        SchedulerConfig.from_mapping({"ring_size": -1}, where="qos")
    with pytest.raises(ValueError, match=r"^qos: max_margin=0\.1: expected a number >= initial_margin=0\.2; "):
        SchedulerConfig.from_mapping({"initial_margin": 0.2, "max_margin": 0.1}, where="qos")
    with pytest.raises(ValueError, match=r"^qos: margin is now initial_margin: rename the key"):
        SchedulerConfig.from_mapping({"margin": 0.1}, where="qos")
    with pytest.raises(ValueError, match="expected a mapping"):
        SchedulerConfig.from_mapping([("target_tpot_ms", 40)])  # type: ignore[arg-type]


def test_to_dict_round_trips():
    cfg = SchedulerConfig(target_tpot_ms=25.0, hysteresis_gain=None)
    assert SchedulerConfig.from_mapping(cfg.to_dict()) == cfg
