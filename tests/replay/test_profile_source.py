"""Loading profiles for replay: full profiles, profiles without stage 2 (harvest and
static refused, baselines run), damaged files, and the committed-profile choice."""

from __future__ import annotations

import json

import pytest

from harvest.ladder import Ladder
from harvest.predict.latency_model import CoRunCoefficients, SoloCoefficients
from harvest.predict.schema import ProfileError
from harvest.replay import comparison, profile_source, synthetic, trainer_model

from tests.replay.helpers import requests, settings


@pytest.fixture(scope="module")
def a100():
    return synthetic.harli_a100_llama3_8b()


def test_saved_profile_loads_with_its_predictor(tmp_path, a100):
    path = tmp_path / "gpu.json"
    a100.save(path)
    loaded = profile_source.load(path)
    assert loaded.has_stage2 and loaded.stage2_missing is None and loaded.label == "gpu.json"
    assert loaded.synthetic and loaded.ladder.whole_device_index == 5
    assert loaded.predictor.predict_colo(2, 16, 4000.0) == a100.predictor().predict_colo(2, 16, 4000.0)


def test_profile_without_stage2_refuses_harvest_and_static_but_runs_baselines(tmp_path, a100):
    path = tmp_path / "solo-only.json"
    path.write_text(json.dumps(synthetic.without_stage2(a100)))
    loaded = profile_source.load(path)
    assert not loaded.has_stage2 and "no stage-2 (co-run) data" in loaded.stage2_missing
    assert loaded.solo == profile_source.from_profile(a100, "x").solo
    result = comparison.run(requests((0.0, 500, 20), (0.1, 800, 30)), loaded, trainer_model.build(loaded), settings())
    for name in ("harvest", "static"):
        assert result.results[name].refused.startswith(f"{name} needs the co-location (stage-2) model")
        assert "re-run `harvest profile`" in result.results[name].refused
    assert result.results["decode-only"].metrics["requests_finished"] == 2
    assert result.results["separate"].metrics["finetune_per_gpu"] == pytest.approx(0.5)
    assert result.results["separate"].gain_vs == {}  # static refused, nothing to compare with


def test_stage2_set_to_null_is_treated_as_missing(tmp_path, a100):
    data = a100.to_dict()
    data["stage2"] = None
    path = tmp_path / "null.json"
    path.write_text(json.dumps(data))
    assert not profile_source.load(path).has_stage2


@pytest.mark.parametrize(
    "mutate, message",
    [
        (lambda d: d.update(schema="something-else"), "not a harvest latency profile"),
        (lambda d: d.update(schema_version=99), "schema_version=99"),
        (lambda d: d["stage1"].pop(), "stage1"),
        (lambda d: d["stage1"][0].update(b0="fast"), r"stage1\[0\]\.b0"),
        (lambda d: d.pop("ladder"), "ladder"),
    ],
)
def test_damaged_profiles_are_refused_naming_the_field(tmp_path, a100, mutate, message):
    for data in (a100.to_dict(), synthetic.without_stage2(a100)):
        mutate(data)
        path = tmp_path / "bad.json"
        path.write_text(json.dumps(data))
        with pytest.raises(ProfileError, match=message):
            profile_source.load(path)


def test_unreadable_and_non_json_files(tmp_path):
    with pytest.raises(ProfileError, match="cannot read profile"):
        profile_source.load(tmp_path / "absent.json")
    (tmp_path / "x.json").write_text("{not json")
    with pytest.raises(ProfileError, match="x.json: profile is not valid JSON: .* line 1 column 2"):
        profile_source.load(tmp_path / "x.json")


def test_committed_profiles_prefer_measured_gpu_over_cpu_and_skip_bad_files(tmp_path, a100):
    cpu = synthetic.build_profile(Ladder.whole_device(2), [SoloCoefficients(1e-4, 1e-3, 1e-7)], CoRunCoefficients(0.7, 0.7))
    data = cpu.to_dict()
    data["provenance"].update(device_kind="cpu", device_name="a CPU", command_line="harvest profile")
    (tmp_path / "a-cpu.json").write_text(json.dumps(data))
    (tmp_path / "b-broken.json").write_text("[]")
    assert [p.label for p in profile_source.committed_profiles(tmp_path)] == ["a-cpu.json"]
    gpu = a100.to_dict()
    gpu["provenance"].update(device_name="NVIDIA A100", command_line="harvest profile")
    (tmp_path / "z-gpu.json").write_text(json.dumps(gpu))
    a100.save(tmp_path / "c-synthetic.json")
    assert [p.label for p in profile_source.committed_profiles(tmp_path)] == ["z-gpu.json", "a-cpu.json", "c-synthetic.json"]


def test_corun_trainer_units_are_summarised_per_level_and_reported(tmp_path, a100):
    data = a100.to_dict()
    for sample in data["samples"]:
        if sample["stage"] == "corun":
            sample["trainer_units"] = 5
    path = tmp_path / "units.json"
    path.write_text(json.dumps(data))
    loaded = profile_source.load(path)
    assert [r.level for r in loaded.trainer_records] == [0, 1, 2, 3, 4]  # level 5 gives the trainer no SMs
    record = loaded.trainer_records[2]
    points = [s for s in data["samples"] if s["stage"] == "corun" and s["level"] == 2]
    assert record.trainer_units == 5 * len(points) == 5 * 12
    assert record.units_per_s == pytest.approx(5 * 12 / sum(sum(s["step_latencies_s"]) for s in points))
    note = trainer_model.build(loaded).profile_note
    assert "level 2 (54 trainer SMs)" in note and "reported, not used" in note


@pytest.mark.parametrize(
    "mutate, message",
    [
        (lambda d: d["samples"][0].update(latency_s=-1.0), r"profile.samples\[0\]: latency_s=-1.0: latencies must be > 0"),
        (lambda d: d["stage1"][3].update(k0=-1e-7), r"profile.stage1\[3\].k0=-1e-07: seconds per context token must be >= 0"),
        (lambda d: d["stage1"][5].update(c0=-1.0), r"profile.stage1\[5\].c0=-1.0: predicts"),
        (lambda d: d["grid"].update(context_lengths=[]), r"profile.grid: batch_sizes and context_lengths must be non-empty"),
        (lambda d: d["provenance"]["measurement"].update(warmup_steps=-3), r"profile.provenance.measurement: warmup_steps=-3"),
        (lambda d: d.update(trainer={"tokens_per_unit": 0}), r"profile.trainer: missing field\(s\)"),
        (lambda d: d.update(colour="red"), r"profile: unknown field\(s\) colour"),
    ],
)
def test_profile_without_stage2_gets_every_other_check(tmp_path, a100, mutate, message):
    """Before: a profile without stage 2 was read field by field and the rest never checked."""
    data = synthetic.without_stage2(a100)
    mutate(data)
    path = tmp_path / "solo-only.json"
    path.write_text(json.dumps(data))
    with pytest.raises(ProfileError, match=f"solo-only.json: {message}"):
        profile_source.load(path)


def test_stage2_fit_without_co_run_samples_is_refused_not_ignored(tmp_path, a100):
    data = a100.to_dict()
    data["samples"] = [s for s in data["samples"] if s["stage"] == "solo"]
    data["stage2"]["combined"]["k1"] = -5.0  # before, never looked at: the profile loaded as stage-1 only
    path = tmp_path / "fit-no-samples.json"
    path.write_text(json.dumps(data))
    with pytest.raises(ProfileError, match="fit-no-samples.json: profile.samples: no co-run samples"):
        profile_source.load(path)
