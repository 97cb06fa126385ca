"""Profiles: round trip, validation on load, and the running-system mismatch checks."""

from __future__ import annotations

import copy
import dataclasses
import json
import warnings

import pytest

from harvest.predict import compat, strict_json
from harvest.predict.calibrate import build_profile, describe_fit
from harvest.predict.compat import ProfileMismatchError, RuntimeIdentity, check_compatible, load_for, model_config_hash
from harvest.predict.fit import FitError
from harvest.ladder import Ladder, Level
from harvest.predict.schema import SCHEMA_VERSION, Grid, Profile, ProfileError, TrainerAloneRecord, TrainerSection
from tests.predict.synthetic import BUCKETS, H100_LADDER, provenance, records


@pytest.fixture(scope="module")
def profile() -> Profile:
    return build_profile(provenance(), H100_LADDER, BUCKETS, Grid((4, 16, 64), (64, 128, 256, 512)), records(noise=0.01))


def running(profile: Profile, **changes) -> RuntimeIdentity:
    base = dict(
        device_name=profile.provenance.device_name,
        sm_count=132,
        model_config_hash=profile.provenance.model.config_hash,
        model_dtype="bfloat16",
        ladder=H100_LADDER,
    )
    base.update(changes)
    return RuntimeIdentity(**base)


def test_round_trip_is_lossless(profile, tmp_path):
    path = tmp_path / "p.json"
    profile.save(path)
    loaded = Profile.load(path)
    assert loaded == profile
    assert loaded.to_json() == profile.to_json()
    predictor = loaded.predictor()
    assert predictor.predict_colo(1, 16, 4000.0) == profile.predictor().predict_colo(1, 16, 4000.0)
    assert len(loaded.samples) == len(profile.samples) and loaded.samples[0].step_latencies_s == profile.samples[0].step_latencies_s


def test_profile_records_fit_quality_and_range(profile):
    assert len(profile.stage1) == 7 and all(f.quality.mape < 0.02 for f in profile.stage1)
    assert profile.stage2.use_phase_models and set(profile.stage2.by_phase) == {"forward", "backward"}
    assert profile.profiled_range.min_batch_size == 4 and profile.profiled_range.max_batch_size == 64
    text = describe_fit(profile)
    assert "stage 1, level 6 (132/0 SMs)" in text and "stage 2, forward" in text and "per-phase stage-2 models in use" in text


def _data(profile: Profile) -> dict:
    return json.loads(profile.to_json())


def _section(**changes) -> TrainerSection:
    """Alone rates for H100_LADDER: levels 0-5 give the trainer SMs, level 6 none, and
    none gives it all 132, so the whole device is measured outside the ladder."""
    alone = tuple(
        TrainerAloneRecord(level, phase, 10 + (level or 0), 1.0) for level in (0, 1, 2, 3, 4, 5, None) for phase in ("forward", "backward")
    )
    return TrainerSection(**{**dict(tokens_per_unit=64.0, seconds_per_phase=1.0, whole_device_level=None, alone=alone), **changes})


def test_the_trainer_section_round_trips(profile, tmp_path):
    with_trainer = dataclasses.replace(profile, trainer=_section())
    path = tmp_path / "p2.json"
    with_trainer.save(path)
    loaded = Profile.load(path)
    assert loaded == with_trainer and loaded.schema_version == SCHEMA_VERSION == 3
    assert loaded.trainer.records(None)[1].units_per_s == 10.0 and loaded.trainer.tokens_per_unit == 64.0
    assert json.loads(path.read_text())["trainer"]["alone"][0] == {"level": 0, "phase": "forward", "units": 10, "seconds": 1.0}
    assert "trainer alone (64 tokens/unit)" in describe_fit(loaded)


