"""`harvest replay` end to end: text report, JSON, PNG plots, bad input and the full trace."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from harvest.cli import main
from harvest.replay import synthetic
from harvest.replay.trace import SAMPLE_TRACE

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


@pytest.fixture(scope="module")
def profile_path(tmp_path_factory):
    path = tmp_path_factory.mktemp("profiles") / "a100.json"
    synthetic.harli_a100_llama3_8b().save(path)
    return path


def test_sample_replay_writes_report_json_and_pngs(tmp_path, profile_path, capsys):
    out_dir = tmp_path / "out"
    code = main(["replay", "--trace", str(SAMPLE_TRACE), "--profile", str(profile_path), "--out-dir", str(out_dir), "--no-progress"])
    text = capsys.readouterr().out
    assert code == 0, text
    assert "300 requests" in text and "[SYNTHETIC, not measured]" in text
    for name in ("harvest", "separate", "static", "decode-only"):
        assert any(line.startswith(name) for line in text.splitlines()), name
    assert "whole-GPU trainer equivalents" in text and "per GPU" in text
    for png in ("batch_size.png", "tpot_cdf.png", "sm_split.png"):
        data = (out_dir / png).read_bytes()
        assert data.startswith(PNG_MAGIC) and len(data) > 10_000, png
    saved = json.loads((out_dir / "replay.json").read_text())
    assert saved["runs"][0]["policies"]["harvest"]["metrics"]["requests_finished"] == 300


def test_json_output_and_tokens_per_second(tmp_path, profile_path, capsys):
    code = main([
        "replay", "--trace", str(SAMPLE_TRACE), "--profile", str(profile_path), "--json", "--no-plots",
        "--trainer-tokens-per-s", "2000", "--time-scale", "0.5", "--target-tpot-ms", "35",
    ])
    lines = capsys.readouterr().out.strip().splitlines()
    assert code == 0
    data = json.loads(lines[-1])
    harvest = data["runs"][0]["policies"]["harvest"]
    assert data["settings"]["target_tpot_ms"] == 35.0
    assert harvest["metrics"]["finetune_tokens_per_s"] == pytest.approx(2000 * harvest["metrics"]["finetune_gpu_equivalents"])
    assert data["headline"]["ft_gain_vs_separate"] == harvest["gain_vs"]["separate"]
    assert data["trainer_model"]["rate_source"].startswith("--trainer-tokens-per-s 2000")
    assert data["runs"][0]["policies"]["separate"]["metrics"]["finetune_tokens_per_s_per_gpu"] == pytest.approx(1000)


def test_seeds_with_noise_replay_once_per_seed(profile_path, capsys):
    code = main(["replay", "--trace", str(SAMPLE_TRACE), "--profile", str(profile_path), "--json", "--no-plots",
                 "--seeds", "0,1", "--error-noise", "0.05", "--policies", "harvest,static"])
    data = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert code == 0 and [run["seed"] for run in data["runs"]] == [0, 1]
    assert data["across_seeds"]["ft_gain_vs_static"]["min"] <= data["across_seeds"]["ft_gain_vs_static"]["max"]
    assert set(data["runs"][0]["policies"]) == {"harvest", "static"}


def test_profile_without_stage2_runs_only_the_baselines(tmp_path, capsys):
    path = tmp_path / "solo.json"
    path.write_text(json.dumps(synthetic.without_stage2(synthetic.harli_a100_llama3_8b())))
    code = main(["replay", "--trace", str(SAMPLE_TRACE), "--profile", str(path), "--no-plots", "--max-requests", "50"])
    text = capsys.readouterr().out
    assert code == 0
    rows = {line.split()[0]: line for line in text.splitlines() if line.split() and line.split()[0] in ("harvest", "static", "separate", "decode-only")}
    assert "REFUSED: harvest needs the co-location (stage-2) model" in rows["harvest"]
    assert "REFUSED: static needs" in rows["static"]
    assert "REFUSED" not in rows["separate"] and "REFUSED" not in rows["decode-only"]
    assert "stage 2: MISSING" in text


@pytest.mark.parametrize(
    "body, message",
    [
        ("TIMESTAMP,ContextTokens\n0,1\n", ":1: missing column(s) GeneratedTokens"),
        ("TIMESTAMP,ContextTokens,GeneratedTokens\n0,1,2\n1,x,2\n", ":3: ContextTokens='x' is not an integer"),
        ("TIMESTAMP,ContextTokens,GeneratedTokens\n5,1,2\n4,3,2\n", ":3: TIMESTAMP goes backwards"),
        ("TIMESTAMP,ContextTokens,GeneratedTokens\n-1,1,2\n", ":2: TIMESTAMP='-1' is negative"),
    ],
)
def test_bad_trace_exits_2_naming_the_line(tmp_path, profile_path, capsys, body, message):
    trace = tmp_path / "trace.csv"
    trace.write_text(body)
    code = main(["replay", "--trace", str(trace), "--profile", str(profile_path), "--no-plots"])
    assert code == 2
    err = capsys.readouterr().err
    assert err.startswith("harvest replay: ") and f"{trace}{message}" in err


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--time-scale", "0"], "--time-scale=0.0"),
        (["--policies", "harvest,fifo"], "--policies"),
        (["--scheduler", "hysteresis_steps=0"], "hysteresis_steps"),
        (["--scheduler", "bogus=1"], "unknown key(s) bogus"),
        (["--kv-capacity-tokens", "0"], "--kv-capacity-tokens"),
        (["--error-scale", "-1"], "--error-scale"),
        (["--trainer-tokens-per-s", "0"], "--trainer-tokens-per-s"),
        (["--target-tpot-ms", "0"], "--target-tpot-ms=0.0"),
        (["--policies", "harvest,harvest"], "distinct"),
        (["--profile", "/nonexistent/profile.json"], "cannot read profile"),
        (["--start-s", "99999"], "no request arrives"),
    ],
)
def test_bad_options_exit_2_naming_the_option(profile_path, capsys, argv, message):
    base = ["replay", "--trace", str(SAMPLE_TRACE), "--profile", str(profile_path), "--no-plots"]
    assert main(base + argv) == 2
    assert message in capsys.readouterr().err


def test_command_module_is_cheap_to_import():
    code = "import sys, harvest.cli; harvest.cli.build_parser(); print(sorted(m for m in ('numpy', 'matplotlib', 'torch') if m in sys.modules))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert "matplotlib" not in out.stdout and "torch" not in out.stdout


def test_default_trace_is_the_bundled_sample(profile_path, capsys):
    """No --trace: the sample shipped in the package, whatever lies next to the checkout;
    --help says where the full trace comes from."""
    code = main(["replay", "--profile", str(profile_path), "--json", "--no-plots", "--max-requests", "20",
                 "--policies", "decode-only"])
    data = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert code == 0 and data["trace"] == str(SAMPLE_TRACE)
    with pytest.raises(SystemExit):
        main(["replay", "--help"])
    help_text = " ".join(capsys.readouterr().out.split())
    assert "github.com/Azure/AzurePublicDataset" in help_text and "AzureLLMInferenceTrace_conv.csv" in help_text


@pytest.mark.timeout(120)
def test_full_trace_when_present(full_trace, profile_path, capsys):
    code = main(["replay", "--trace", str(full_trace), "--profile", str(profile_path), "--json", "--no-plots",
                 "--policies", "harvest,separate,static"])
    data = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert code == 0 and data["trace"] == str(full_trace)
    run = data["runs"][0]
    assert run["num_requests"] == 19366 and 3500 < run["horizon_s"] < 3700
    harvest = run["policies"]["harvest"]["metrics"]
    assert harvest["requests_finished"] == 19366 and harvest["violation_rate"] < 0.01
    assert run["wall_s"]["harvest"] < 30  # generous: a slow shared CI core; the benchmark tracks speed
