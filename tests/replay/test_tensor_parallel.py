"""A decode instance of tensor-parallel degree N: the replay takes only a profile measured
at N, and counts N GPUs per instance (2N for SeparateMode), so per-GPU figures are those
of one rank and per-instance figures N times them."""

from __future__ import annotations

import json

import pytest

from harvest.cli import main
from harvest.replay import comparison, synthetic, trainer_model
from harvest.replay.trace import SAMPLE_TRACE

from tests.replay.helpers import make_profile, requests, settings

STEADY = requests(*[(0.05 * i, 200, 40) for i in range(40)])
PER_GPU_KEYS = ("finetune_per_gpu", "tpot_p50_ms", "tpot_p99_ms", "violation_rate", "decode_steps")


def _replay(profile, **kwargs):
    return comparison.run(STEADY, profile, trainer_model.build(profile, 1000.0), settings(**kwargs))


def test_an_instance_of_tp_2_counts_2_gpus_and_separate_4_with_the_same_per_gpu_figures():
    one, two = _replay(make_profile()), _replay(make_profile(tp_size=2))
    assert {n: r.num_gpus for n, r in two.results.items()} == {"harvest": 2, "separate": 4, "static": 2, "decode-only": 2}
    for name in ("harvest", "separate", "static", "decode-only"):
        per_rank, per_instance = one.results[name].metrics, two.results[name].metrics
        for key in PER_GPU_KEYS:
            assert per_instance[key] == pytest.approx(per_rank[key]), (name, key)
        # Per instance: both ranks train as rank 0 does, and separate trains on 2 GPUs alone.
        assert per_instance["finetune_gpu_equivalents"] == pytest.approx(2 * per_rank["finetune_gpu_equivalents"])
        assert per_instance["finetune_tokens_per_s"] == pytest.approx(2 * per_rank["finetune_tokens_per_s"])
        assert per_instance["finetune_tokens_per_s_per_gpu"] == pytest.approx(per_rank["finetune_tokens_per_s_per_gpu"])
        assert two.results[name].gain_vs == pytest.approx(one.results[name].gain_vs)
    separate = two.results["separate"].metrics
    assert separate["finetune_gpu_equivalents"] == pytest.approx(2.0) and separate["finetune_per_gpu"] == pytest.approx(0.5)
    static = two.results["static"].metrics
    assert static["finetune_gpu_equivalents"] == pytest.approx(2 * 0.4) and static["finetune_per_gpu"] == pytest.approx(0.4)


def test_a_profile_of_another_tp_degree_is_refused_naming_both():
    with pytest.raises(ValueError, match=r"--tp 1: test-profile was measured at tp=2 \(provenance.tp_size\).*--tp 2"):
        _replay(make_profile(tp_size=2), tp_size=1)
    with pytest.raises(ValueError, match=r"--tp 4: test-profile was measured at tp=1.*`harvest profile --tp 4`"):
        _replay(make_profile(), tp_size=4)
    assert _replay(make_profile(tp_size=2), tp_size=2).results["harvest"].num_gpus == 2
    with pytest.raises(ValueError, match=r"--tp=0: must be an integer >= 1"):
        settings(tp_size=0).check()


def test_a_refused_policy_still_counts_the_instances_gpus(tmp_path):
    from harvest.replay import profile_source

    path = tmp_path / "tp2-solo.json"
    path.write_text(json.dumps(synthetic.without_stage2(synthetic.build_profile(
        synthetic.A100_LADDER, synthetic.harli_a100_solo(), synthetic.HARLI_A100_CORUN, tp_size=2))))
    loaded = profile_source.load(path)
    assert loaded.tp_size == 2
    result = comparison.run(STEADY, loaded, trainer_model.build(loaded), settings())
    assert result.results["harvest"].refused is not None and result.results["harvest"].num_gpus == 2
    assert result.results["separate"].num_gpus == 4


@pytest.fixture(scope="module")
def tp2_profile_path(tmp_path_factory):
    path = tmp_path_factory.mktemp("profiles") / "a100-tp2.json"
    synthetic.build_profile(synthetic.A100_LADDER, synthetic.harli_a100_solo(), synthetic.HARLI_A100_CORUN,
                            model_name="llama3-8b (synthetic)", tp_size=2).save(path)
    return path


def test_replay_json_and_report_carry_the_tp_degree(tp2_profile_path, capsys):
    base = ["replay", "--trace", str(SAMPLE_TRACE), "--profile", str(tp2_profile_path), "--no-plots", "--max-requests", "60"]
    assert main(base + ["--json"]) == 0
    data = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert data["tp_size"] == 2 and "tp=2 (2 GPUs" in data["normalisation"]
    policies = data["runs"][0]["policies"]
    assert policies["separate"]["num_gpus"] == 4 and policies["harvest"]["num_gpus"] == 2
    harvest = policies["harvest"]["metrics"]
    assert harvest["finetune_per_gpu"] == pytest.approx(harvest["finetune_gpu_equivalents"] / 2)
    assert main(base + ["--tp", "2"]) == 0  # the profile's own degree, named explicitly
    text = capsys.readouterr().out
    assert "decode instance: tp=2 (2 GPUs)" in text and "x 2 (tensor parallel)" in text
    assert "separate uses 4 GPUs (2 decoding alone + 2 training alone = 2.0)" in text


def test_replay_of_one_rank_says_tp_1(capsys):
    code = main(["replay", "--trace", str(SAMPLE_TRACE), "--profile", "synthetic-a100", "--no-plots", "--json", "--max-requests", "20"])
    assert code == 0 and json.loads(capsys.readouterr().out.strip().splitlines()[-1])["tp_size"] == 1


@pytest.mark.parametrize(
    "profile, tp, message",
    [
        ("tp2", "1", "--tp 1: a100-tp2.json was measured at tp=2 (provenance.tp_size)"),
        ("synthetic-a100", "2", "--tp 2: synthetic-a100 was measured at tp=1 (provenance.tp_size)"),
        ("tp2", "0", "--tp=0: must be an integer >= 1"),
    ],
)
def test_the_command_refuses_another_tp_degree_naming_both(tp2_profile_path, capsys, profile, tp, message):
    spec = str(tp2_profile_path) if profile == "tp2" else profile
    assert main(["replay", "--trace", str(SAMPLE_TRACE), "--profile", spec, "--no-plots", "--tp", tp]) == 2
    err = capsys.readouterr().err
    assert err.startswith("harvest replay: ") and message in err
