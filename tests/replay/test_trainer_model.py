"""The replay's trainer model from a profile's measured trainer section (schema 2), by
hand, and the SM-share fallback for profiles without one."""

from __future__ import annotations

import dataclasses
import json

import pytest

from harvest.predict.schema import TrainerAloneRecord, TrainerSection
from harvest.replay import comparison, profile_source, trainer_model
from harvest.replay.profile_source import LevelTrainerRecord, PhaseUnits
from tests.replay.helpers import make_profile, settings
from tests.replay.test_policies import STEADY

# Alone (units/s): whole device forward 100, backward 50 -> alternating 2 / (1/100 + 1/50) = 66.67;
# level 0 (40/60 SMs): 60, 30 -> 40 (0.6 of whole); level 1 (60/40): 40, 20 -> 26.67 (0.4).
ALONE = TrainerSection(
    tokens_per_unit=128.0,
    seconds_per_phase=2.0,
    whole_device_level=None,
    alone=(
        TrainerAloneRecord(0, "forward", 120, 2.0),
        TrainerAloneRecord(0, "backward", 60, 2.0),
        TrainerAloneRecord(1, "forward", 80, 2.0),
        TrainerAloneRecord(1, "backward", 40, 2.0),
        TrainerAloneRecord(None, "forward", 200, 2.0),
        TrainerAloneRecord(None, "backward", 100, 2.0),
    ),
)
# Beside decode: level 0 30 and 15 units/s -> 20 (0.3 of whole); level 1 20 and 10 -> 13.33 (0.2).
CORUN = (
    LevelTrainerRecord(0, 4, 45, 2.0, (PhaseUnits("backward", 15, 1.0), PhaseUnits("forward", 30, 1.0))),
    LevelTrainerRecord(1, 4, 30, 2.0, (PhaseUnits("backward", 10, 1.0), PhaseUnits("forward", 20, 1.0))),
)
WHOLE_UNITS_PER_S = 2 / (1 / 100 + 1 / 50)


def measured_profile():
    return dataclasses.replace(make_profile(), trainer_alone=ALONE, trainer_records=CORUN)


def test_measured_shares_and_tokens_by_hand():
    model = trainer_model.build(measured_profile())
    assert model.model == trainer_model.MEASURED_MODEL
    assert model.colo_share == pytest.approx((0.3, 0.2, 0.0))
    assert model.idle_share == pytest.approx((0.6, 0.4, 0.0))
    assert model.tokens_per_gpu_s == pytest.approx(WHOLE_UNITS_PER_S * 128)
    assert model.rate_source.startswith("measured: 66.67 units/s alone on the whole device x 128 tokens/unit")
    assert model.to_dict()["model"] == trainer_model.MEASURED_MODEL
    override = trainer_model.build(measured_profile(), 1000.0)
    assert override.tokens_per_gpu_s == 1000.0 and "--trainer-tokens-per-s 1000" in override.rate_source
    assert override.colo_share == model.colo_share  # the override changes the unit, not the shares


def test_a_profile_that_counted_no_unit_alone_on_the_whole_device_falls_back_to_the_sm_share_model():
    """Every measured share is a rate over the whole device's; a profile written before
    the alone window was made to hold a unit may have counted none there."""
    none_alone = dataclasses.replace(ALONE, alone=ALONE.alone[:4] + (TrainerAloneRecord(None, "forward", 0, 2.0),
                                                                     ALONE.alone[5]))
    profile = dataclasses.replace(measured_profile(), trainer_alone=none_alone)
    model = trainer_model.build(profile)
    assert model.model == trainer_model.SM_SHARE_MODEL
    assert model.colo_share == trainer_model.build(dataclasses.replace(profile, trainer_alone=None)).colo_share
    assert model.profile_note.startswith("the profile's trainer section counted no unit alone on the whole device")
    comparison.run(STEADY, profile, model, settings(), 0)  # the replay runs on it


def test_replay_uses_the_measured_rates():
    result = comparison.run(STEADY, measured_profile(), trainer_model.build(measured_profile()), settings(), 0)
    static, separate = result.results["static"], result.results["separate"]
    busy = static.metrics["busy_fraction"]
    assert 0.0 < busy < 1.0
    # Static runs on level 1 (60 % decode): 0.2 of a whole GPU while decode steps, 0.4 in the gaps.
    expected = 0.2 * busy + 0.4 * (1.0 - busy)
    assert static.metrics["finetune_per_gpu"] == pytest.approx(expected, rel=1e-6)
    assert static.metrics["finetune_tokens_per_s_per_gpu"] == pytest.approx(expected * WHOLE_UNITS_PER_S * 128, rel=1e-6)
    # Separate: a whole GPU trains alone at the measured whole-device rate, over two GPUs.
    assert separate.metrics["finetune_tokens_per_s_per_gpu"] == pytest.approx(WHOLE_UNITS_PER_S * 128 / 2)


