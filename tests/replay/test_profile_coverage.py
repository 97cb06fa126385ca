"""`harvest replay` says how many decode steps lie outside the profile's measured range:
per policy, the largest in the JSON, on the report's first line, and a warning on stderr
over 5 % (their latencies are the profile's extrapolations)."""

from __future__ import annotations

import json

import pytest

from harvest.cli import main
from harvest.predict.schema import Grid
from harvest.replay import synthetic
from harvest.replay.results import OUTSIDE_PROFILE_WARN_FRACTION, OutsideProfile, PolicyResult, steps_outside_profile
from harvest.replay.trace import SAMPLE_TRACE


def _save(path, grid: Grid):
    base = synthetic.harli_a100_llama3_8b()
    synthetic.build_profile(base.ladder, synthetic.harli_a100_solo(), synthetic.HARLI_A100_CORUN, grid=grid,
                            device_name="synthetic: coverage test").save(path)
    return path


@pytest.fixture(scope="module")
def small_range(tmp_path_factory):
    """Batch sizes 4..64 (Harli's grid): the sample's many steps of 1-3 requests lie outside."""
    return _save(tmp_path_factory.mktemp("profiles") / "small.json", synthetic.HARLI_GRID)


@pytest.fixture(scope="module")
def covering(tmp_path_factory):
    """Batch sizes 1..128 and Σctx 65..128 x 2049: every step of the sample."""
    return _save(tmp_path_factory.mktemp("profiles") / "covering.json", Grid((1, 8, 32, 128), (64, 512, 2048)))


def _replay(capsys, profile, *argv):
    # the reclaim figure given: these profiles have none, and its warning is not what this file tests
    code = main(["replay", "--trace", str(SAMPLE_TRACE), "--profile", str(profile), "--no-plots", "--no-progress",
                 "--memory", "reclaim_ms_per_chunk=7", *argv])
    captured = capsys.readouterr()
    assert code == 0, captured.err
    return captured.out, captured.err


def test_a_small_profiled_range_warns_and_the_first_line_says_so(small_range, capsys):
    out, err = _replay(capsys, small_range)
    first = out.splitlines()[0]
    data_out, _ = _replay(capsys, small_range, "--json")
    data = json.loads(data_out.strip().splitlines()[-1])
    policies = data["runs"][0]["policies"]
    fractions = {name: p["metrics"]["steps_outside_profile_fraction"] for name, p in policies.items()}
    worst = max(fractions, key=fractions.get)
    assert data["steps_outside_profile_fraction"] == fractions[worst] > OUTSIDE_PROFILE_WARN_FRACTION
    assert data["steps_outside_profile_policy"] == worst and data["steps_outside_profile_warning"] is True
    assert data["profile"]["profiled_range"] == {"min_batch_size": 4, "max_batch_size": 64, "min_sum_context": 260.0,
                                                 "max_sum_context": 32832.0}
    share = f"{100 * fractions[worst]:.1f} %"
    assert first.startswith("harvest replay: 300 requests from ")
    assert first.endswith(f"; WARNING: {share} of {worst}'s steps outside the profiled range (over 5 %): their latencies are "
                          "extrapolated")
    assert err.startswith(f"harvest replay: warning: {share} of {worst}'s decode steps lie outside the range small.json measured "
                          "(batch sizes 4..64, Σctx 260..32832 tokens)")
    assert f"harvest profile --grid-from-trace {SAMPLE_TRACE}" in err and len(err.strip().splitlines()) == 1
    assert "  profiled range: batch sizes 4..64, Σctx 260..32832 tokens" in out.splitlines()
    for name, fraction in fractions.items():  # and each policy's, in its summary line
        assert any(line.startswith(f"{name}: ") and f"steps outside the profiled range: {100 * fraction:.1f} %" in line
                   for line in out.splitlines()), name


def test_a_profile_covering_the_trace_does_not_warn(covering, capsys):
    out, err = _replay(capsys, covering)
    assert err == ""
    assert out.splitlines()[0].endswith("; 0.0 % of steps outside the profiled range")
    data = json.loads(_replay(capsys, covering, "--json")[0].strip().splitlines()[-1])
    assert data["steps_outside_profile_fraction"] == 0.0 and data["steps_outside_profile_warning"] is False


def test_a_fleet_reports_its_servers_steps_together(small_range, capsys):
    out, err = _replay(capsys, small_range, "--servers", "2", "--router", "round-robin")
    data = json.loads(_replay(capsys, small_range, "--servers", "2", "--router", "round-robin", "--json")[0].strip().splitlines()[-1])
    policies = data["fleet"]["runs"][0]["routers"]["round-robin"]["policies"]
    fractions = {name: p["metrics"]["steps_outside_profile_fraction"] for name, p in policies.items() if p["refused"] is None}
    worst = max(fractions, key=fractions.get)
    assert data["steps_outside_profile_fraction"] == fractions[worst] > OUTSIDE_PROFILE_WARN_FRACTION
    assert out.splitlines()[0].startswith("harvest replay: a fleet of 2 decode servers, ")
    assert out.splitlines()[0].endswith(f"; WARNING: {100 * fractions[worst]:.1f} % of {worst}'s steps outside the profiled range "
                                        "(over 5 %): their latencies are extrapolated")
    assert err.startswith(f"harvest replay: warning: {100 * fractions[worst]:.1f} % of {worst}'s decode steps")


def _result(name, fraction, refused=None):
    return PolicyResult(name, 1, "", None, refused, {"steps_outside_profile_fraction": fraction})


def test_the_largest_policy_fraction_counts_and_5_percent_is_the_line():
    outside = steps_outside_profile([{"a": _result("a", 0.01), "b": _result("b", 0.3, refused="no")}, {"a": _result("a", 0.04)}])
    assert outside == OutsideProfile(0.04, "a") and not outside.warns
    assert not OutsideProfile(0.05, "a").warns and OutsideProfile(0.0501, "a").warns
    assert steps_outside_profile([{"b": _result("b", 0.3, refused="no")}]) == OutsideProfile(0.0, None)
