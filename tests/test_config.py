"""harvest.yaml validation: defaults, paths, and every bad value named by its field."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml

from harvest import cli
from harvest.config import ConfigError, HarvestConfig, _yaml_loader, load, parse, schema
from harvest.ladder import GREEN_CONTEXTS, Ladder, Level
from harvest.predict.online import OnlineSettings
from harvest.schedule import QoSController, SchedulerConfig
from harvest.settings import setting_paths, to_mapping


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
        "qos: {target_tpot_ms: 25, initial_margin: 0.1}\nprofile: p.json\nallow_profile_mismatch: true\njobs: [jobs/a.yaml]\n"
        "ladder: [64, 132, 96]\ntrainer: {cpu_threads: 3, nice: 0}\nmemory: {reserve_tokens: 2048, hysteresis_chunks: 2, max_lend_fraction: 0.5}\n"
        "metrics: {port: 0}\n"
    )
    config = load(tmp_path / "harvest.yaml")
    assert config.qos.target_tpot_ms == 25 and config.qos.initial_margin == 0.1
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
        ({"qos": {"target_tpot_ms": 0}}, r"^harvest config: qos\.target_tpot_ms=0: expected a finite number > 0\.0; "
                                         r"per-token latency target of every decode step, in ms \(default 40\.0\)$"),
        ({"qos": {"target_tpot_ms": "fast"}}, r"qos\.target_tpot_ms='fast': expected a finite number > 0\.0; "),
        ({"qos": {"target_tpot_ms": float("nan")}}, r"qos\.target_tpot_ms=nan: expected a finite number > 0\.0; "),
        ({"qos": {"target_tpot_ms": None}}, r"qos\.target_tpot_ms=None: expected a finite number > 0\.0; "),
        ({"qos": {"initial_margin": 1.0}}, r"qos\.initial_margin=1\.0: expected a finite number in \[0\.0, 1\.0\); "),
        ({"qos": {"initial_margin": 0.2, "max_margin": 0.1}},
         r"^harvest config: qos\.max_margin=0\.1: expected a number >= initial_margin=0\.2; raise max_margin or lower"),
        ({"qos": {"backoff_steps": 64, "max_backoff_steps": 32}}, r"qos\.max_backoff_steps=32: expected an integer >= backoff_steps=64"),
        ({"qos": {"hysteresis_gain": 0}}, r"qos\.hysteresis_gain=0: expected null or a finite number in \(0\.0, 1\.0\]; "),
        ({"qos": {"margin": 0.1}}, r"^harvest config: qos\.margin is now qos\.initial_margin: rename the key \(known: target_tpot_ms, "),
        ({"qos": {"tpot": 40}}, r"unknown key\(s\) qos\.tpot \(known: target_tpot_ms, initial_margin, max_margin, "),
        ({"qos": 40}, r"qos=40: expected a mapping"),
        ({"ladder": []}, r"ladder=\[\]: expected 'auto' or a non-empty list of distinct items, each an integer >= 1; "),
        ({"ladder": [64, 64]}, r"ladder=\[64, 64\]: expected 'auto' or a non-empty list of distinct items"),
        ({"ladder": [64, -8]}, r"ladder\[1\]=-8: expected an integer >= 1; decode SM counts"),
        ({"ladder": None}, r"ladder=None: expected 'auto' or a non-empty list"),
        ({"memory": {"reserve_tokens": -1}}, r"memory\.reserve_tokens=-1: expected 'auto' or an integer >= 0; "),
        ({"memory": {"max_lend_fraction": 1.5}}, r"memory\.max_lend_fraction=1\.5: expected a finite number in \[0\.0, 1\.0\]"),
        ({"memory": {"hysteresis_chunks": 1.5}}, r"memory\.hysteresis_chunks=1\.5: expected an integer >= 0"),
        ({"memory": {"lend_interval_s": -0.1}}, r"memory\.lend_interval_s=-0\.1: expected a finite number >= 0\.0; "),
        ({"metrics": {"port": 70000}}, r"metrics\.port=70000: expected a port \(port must be 1-65535, or 0: off\)"),
        ({"metrics": {"port": True}}, r"metrics\.port=True: expected a port \(port must be 1-65535, or 0: off\)"),
        ({"metrics": {"port": "18400"}}, r"metrics\.port='18400': expected a port"),
        ({"metrics": {"host": "gpu1:80"}}, r"metrics\.host='gpu1:80': expected a host name or IP address \(a host "
                                           r"alone, without ':PORT'\)"),
        ({"metrics": {"publish_interval_s": "often"}}, r"metrics\.publish_interval_s='often': expected a finite number >= 0\.0"),
        ({"online": {"window": 4}}, r"online\.window=4: expected an integer >= 8; observations kept per level and stage"),
        ({"online": {"online_share": 1.0}}, r"online\.online_share=1\.0: expected a finite number in \(0\.0, 1\.0\)"),
        ({"online": {"refit_min_interval_s": -1}}, r"online\.refit_min_interval_s=-1: expected a finite number >= 0\.0"),
        ({"online": {"windows": 4}}, r"unknown key\(s\) online\.windows \(known: window, refit_every, "),
        ({"profile": "missing.json"}, r"profile='missing.json': expected an existing file; not found: .*missing\.json; "),
        ({"jobs": ["nope.yaml"]}, r"jobs\[0\]='nope.yaml': expected an existing file; not found: .*nope\.yaml; "),
        ({"jobs": {"a": 1}}, r"jobs=\{'a': 1\}: expected a path string or a list, each a path string"),
        ({"trainers": {}}, r"unknown key\(s\) trainers \(known: qos, profile"),
        ({"trainer": {"cpu_threads": 0}}, r"trainer\.cpu_threads=0: expected an integer in \[1, 1024\]"),
        ({"trainer": {"cpu_threads": 1.5}}, r"trainer\.cpu_threads=1\.5: expected an integer"),
        ({"trainer": {"threads": 2}}, r"unknown key\(s\) trainer\.threads \(known: cpu_threads, nice, compile, unit_step_fraction\)"),
        ({"trainer": {"nice": -1}}, r"trainer\.nice=-1: expected an integer in \[0, 19\]"),
        ({"trainer": {"nice": 20}}, r"trainer\.nice=20: expected an integer in \[0, 19\]"),
        ({"metrics": {"endpoint_nice": -1}}, r"metrics\.endpoint_nice=-1: expected an integer in \[0, 19\]"),
        ({"allow_profile_mismatch": "yes"}, r"allow_profile_mismatch='yes': expected true or false"),
        ({"share_served_weights": 1}, r"share_served_weights=1: expected true or false"),
        ([1, 2], r"^harvest config: expected a mapping of settings, got list$"),
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


def test_a_loaded_files_messages_name_it(tmp_path):
    path = tmp_path / "harvest.yaml"
    path.write_text("qos: {target_tpot_ms: 0}\n")
    with pytest.raises(ConfigError, match=rf"^harvest config {path}: qos\.target_tpot_ms=0: expected a finite number"):
        load(path)
    path.write_text("jobs: [a.yaml]\n")
    (tmp_path / "a.yaml").write_text("x: 1\n")
    with pytest.raises(ConfigError, match=rf"^harvest config {path}: profile=None: expected a calibration profile"):
        load(path)


def test_jobs_need_a_profile(tmp_path):
    (tmp_path / "a.yaml").write_text("x: 1\n")
    with pytest.raises(ConfigError, match=r"^harvest config: profile=None: expected a calibration profile when jobs are "
                                          r"given; run `harvest profile`"):
        parse({"jobs": ["a.yaml"]}, base_dir=tmp_path)


# A value other than the default for every setting of harvest.yaml, as a user would write it.
NON_DEFAULT_YAML = """
qos:
  target_tpot_ms: 25
  initial_margin: 0.1
  max_margin: 0.4
  margin_growth: 0.02
  margin_decay: 1e-4
  hysteresis_steps: 5
  hysteresis_gain: null
  floor_after_paused_steps: null
  floor_margin: 0.05
  backoff_steps: 8
  max_backoff_steps: 64
  ring_size: 16