def test_profiles_without_a_trainer_section_fall_back_to_the_sm_share_model():
    model = trainer_model.build(make_profile())
    assert model.model == trainer_model.SM_SHARE_MODEL and model.tokens_per_gpu_s is None
    assert model.colo_share == pytest.approx((0.6, 0.4, 0.0))


def test_committed_cpu_profile_carries_a_measured_trainer_section():
    from pathlib import Path

    path = Path(__file__).resolve().parents[2] / "profiles" / "cpu-tiny-llama-sglang.json"
    loaded = profile_source.load(path)
    assert loaded.trainer_alone is not None and loaded.trainer_alone.whole_device_level == 0
    model = trainer_model.build(loaded)
    assert model.model == trainer_model.MEASURED_MODEL
    assert model.idle_share == (1.0,)  # the one shared level is the whole device
    assert 0.0 < model.colo_share[0] < 1.0  # decode takes part of the only core's time
    assert model.tokens_per_gpu_s > 0


def test_version_1_profile_loads_for_replay_with_the_fallback(tmp_path):
    data = make_profile_dict()
    data["schema_version"] = 1
    del data["trainer"]
    del data["provenance"]["tp_size"]
    path = tmp_path / "v1.json"
    path.write_text(json.dumps(data))
    loaded = profile_source.load(path)
    assert loaded.trainer_alone is None
    assert trainer_model.build(loaded).model == trainer_model.SM_SHARE_MODEL


def make_profile_dict() -> dict:
    from harvest.replay import synthetic

    return synthetic.harli_a100_llama3_8b().to_dict()


def test_a_share_above_what_the_same_sms_do_alone_is_capped_and_said():
    """Beside decode the trainer cannot outrun itself alone on the same SMs, nor alone on a
    level outrun the whole device: short measurement windows (and, before profiles
    recorded trainer_window_s, co-run windows that left out the host's time between steps)
    read above both. The committed H100/H200 profiles do (up to 1.30 of the whole GPU on
    24 decode SMs); the replay would credit harvest with that much more training."""
    fast_beside = (
        LevelTrainerRecord(0, 4, 180, 2.0, (PhaseUnits("backward", 60, 1.0), PhaseUnits("forward", 120, 1.0))),
        LevelTrainerRecord(1, 4, 30, 2.0, (PhaseUnits("backward", 10, 1.0), PhaseUnits("forward", 20, 1.0))),
    )
    fast_alone = dataclasses.replace(ALONE, alone=(
        TrainerAloneRecord(0, "forward", 240, 2.0), TrainerAloneRecord(0, "backward", 120, 2.0), *ALONE.alone[2:]))
    profile = dataclasses.replace(make_profile(), trainer_alone=fast_alone, trainer_records=fast_beside)
    model = trainer_model.build(profile)
    # level 0: 120 units/s alone is 1.2 of the whole device's 100 -> 1; beside decode 80 -> 1.2 -> 1
    assert model.idle_share == pytest.approx((1.0, 0.4, 0.0))
    assert model.colo_share == pytest.approx((1.0, 0.2, 0.0))
    assert "level 0 alone 1.2 to 1" in model.profile_note and "level 0 beside decode 1.2 to its alone 1" in model.profile_note
    assert "capped" not in trainer_model.build(measured_profile()).profile_note  # nothing to cap: nothing said


def test_committed_gpu_profiles_give_no_share_above_its_bounds():
    from pathlib import Path

    for path in sorted((Path(__file__).resolve().parents[2] / "profiles").glob("*.json")):
        loaded = profile_source.load(path)
        if loaded.trainer_alone is None:
            continue
        model = trainer_model.build(loaded)
        for colo, idle in zip(model.colo_share, model.idle_share):
            assert colo <= idle <= 1.0, (path.name, model.colo_share, model.idle_share)


def test_a_co_run_points_units_are_a_rate_over_the_wall_window_it_counted_them_in(tmp_path):
    """A profile that records trainer_window_s (the timed steps and the host's work between
    them) gives the trainer's rate over it; one that does not, over the steps' summed
    latencies (older profiles)."""
    from harvest.predict.schema import GridPointRecord

    def point(window_s):
        return GridPointRecord(level=0, stage="corun", phase="forward", batch_size=1, context_length=8,
                               sum_context=9.0, latency_s=0.01, step_latencies_s=(0.01,) * 8,
                               step_sum_contexts=(9.0,) * 8, trainer_units=10, trainer_window_s=window_s)

    recorded, older = profile_source._trainer_records((point(0.1),)), profile_source._trainer_records((point(None),))
    assert recorded[0].units_per_s == pytest.approx(100.0) and recorded[0].phases[0].units_per_s == pytest.approx(100.0)
    assert older[0].units_per_s == pytest.approx(125.0)  # 10 units over 8 x 10 ms