def test_version_1_loads_without_a_trainer_section_and_saves_back_as_version_1(profile, tmp_path):
    data = copy.deepcopy(_data(profile))
    del data["trainer"]
    del data["provenance"]["tp_size"]
    data["schema_version"] = 1
    loaded = _load_dict(data)
    assert loaded.schema_version == 1 and loaded.trainer is None and loaded.provenance.tp_size == 1
    assert loaded.to_dict() == data  # no `trainer` nor `tp_size` key written into a version-1 file
    assert loaded.predictor().predict_colo(1, 16, 4000.0) == profile.predictor().predict_colo(1, 16, 4000.0)


def _at_tp(profile: Profile, tp_size: int) -> Profile:
    return dataclasses.replace(profile, provenance=dataclasses.replace(profile.provenance, tp_size=tp_size))


def test_the_tp_degree_round_trips_in_the_provenance(profile, tmp_path):
    tp2 = _at_tp(profile, 2)
    path = tmp_path / "tp2.json"
    tp2.save(path)
    assert json.loads(path.read_text())["provenance"]["tp_size"] == 2
    loaded = Profile.load(path)
    assert loaded == tp2 and loaded.provenance.tp_size == 2 and loaded.schema_version == 3
    assert profile.provenance.tp_size == 1  # the default: one rank


def test_a_version_2_profile_measured_before_tp_loads_as_tp_1_and_saves_back_as_version_2(profile, tmp_path):
    data = copy.deepcopy(_data(profile))
    del data["provenance"]["tp_size"]
    data["schema_version"] = 2
    path = tmp_path / "v2.json"
    path.write_text(json.dumps(data))
    loaded = Profile.load(path)
    assert loaded.schema_version == 2 and loaded.provenance.tp_size == 1
    assert loaded.to_dict() == data  # written back as read: no `tp_size` in a version-2 file
    with pytest.raises(ProfileError, match=r"provenance.tp_size=2: schema version 2 has no tp_size"):
        _at_tp(loaded, 2)  # it could not say so when saved


@pytest.mark.parametrize(
    "changes, message",
    [
        (dict(whole_device_level=2), r"whole_device_level=2: not a level giving the trainer all 132 SMs"),
        (dict(alone=_section().alone[2:]), r"trainer.alone: expected the same phases on every level"),
        (dict(alone=_section().alone[:-1]), r"trainer.alone: expected the same phases on every level"),
        (dict(alone=_section().alone + (TrainerAloneRecord(6, "forward", 1, 1.0),)), r"alone\[14\].level=6: expected one of"),
        (dict(alone=_section().alone + (TrainerAloneRecord(0, "forward", 1, 1.0),)), r"level 0 phase 'forward' measured twice"),
    ],
)
def test_inconsistent_trainer_sections_are_refused(profile, changes, message):
    data = copy.deepcopy(_data(profile))
    data["trainer"] = strict_json.to_jsonable(_section(**changes))
    with pytest.raises(ProfileError, match=message):
        _load_dict(data)


def test_trainer_section_values_are_checked(profile):
    data = copy.deepcopy(_data(profile))
    data["trainer"] = strict_json.to_jsonable(_section())
    data["trainer"]["alone"][0]["seconds"] = 0
    with pytest.raises(ProfileError, match=r"profile.trainer.alone\[0\]: units=10, seconds=0.0"):
        _load_dict(data)
    data["trainer"] = dict(strict_json.to_jsonable(_section()), tokens_per_unit=-1)
    with pytest.raises(ProfileError, match=r"profile.trainer: tokens_per_unit=-1.0"):
        _load_dict(data)


def _load_dict(data) -> Profile:
    return Profile.from_json(json.dumps(data))