profile: p.json
allow_profile_mismatch: true
jobs: [jobs/a.yaml]
share_served_weights: false
ladder: [132, 64]
trainer: {cpu_threads: 2, nice: 5, compile: "on", unit_step_fraction: 0.5}
memory: {reserve_tokens: 4096, hysteresis_chunks: 0, max_lend_fraction: 0.5, lend_interval_s: 0.2,
         urgent_reclaim_wait_s: 2.5, integrity_check_interval_s: 30, release_on_pause: false,
         reserve_percentile: 95, reserve_window_s: 120, reserve_lower_after_s: 10, reclaim_ms_per_chunk: 1.5,
         reclaim_ahead: false, lending_thread: true}
metrics: {port: 0, host: 0.0.0.0, publish_interval_s: 2, endpoint_nice: 15, labels: {cluster: eu-1, pool: decode}}
queue: {max_running: 2, quantum_s: 1.5, starvation_s: 10}
online: {window: 64, refit_every: 16, min_observations: 8, drift_threshold: 0.2, online_share: 0.25,
         refit_min_interval_s: 0.5}
"""


def _write_non_default(tmp_path):
    (tmp_path / "jobs").mkdir()
    (tmp_path / "jobs" / "a.yaml").write_text("x: 1\n")
    (tmp_path / "p.json").write_text("{}")
    (tmp_path / "harvest.yaml").write_text(NON_DEFAULT_YAML)
    return tmp_path / "harvest.yaml"


MAPPING_SETTINGS = ("metrics.labels",)  # settings whose value is itself a mapping


def _leaf_paths(document, parent=""):
    for key, value in document.items():
        path = f"{parent}.{key}" if parent else key
        yield from _leaf_paths(value, path) if isinstance(value, dict) and path not in MAPPING_SETTINGS else [path]


def _lookup(obj, dotted):
    for name in dotted.split("."):
        obj = obj[name] if isinstance(obj, dict) else getattr(obj, name)
    return obj


def test_every_setting_is_reachable_from_yaml(tmp_path):
    """Each field of every nested dataclass is set from YAML: the document above names every
    setting path (a new field without a YAML test fails here) and loads to what it says."""
    config = load(_write_non_default(tmp_path))
    document = yaml.safe_load(NON_DEFAULT_YAML)
    document["qos"]["margin_decay"] = 1e-4  # plain YAML 1.1 reads it as a string; harvest's loader does not
    paths = [path for path, _ in setting_paths(HarvestConfig)]
    assert len(paths) == len(set(paths)) > 30
    assert set(_leaf_paths(document)) == set(paths)
    defaults = HarvestConfig()
    for path, spec in setting_paths(HarvestConfig):
        loaded, written = _lookup(config, path), _lookup(document, path)
        assert loaded != _lookup(defaults, path), path
        if path in ("profile", "jobs"):  # relative to the file's directory
            written = str(tmp_path / written) if path == "profile" else [str(tmp_path / j) for j in written]
        elif path == "ladder":
            written = sorted(written, reverse=True)
        assert spec.to_yaml(loaded) == written, path


def test_yaml_form_round_trips(tmp_path):
    config = load(_write_non_default(tmp_path))
    assert parse(to_mapping(config), base_dir=tmp_path, source=config.source) == config
    assert parse(to_mapping(HarvestConfig()), base_dir=tmp_path) == HarvestConfig()
    assert to_mapping(HarvestConfig())["ladder"] == "auto" and to_mapping(HarvestConfig())["memory"]["reserve_tokens"] == "auto"


def test_sections_are_the_policy_objects_themselves(tmp_path):
    config = load(_write_non_default(tmp_path))
    assert isinstance(config.qos, SchedulerConfig) and isinstance(config.online, OnlineSettings)
    # Passed straight through, as the composition root does.
    QoSController(config.qos, Ladder(132, (Level(100, 32), Level(132, 0)), GREEN_CONTEXTS))


def test_every_setting_has_a_one_line_description():
    for path, spec in setting_paths(HarvestConfig):
        description = spec.description
        assert description and "\n" not in description and len(description) < 160, path


def test_schema_file_is_what_the_command_prints(capsys):
    assert cli.main(["config-schema"]) == 0
    printed = capsys.readouterr().out
    assert json.loads(printed) == schema()
    committed = (Path(__file__).resolve().parents[1] / "docs" / "harvest.schema.json").read_text()
    assert committed == printed, "docs/harvest.schema.json is stale: run `harvest config-schema > docs/harvest.schema.json`"


def test_schema_describes_every_setting_with_its_default():
    document = schema()
    assert document["$schema"] == "https://json-schema.org/draft/2020-12/schema"
    for path, spec in setting_paths(HarvestConfig):
        node = document
        for name in path.split("."):
            node = node["properties"][name]
        assert node["description"] == spec.description, path
        assert node["default"] == _lookup(to_mapping(HarvestConfig()), path), path


def test_schema_agrees_with_the_loader(tmp_path):
    jsonschema = pytest.importorskip("jsonschema")
    validator = jsonschema.Draft202012Validator(schema())
    validator.check_schema(schema())
    _write_non_default(tmp_path)
    validator.validate(yaml.load(NON_DEFAULT_YAML, Loader=_yaml_loader()))
    validator.validate(to_mapping(HarvestConfig()))
    validator.validate({"qos": None, "jobs": "a.yaml"})
    for bad in ({"qos": {"margin": 0.1}}, {"trainers": {}}, {"ladder": []}, {"memory": {"reserve_tokens": "some"}},
                {"qos": {"hysteresis_gain": 0}}, {"metrics": {"port": 70000}}):
        assert not validator.is_valid(bad), bad
