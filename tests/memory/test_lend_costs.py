"""What a lend and a reclaim of one KV chunk cost (harvest.memory.lend_costs): an explicit
figure first, then the profile's measured section scaled to the pool's chunk, then the
stated default with one warning; bad figures refused naming the field."""

from __future__ import annotations

import math

import pytest

from harvest.memory import lend_costs
from harvest.predict.schema import MemorySection

MIB = 2**20


def test_the_profiles_figures_are_scaled_to_the_pools_chunk():
    costs = lend_costs.resolve(256 * MIB, measured=MemorySection(128 * MIB, 5.0, 6.0), measured_where="profile p.json")
    assert (costs.lend_ms_per_chunk, costs.reclaim_ms_per_chunk) == (10.0, 12.0)
    assert costs.source == lend_costs.MEASURED and costs.warning is None
    assert costs.detail == "profile p.json's memory section, measured for a 128 MiB chunk, scaled to 256 MiB"
    same = lend_costs.resolve(128 * MIB, measured=MemorySection(128 * MIB, 5.0, 6.0))
    assert same.reclaim_ms_per_chunk == 6.0 and "scaled" not in same.detail


def test_an_explicit_reclaim_figure_wins_and_the_lend_figure_still_comes_from_the_profile():
    costs = lend_costs.resolve(64 * MIB, measured=MemorySection(128 * MIB, 5.0, 6.0), configured_reclaim_ms=1.5)
    assert (costs.lend_ms_per_chunk, costs.reclaim_ms_per_chunk) == (2.5, 1.5)
    assert costs.source == lend_costs.CONFIGURED and costs.label == "memory.reclaim_ms_per_chunk"
    assert costs.warning is None and costs.detail.startswith("reclaim: memory.reclaim_ms_per_chunk; lend: the profile's")
    # no profile figures: the lend falls back to the default, and nothing warns (a figure was given)
    given = lend_costs.resolve(64 * MIB, configured_reclaim_ms=0.0)
    assert (given.lend_ms_per_chunk, given.reclaim_ms_per_chunk, given.warning) == (7.0, 0.0, None)


def test_without_any_figure_the_stated_default_is_used_with_one_warning_naming_it():
    server = lend_costs.resolve(2 * MIB, measured_where="profile old.json")
    assert (server.lend_ms_per_chunk, server.reclaim_ms_per_chunk) == (7.0, 7.0)  # per chunk, whatever its size
    assert server.source == lend_costs.DEFAULT and server.label == "the default"
    assert server.warning.startswith("profile old.json has no lend/reclaim figures (profile.memory.reclaim_ms_per_chunk")
    assert "the default 7 ms per chunk" in server.warning and "harvest profile" in server.warning
    no_profile = lend_costs.resolve(2 * MIB, measured_where=None)
    assert no_profile.warning.startswith("no profile, so no measured lend/reclaim figures")
    replay = lend_costs.resolve(64 * MIB, default_chunk_bytes=128 * MIB)  # the replay: 7 ms per 128 MiB, scaled
    assert replay.reclaim_ms_per_chunk == 3.5 and "7 ms per 128 MiB chunk" in replay.warning


@pytest.mark.parametrize("bad", [-1.0, math.nan, math.inf, "7", True])
def test_a_negative_or_non_finite_figure_is_refused_naming_the_field(bad):
    with pytest.raises(ValueError, match=r"^harvest.yaml's memory.reclaim_ms_per_chunk=.*must be a finite number of ms >= 0"):
        lend_costs.resolve(MIB, configured_reclaim_ms=bad, configured_where="harvest.yaml's memory.reclaim_ms_per_chunk")

    class Section:  # a section built around MemorySection's own check
        chunk_bytes, lend_ms_per_chunk, reclaim_ms_per_chunk = MIB, 1.0, bad

    with pytest.raises(ValueError, match=r"^profile p.json: profile.memory.reclaim_ms_per_chunk="):
        lend_costs.resolve(MIB, measured=Section(), measured_where="profile p.json")


def test_a_bad_chunk_size_is_refused():
    with pytest.raises(ValueError, match="chunk_bytes=0"):
        lend_costs.resolve(0)

    class Section:
        chunk_bytes, lend_ms_per_chunk, reclaim_ms_per_chunk = 0, 1.0, 1.0

    with pytest.raises(ValueError, match=r"profile.memory.chunk_bytes=0"):
        lend_costs.resolve(MIB, measured=Section())


@pytest.mark.parametrize("text", ["-1", ".nan", ".inf", "-.inf", "fast"])
def test_harvest_yaml_refuses_a_bad_reclaim_figure_naming_it(tmp_path, text):
    from harvest.config import ConfigError, load

    path = tmp_path / "harvest.yaml"
    path.write_text(f"memory: {{reclaim_ms_per_chunk: {text}}}\n")
    with pytest.raises(ConfigError, match=r"memory.reclaim_ms_per_chunk=.*expected 'auto' or a finite number >= 0"):
        load(path)


def test_harvest_yaml_reclaim_figure_is_auto_unless_given(tmp_path):
    from harvest.config import load

    path = tmp_path / "harvest.yaml"
    path.write_text("memory: {reclaim_ms_per_chunk: auto}\n")
    assert load(path).memory.reclaim_ms_per_chunk is None
    path.write_text("memory: {reclaim_ms_per_chunk: 0.4}\n")
    assert load(path).memory.reclaim_ms_per_chunk == 0.4