@pytest.mark.parametrize(
    "mutate, message",
    [
        (lambda d: d.update(schema_version=SCHEMA_VERSION + 1), r"schema_version=4: this harvest reads versions 1, 2, 3; re-run `harvest profile`"),
        (lambda d: d.update(schema_version=True), r"schema_version=True: this harvest reads versions"),
        (lambda d: d.update(schema_version=1), r"profile.trainer: not a field of schema version 1"),
        (lambda d: d.update(schema_version=2), r"profile.provenance.tp_size: not a field of schema version 2"),
        (lambda d: d["provenance"].pop("tp_size"), r"profile.provenance: missing field\(s\) tp_size"),
        (lambda d: d["provenance"].update(tp_size=0), r"profile.provenance: tp_size=0: must be >= 1"),
        (lambda d: d["provenance"].update(tp_size=2.0), r"profile.provenance.tp_size: expected an integer"),
        (lambda d: d.pop("trainer"), r"profile: missing field\(s\) trainer"),
        (lambda d: d.update(schema="something-else"), "not a harvest latency profile"),
        (lambda d: d["provenance"].pop("device_name"), r"profile.provenance: missing field\(s\) device_name"),
        (lambda d: d["provenance"].update(colour="red"), r"profile.provenance: unknown field\(s\) colour"),
        (lambda d: d["provenance"].update(sm_count="132"), r"profile.provenance.sm_count: expected an integer"),
        (lambda d: d["stage1"][0].update(b0=None), r"profile.stage1\[0\].b0: expected a finite number"),
        (lambda d: d["stage1"].pop(), "6 entries for a ladder of 7 levels"),
        (lambda d: d["samples"][0].update(level=9), r"samples\[0\].level=9: the ladder has 7 levels"),
        (lambda d: d["samples"][0].update(latency_s=-1.0), "latencies must be > 0"),
        (lambda d: d["samples"][0].update(stage="corun"), "co-run points name a trainer phase"),
        (lambda d: d.update(samples=[s for s in d["samples"] if s["stage"] == "solo"]), "no co-run samples"),
        (lambda d: d.update(samples=[s for s in d["samples"] if s["level"] != 3]), r"no solo samples for level\(s\) \[3\]"),
        (lambda d: d.update(batch_size_buckets=[4, 2]), "strictly increasing"),
        (lambda d: d["ladder"]["levels"].append({"decode_sms": 500, "trainer_sms": 0}), "more SMs than the device's 132"),
        (lambda d: d["stage2"]["combined"]["quality"].update(mape=-0.5), "finite, non-negative errors"),
    ],
)
def test_invalid_profiles_are_refused_naming_the_field(profile, mutate, message):
    data = copy.deepcopy(_data(profile))
    mutate(data)
    with pytest.raises(ProfileError, match=message):
        _load_dict(data)


