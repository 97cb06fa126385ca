"""`harvest doctor --profile / --config`: the lend/reclaim costs a profile measured, the
figure a server's auto reserve counts and where it comes from; a profile or config it
cannot read exits 1 naming the file and the field."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from harvest import cli, doctor

CPU_PROFILE = Path(__file__).resolve().parent.parent / "profiles" / "cpu-tiny-llama-sglang.json"
MEASURED = {"chunk_bytes": 4 * 2**20, "lend_ms_per_chunk": 0.5, "reclaim_ms_per_chunk": 0.25, "pages_per_chunk": 64}


@pytest.fixture
def measured_profile(tmp_path):
    path = tmp_path / "measured.json"
    path.write_text(json.dumps({**json.loads(CPU_PROFILE.read_text()), "memory": MEASURED}))
    return path


def _doctor(capsys, *argv):
    code = cli.main(["doctor", *argv])
    out = capsys.readouterr().out
    return code, out


def test_a_measured_profile_shows_its_costs_per_chunk_and_per_page(capsys, measured_profile):
    code, out = _doctor(capsys, "--profile", str(measured_profile))
    assert code == 0
    assert (f"lend/reclaim costs: profile {measured_profile}: a lend 0.5 ms, a reclaim 0.25 ms per chunk of 4 MiB "
            "(64 pages: 7.81 / 3.91 us per page)") in out
    assert "the auto reserve counts 0.25 ms per chunk reclaimed" in out and "WARNING" not in out
    report = doctor.lend_costs(measured_profile)
    assert report["memory"]["reclaim_ms_per_page"] == pytest.approx(0.25 / 64)
    assert report["reserve_counts"]["source"] == "profile" and report["error"] is None


def test_an_older_profile_without_the_section_says_the_default_is_counted(capsys, tmp_path):
    older = tmp_path / "older.json"
    older.write_text(json.dumps({k: v for k, v in json.loads(CPU_PROFILE.read_text()).items() if k != "memory"}))
    code, out = _doctor(capsys, "--profile", str(older))
    assert code == 0
    assert f"profile {older} has no memory section (not measured" in out
    assert "the auto reserve counts 7 ms per chunk reclaimed: the default, 7 ms per chunk" in out
    assert "  WARNING: " in out and "profile.memory.reclaim_ms_per_chunk and lend_ms_per_chunk absent" in out


def test_harvest_yamls_figure_wins_and_its_profile_is_found_through_it(capsys, tmp_path, measured_profile):
    config = tmp_path / "harvest.yaml"
    config.write_text(f"profile: {measured_profile}\nmemory: {{reclaim_ms_per_chunk: 1.5}}\n")
    code, out = _doctor(capsys, "--config", str(config))
    assert code == 0 and f"profile {measured_profile}: a lend 0.5 ms" in out
    assert "counts 1.5 ms per chunk reclaimed: reclaim: harvest.yaml's memory.reclaim_ms_per_chunk" in out
    code, out = _doctor(capsys, "--config", str(config), "--json")
    report = json.loads(out)["lend_costs"]
    assert code == 0 and report["configured_reclaim_ms_per_chunk"] == 1.5 and report["reserve_counts"]["source"] == "configured"


@pytest.mark.parametrize("memory, message", [
    ({**MEASURED, "reclaim_ms_per_chunk": -1.0}, "profile.memory.reclaim_ms_per_chunk=-1.0: must be a finite number of ms >= 0"),
    ({**MEASURED, "lend_ms_per_chunk": "NaN"}, "profile.memory.lend_ms_per_chunk: NaN is not valid JSON"),
    ({**MEASURED, "pages_per_chunk": 3}, "profile.memory.pages_per_chunk=3: must be >= 1 and divide chunk_bytes"),
])
def test_a_damaged_section_exits_1_naming_the_file_and_field(capsys, tmp_path, memory, message):
    path = tmp_path / "bad.json"
    path.write_text(json.dumps({**json.loads(CPU_PROFILE.read_text()), "memory": memory}).replace('"NaN"', "NaN"))
    code, out = _doctor(capsys, "--profile", str(path))
    assert code == 1 and f"lend/reclaim costs: cannot read them: {path}: {message}" in out, out


def test_a_bad_harvest_yaml_figure_exits_1_naming_it(capsys, tmp_path):
    config = tmp_path / "harvest.yaml"
    config.write_text("memory: {reclaim_ms_per_chunk: -3}\n")
    code, out = _doctor(capsys, "--config", str(config))
    assert code == 1 and "memory.reclaim_ms_per_chunk=-3" in out


def test_without_the_flags_the_report_has_no_cost_section():
    assert "lend_costs" not in doctor.collect()
