"""harvest.yaml validation: defaults, paths, and every bad value named by its field."""

from __future__ import annotations

import pytest

from harvest.config import ConfigError, HarvestConfig, load, parse


def test_empty_document_gives_defaults(tmp_path):
    config = parse(None, base_dir=tmp_path)
    assert config == HarvestConfig()
    assert config.qos.target_tpot_ms == 40.0 and config.ladder is None and config.memory.reserve_tokens is None
    assert config.trainer.cpu_threads == 1 and config.trainer.nice == 2


def test_full_document_and_relative_paths(tmp_path):
    (tmp_path / "jobs").mkdir()
    (tmp_path / "jobs" / "a.yaml").write_text("x: 1\n")
    (tmp_path / "p.json").write_text("{}")
    (tmp_path / "harvest.yaml").write_text(
        "qos: {target_tpot_ms: 25, margin: 0.1}\nprofile: p.json\nallow_profile_mismatch: true\njobs: [jobs/a.yaml]\n"
        "ladder: [64, 132, 96]\ntrainer: {cpu_threads: 3, nice: 0}\nmemory: {reserve_tokens: 2048, hysteresis_chunks: 2, max_lend_fraction: 0.5}\n"
        "metrics: {port: 0}\n"
    )
    config = load(tmp_path / "harvest.yaml")
    assert config.qos.target_tpot_ms == 25 and config.qos.margin == 0.1
    assert config.profile == tmp_path / "p.json" and config.allow_profile_mismatch
    assert config.jobs == (tmp_path / "jobs" / "a.yaml",)
    assert config.ladder == (132, 96, 64)
    assert config.trainer.cpu_threads == 3 and config.trainer.nice == 0
    assert config.memory.reserve_tokens == 2048 and config.memory.max_lend_fraction == 0.5
    assert config.metrics.port == 0
    assert config.source == tmp_path / "harvest.yaml"


@pytest.mark.parametrize(
    "document, message",
    [
        ({"qos": {"target_tpot_ms": 0}}, r"qos.target_tpot_ms=0: expected a number > 0"),
        ({"qos": {"target_tpot_ms": "fast"}}, r"qos.target_tpot_ms='fast': expected a number"),
        ({"qos": {"target_tpot_ms": float("nan")}}, r"qos.target_tpot_ms=nan: expected a number, finite"),
        ({"qos": {"margin": 0.95}}, r"qos.margin=0.95: expected a number <= 0.9"),
        ({"qos": {"tpot": 40}}, r"unknown key\(s\) qos.tpot"),
        ({"qos": 40}, r"qos=40: expected a mapping"),
        ({"ladder": []}, r"ladder=\[\]: expected 'auto' or a non-empty list"),
        ({"ladder": [64, 64]}, r"ladder=\[64, 64\]: expected distinct"),
        ({"ladder": [64, -8]}, r"ladder=\[64, -8\]"),
        ({"memory": {"reserve_tokens": -1}}, r"memory.reserve_tokens=-1: expected an integer >= 0"),
        ({"memory": {"max_lend_fraction": 1.5}}, r"memory.max_lend_fraction=1.5: expected a number <= 1"),
        ({"memory": {"hysteresis_chunks": 1.5}}, r"memory.hysteresis_chunks=1.5: expected an integer"),
        ({"metrics": {"port": 70000}}, r"metrics.port=70000: expected an integer <= 65535"),
        ({"metrics": {"port": True}}, r"metrics.port=True: expected an integer"),
        ({"profile": "missing.json"}, r"profile='missing.json': file not found"),
        ({"jobs": ["nope.yaml"]}, r"jobs\[0\]='nope.yaml': file not found"),
        ({"jobs": {"a": 1}}, r"jobs=\{'a': 1\}: expected a list"),
        ({"trainers": {}}, r"unknown key\(s\) trainers \(known: qos, profile"),
        ({"trainer": {"cpu_threads": 0}}, r"trainer.cpu_threads=0: expected an integer >= 1"),
        ({"trainer": {"cpu_threads": 1.5}}, r"trainer.cpu_threads=1.5: expected an integer"),
        ({"trainer": {"threads": 2}}, r"unknown key\(s\) trainer.threads \(known: cpu_threads, nice\)"),
        ({"trainer": {"nice": -1}}, r"trainer.nice=-1: expected an integer >= 0"),
        ({"trainer": {"nice": 20}}, r"trainer.nice=20: expected an integer <= 19"),
        ({"allow_profile_mismatch": "yes"}, r"allow_profile_mismatch='yes': expected true or false"),
        ({"share_served_weights": 1}, r"share_served_weights=1: expected true or false"),
        ([1, 2], r"the document must be a mapping, got list"),
    ],
)
def test_bad_values_name_the_field(tmp_path, document, message):
    with pytest.raises(ConfigError, match=message):
        parse(document, base_dir=tmp_path)


def test_unreadable_and_invalid_yaml(tmp_path):
    with pytest.raises(ConfigError, match="cannot read"):
        load(tmp_path / "absent.yaml")
    bad = tmp_path / "bad.yaml"
    bad.write_text("qos: [unclosed\n")
    with pytest.raises(ConfigError, match="is not valid YAML"):
        load(bad)


def test_jobs_need_a_profile(tmp_path):
    (tmp_path / "a.yaml").write_text("x: 1\n")
    with pytest.raises(ConfigError, match="profile is required when jobs are given"):
        parse({"jobs": ["a.yaml"]}, base_dir=tmp_path)