def test_corrupt_json_and_nan_tokens_are_refused(profile, tmp_path):
    text = profile.to_json()
    bad = tmp_path / "truncated.json"
    bad.write_text(text[: len(text) // 2])
    with pytest.raises(ProfileError, match=r"truncated.json: profile is not valid JSON"):
        Profile.load(bad)
    nan = tmp_path / "nan.json"
    nan.write_text(text.replace('"latency_s": ', '"latency_s": NaN, "x": ', 1))
    with pytest.raises(ProfileError, match=r"nan.json: profile.samples\[0\].latency_s: NaN is not valid JSON"):
        Profile.load(nan)
    with pytest.raises(ProfileError, match="cannot read profile"):
        Profile.load(tmp_path / "missing.json")
    with pytest.raises(ProfileError, match="expected a JSON object"):
        Profile.from_json("[1, 2]")


def test_save_is_atomic_and_refuses_nan(profile, tmp_path):
    path = tmp_path / "p.json"
    profile.save(path)
    before = path.read_text()
    broken = copy.copy(profile)
    object.__setattr__(broken, "stage2", copy.copy(profile.stage2))
    object.__setattr__(broken.stage2, "combined", copy.copy(profile.stage2.combined))
    object.__setattr__(broken.stage2.combined, "b1", float("nan"))
    with pytest.raises(ValueError):
        broken.save(path)
    assert path.read_text() == before
    assert [p.name for p in tmp_path.iterdir()] == ["p.json"]  # no temporary left behind


def test_matching_system_is_accepted(profile, tmp_path):
    path = tmp_path / "p.json"
    profile.save(path)
    assert load_for(path, running(profile)) == profile


@pytest.mark.parametrize(
    "changes, message",
    [
        ({"device_name": "NVIDIA A100-SXM4-80GB"}, "GPU: profile measured on 'NVIDIA H100 80GB HBM3', running on 'NVIDIA A100-SXM4-80GB'"),
        ({"sm_count": 108}, "SM count: profile 132, running device 108"),
        ({"model_config_hash": "ffffffffffffffff"}, "model: profile is for 'llama3-8b'"),
        ({"model_dtype": "float16"}, "model dtype: profile bfloat16, served float16"),
        ({"ladder": Ladder(132, (Level(64, 68), Level(132, 0)), "green-context")}, "SM ladder: profile has green-context ladder"),
        ({"tp_size": 2}, r"TP degree: profile measured at tp=1, running tp=2 \(`harvest profile --tp 2` measures one\)"),
    ],
)
def test_mismatch_is_refused_by_name_and_override_warns(profile, changes, message):
    with pytest.raises(ProfileMismatchError, match=message):
        check_compatible(profile, running(profile, **changes))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        found = check_compatible(profile, running(profile, **changes), allow_mismatch=True)
    assert len(found) == 1 and any("override in effect" in str(w.message) for w in caught)


def test_a_tensor_parallel_profile_matches_only_its_degree(profile):
    tp2 = _at_tp(profile, 2)
    assert compat.mismatches(tp2, running(profile)) == [
        "TP degree: profile measured at tp=2, running tp=1 (`harvest profile --tp 1` measures one)"
    ]  # RuntimeIdentity's tp_size defaults to one rank
    assert compat.mismatches(tp2, running(profile, tp_size=2)) == []


def test_model_config_hash_ignores_paths_and_weights_but_not_shape():
    config = {"architectures": ["LlamaForCausalLM"], "hidden_size": 4096, "num_hidden_layers": 32, "_name_or_path": "/a"}
    moved = dict(config, _name_or_path="/b", transformers_version="9.9")
    deeper = dict(config, num_hidden_layers=33)
    assert model_config_hash(config) == model_config_hash(moved) != model_config_hash(deeper)
    assert len(model_config_hash(config)) == 16 and compat.LATENCY_CONFIG_KEYS


def test_profile_with_too_few_samples_cannot_be_built():
    sparse = [r for r in records(batch_sizes=(4,), context_lengths=(64, 128))]
    with pytest.raises(FitError, match="stage 1, level 0: 2 samples, need at least 3"):
        build_profile(provenance(), H100_LADDER, BUCKETS, Grid((4,), (64, 128)), sparse)


def test_committed_cpu_profile_is_valid_and_matches_the_tiny_model(tiny_llama_path):
    from pathlib import Path

    from harvest.predict.compat import model_config_hash_of_path

    path = Path(__file__).resolve().parents[2] / "profiles" / "cpu-tiny-llama-sglang.json"
    profile = Profile.load(path)
    assert profile.provenance.engine == "sglang" and profile.provenance.device_kind == "cpu"
    assert profile.provenance.model.config_hash == model_config_hash_of_path(tiny_llama_path), (
        "the tiny model changed: re-run the command in profiles/README.md (Committed profiles) "
        "with --out profiles/cpu-tiny-llama-sglang.json"
    )
    assert profile.stage1[0].quality.mape < 0.10  # a sane fit, not a broken measurement
    assert profile.provenance.measurement.torch_threads == 1  # decode on the core the trainer leaves, as the server runs it
    assert profile.trainer is not None and profile.trainer.whole_device_level == 0  # schema 2: measured alone too
    assert all(r.units > 0 for r in profile.trainer.alone)
    # lend/reclaim of the server's chunk (2 layers x K, V x 64 KiB host pages), as `harvest profile` times it
    assert profile.memory is not None and profile.memory.chunk_bytes == 4 * 64 * 1024 and profile.memory.pages_per_chunk == 4


# -- physically impossible coefficients, refused for every user of the profile -------------


@pytest.mark.parametrize(
    "mutate, message",
    [
        (lambda d: d["stage1"][2].update(b0=-1e-5), r"profile.stage1\[2\].b0=-1e-05: seconds per request must be >= 0"),
        (lambda d: d["stage1"][0].update(k0=-1e-9), r"profile.stage1\[0\].k0=-1e-09: seconds per context token must be >= 0"),
        (lambda d: d["stage1"][6].update(c0=-1.0), r"profile.stage1\[6\].c0=-1.0: predicts -1 s for the smallest decode step"),
        (lambda d: d["stage2"]["combined"].update(k1=-0.4), r"profile.stage2.combined.k1=-0.4: must be >= 0"),
        (lambda d: d["stage2"]["combined"].update(b1=-0.1), r"profile.stage2.combined.b1=-0.1: must be >= 0"),
        (lambda d: d["stage2"]["by_phase"]["forward"].update(k1=-2.0), r"profile.stage2.by_phase.forward.k1=-2.0: must be >= 0"),
        (lambda d: d["stage2"]["combined"].update(b1=0.0, k1=0.0), r"profile.stage2.combined: b1=0.0, k1=0.0 give level 0 a co-located latency factor of 0.0"),
    ],
)
def test_physically_impossible_coefficients_are_refused_naming_the_json_path(profile, tmp_path, mutate, message):
    data = copy.deepcopy(_data(profile))
    mutate(data)
    path = tmp_path / "impossible.json"
    path.write_text(json.dumps(data))
    with pytest.raises(ProfileError, match=f"impossible.json: {message}"):
        Profile.load(path)
    # the server's start-up path (compat.load_for) refuses it the same way, before any comparison
    with pytest.raises(ProfileError, match=message):
        load_for(path, running(profile))


def test_a_negative_fitted_intercept_is_allowed_while_every_step_takes_time(profile):
    data = copy.deepcopy(_data(profile))
    data["stage1"][0]["c0"] = -0.5 * (data["stage1"][0]["b0"] * BUCKETS.padded(1) + data["stage1"][0]["k0"])
    assert _load_dict(data).stage1[0].c0 < 0


def test_a_key_given_twice_is_refused_naming_the_object(profile):
    text = profile.to_json().replace('"mape": ', '"mape": 0.0, "mape": ', 1)
    with pytest.raises(ProfileError, match=r"profile.stage1\[0\].quality: names 'mape' twice"):
        Profile.from_json(text)


@pytest.mark.parametrize(
    "path, literal, message",
    [
        (("stage1", 0, "k0"), "NaN", r"profile.stage1\[0\].k0: NaN is not valid JSON"),
        (("stage2", "combined", "b1"), "-Infinity", r"profile.stage2.combined.b1: -Infinity is not valid JSON"),
        (("samples", 3, "latency_s"), "1e309", r"profile.samples\[3\].latency_s: expected a finite number, got inf \(too large for a double\)"),
        (("profiled_range", "max_sum_context"), "1" + "0" * 400, r"profile.profiled_range.max_sum_context: expected a finite number, got an integer of 1329 bits"),
        (("profiled_range", "max_batch_size"), str(2**64), r"profile.profiled_range.max_batch_size: expected an integer within 64 bits"),
        (("samples", 3, "trainer_units"), str(2**70), r"profile.samples\[3\].trainer_units: expected an integer within 64 bits"),
    ],
)
def test_non_finite_and_overflowing_numbers_are_refused_naming_the_json_path(profile, tmp_path, path, literal, message):
    data = copy.deepcopy(_data(profile))
    target = data
    for key in path[:-1]:
        target = target[key]
    target[path[-1]] = "__LITERAL__"
    file = tmp_path / "numbers.json"
    file.write_text(json.dumps(data).replace('"__LITERAL__"', literal))
    with pytest.raises(ProfileError, match=f"numbers.json: {message}"):
        Profile.load(file)


def _first_corun(data: dict) -> dict:
    return next(s for s in data["samples"] if s["stage"] == "corun")


@pytest.mark.parametrize(
    "mutate, message",
    [
        (lambda d: d["provenance"].update(sm_count=0), r"profile.provenance: sm_count=0: must be >= 1"),
        (lambda d: d["provenance"]["measurement"].update(trim_fraction=0.5), r"profile.provenance.measurement: trim_fraction=0.5: must be in \[0, 0.5\)"),
        (lambda d: d["provenance"]["measurement"].update(timed_steps=0), r"profile.provenance.measurement: timed_steps=0: must be >= 1"),
        (lambda d: d["grid"].update(batch_sizes=[4, -16]), r"profile.grid: batch_sizes\[1\]=-16: must be > 0"),
        (lambda d: d["samples"][2].update(sum_context=0), r"profile.samples\[2\]: sum_context=0.0: must be > 0"),
        (lambda d: d["samples"][2]["step_sum_contexts"].__setitem__(1, -3.0), r"profile.samples\[2\]: step_sum_contexts\[1\]=-3.0: must be > 0"),
        (lambda d: _first_corun(d).update(trainer_units=-1), r"profile.samples\[\d+\]: trainer_units=-1: must be >= 0"),
        (lambda d: _first_corun(d).update(context_length=0), r"profile.samples\[\d+\]: context_length=0: must be >= 1"),
        (lambda d: d["batch_size_buckets"].append(10**9), r"profile.batch_size_buckets\[9\]=1000000000: larger than any CUDA-graph capture size"),
        (lambda d: d["samples"].append(dict(_first_corun(d), level=6)), r"profile.samples\[\d+\]: a co-run sample at level 6, where the trainer has no SMs"),
    ],
)
def test_out_of_range_values_are_refused_naming_the_field(profile, mutate, message):
    data = copy.deepcopy(_data(profile))
    mutate(data)
    with pytest.raises(ProfileError, match=message):
        _load_dict(data)


def test_a_whole_device_phase_that_finished_no_unit_is_refused(profile):
    data = copy.deepcopy(_data(profile))
    data["trainer"] = strict_json.to_jsonable(_section())
    index = next(i for i, r in enumerate(data["trainer"]["alone"]) if r["level"] is None and r["phase"] == "backward")
    data["trainer"]["alone"][index]["units"] = 0
    with pytest.raises(ProfileError, match=rf"profile.trainer.alone\[{index}\].units=0: no 'backward' unit finished on the whole device"):
        _load_dict(data)


def test_profile_files_with_a_byte_order_mark_load_and_bad_bytes_are_placed(profile, tmp_path):
    text = profile.to_json()
    bom = tmp_path / "bom.json"
    bom.write_bytes(b"\xef\xbb\xbf" + text.encode())
    assert Profile.load(bom) == profile
    latin = tmp_path / "latin.json"
    latin.write_bytes(text.encode().replace(b'"llama3-8b"', b'"llama3-8b\xe9"', 1))
    line = text[: text.index('"llama3-8b"')].count("\n") + 1
    with pytest.raises(ProfileError, match=rf"latin.json: line {line} column \d+: byte 0xe9 is not UTF-8"):
        Profile.load(latin)
    with pytest.raises(ProfileError, match=rf"cannot read profile {tmp_path}: Is a directory"):
        Profile.load(tmp_path)


def _with_corun_tokens(profile: Profile, tokens) -> Profile:
    finetune = dataclasses.replace(profile.provenance.finetune, micro_batch_tokens=tokens)
    return dataclasses.replace(profile, provenance=dataclasses.replace(profile.provenance, finetune=finetune))


def test_the_co_run_micro_batch_tokens_round_trip_and_a_profile_without_them_reads_none(profile, tmp_path):
    recorded = _with_corun_tokens(profile, 1024.0)
    path = tmp_path / "p.json"
    recorded.save(path)
    assert Profile.load(path) == recorded and _data(recorded)["provenance"]["finetune"]["micro_batch_tokens"] == 1024.0
    # Written before it was recorded: absent, read as None, written back without it.
    assert profile.provenance.finetune.micro_batch_tokens is None
    assert "micro_batch_tokens" not in _data(profile)["provenance"]["finetune"]
    assert Profile.from_json(profile.to_json()) == profile


@pytest.mark.parametrize("value", [0, -5.0])
def test_co_run_micro_batch_tokens_must_be_positive(profile, value):
    data = _data(profile)
    data["provenance"]["finetune"]["micro_batch_tokens"] = value
    with pytest.raises(ProfileError, match=r"micro_batch_tokens=.*must be a finite number > 0"):
        Profile.from_dict(data)


def test_a_co_run_points_trainer_window_round_trips_and_a_profile_without_it_reads_none(profile, tmp_path):
    corun = next(i for i, r in enumerate(profile.samples) if r.stage == "corun")
    samples = list(profile.samples)
    samples[corun] = dataclasses.replace(samples[corun], trainer_window_s=0.25)
    recorded = dataclasses.replace(profile, samples=tuple(samples))
    path = tmp_path / "p.json"
    recorded.save(path)
    assert Profile.load(path) == recorded and _data(recorded)["samples"][corun]["trainer_window_s"] == 0.25
    # Written before it was recorded: absent, read as None, written back without it.
    assert all(r.trainer_window_s is None for r in profile.samples)
    assert all("trainer_window_s" not in sample for sample in _data(profile)["samples"])
    assert Profile.from_json(profile.to_json()) == profile


@pytest.mark.parametrize("value", [0, -0.5])
def test_a_co_run_points_trainer_window_must_be_positive(profile, value):
    data = _data(profile)
    data["samples"][0]["trainer_window_s"] = value
    with pytest.raises(ProfileError, match=r"trainer_window_s=.*must be a finite number of seconds > 0"):
        Profile.from_dict(data)


def test_every_optional_field_reads_absent_as_none_and_writes_none_back_absent(profile):
    """harvest.predict.schema.OPTIONAL_FIELDS: one rule for every optional field, at any
    depth; reading does not change the caller's dict."""
    from harvest.predict import schema

    data = _data(profile)
    for path in schema.OPTIONAL_FIELDS:
        for holder in schema._holders(data, path):
            holder.pop(path[-1], None)
    before = json.dumps(data, sort_keys=True)
    loaded = Profile.from_dict(data)
    assert json.dumps(data, sort_keys=True) == before
    assert loaded.memory is None and loaded.provenance.finetune.micro_batch_tokens is None
    assert all(r.trainer_window_s is None for r in loaded.samples)
    assert json.dumps(loaded.to_dict(), sort_keys=True) == before


@pytest.mark.parametrize("job_tokens, named", [(1024.0, False), (2048.0, False), (512.0, False), (4096.0, True),
                                               (256.0, True)])
def test_a_job_is_named_when_its_micro_batches_differ_from_the_co_run_workloads_more_than_twice(profile, job_tokens,
                                                                                             named):
    problem = compat.corun_units_mismatch(_with_corun_tokens(profile, 1024.0), job_tokens, "job big")
    assert (problem is not None) == named
    if named:
        assert problem.startswith(f"job big's micro-batches carry {job_tokens:.0f} tokens")
        assert "the 1024 the profile's co-run stage ran beside decode (peft-lora)" in problem
        assert "harvest profile --finetune-job" in problem


def test_a_profile_that_does_not_record_its_co_run_units_names_no_job(profile):
    assert compat.corun_units_mismatch(profile, 10**6, "job big") is None
