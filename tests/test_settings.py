"""harvest.settings: one declaration per setting gives validation of direct construction and
of YAML, error paths from the document root, the YAML form, the schema and CLI flags."""

from __future__ import annotations

import argparse
import dataclasses

import pytest

from harvest.config import HarvestConfig, MemoryConfig
from harvest.train.trainer_cpu import TrainerConfig
from harvest.predict.online import OnlineSettings
from harvest.settings import (FilePath, Integer, ListOf, Number, SettingError, Text, argument, from_mapping, invalid,
                              json_schema, section, setting, setting_of, setting_paths, to_mapping, validate)
from harvest.train.errors import JobError
from harvest.train.job import HarvestOptions


@dataclasses.dataclass(frozen=True)
class Inner:
    RENAMED_SETTINGS = {"old": "size"}

    size: int = setting(4, "how many", Integer(minimum=1))
    share: float | None = setting(None, "a share", Number(minimum=0.0, maximum=1.0, exclusive_maximum=True), words={"auto": None})

    def __post_init__(self) -> None:
        validate(self)


@dataclasses.dataclass(frozen=True)
class Outer:
    inner: Inner = section(Inner, "the inner part")
    names: tuple[str, ...] = setting(("a",), "names", ListOf(Text(r"[a-z]+", "lower-case letters"), non_empty=True))
    limit: float | None = setting(8.0, "a limit", Number(minimum=0.0), nullable=True)

    def __post_init__(self) -> None:
        validate(self)
        if self.limit is not None and self.limit < self.inner.size:
            raise invalid(self, "limit", f"a number >= inner.size={self.inner.size}")


def test_direct_construction_is_validated_and_normalised():
    assert Inner(size=2, share="auto").share is None  # a YAML word is taken in Python too
    assert type(Inner(share=0).share) is float
    assert Outer(names=["x", "y"]).names == ("x", "y")
    with pytest.raises(SettingError, match=r"^Inner\.size=0: expected an integer >= 1; how many \(default 4\)$"):
        Inner(size=0)
    with pytest.raises(SettingError, match=r"^Outer\.inner=\{\}: expected a Inner"):
        Outer(inner={})
    with pytest.raises(SettingError, match=r"^Outer\.names\[1\]='B': expected lower-case letters; names"):
        Outer(names=("a", "B"))


def test_errors_name_the_path_from_the_document_root():
    def message(raw):
        with pytest.raises(SettingError) as info:
            from_mapping(Outer, raw, where="doc: ")
        return str(info.value)

    assert message({"inner": {"size": 0}}).startswith("doc: inner.size=0: expected an integer >= 1; how many")
    assert message({"inner": {"share": None}}).startswith("doc: inner.share=None: expected 'auto' or a finite number in [0.0, 1.0)")
    assert message({"inner": {"size": 3}, "limit": 1}) == "doc: limit=1.0: expected a number >= inner.size=3"
    assert message({"names": []}) == ("doc: names=[]: expected a non-empty list, each lower-case letters; names "
                                      "(default [\"a\"])")
    assert message({"inner": {"old": 3}}) == "doc: inner.old is now inner.size: rename the key (known: size, share)"
    assert message({"inner": {"x": 1, "y": 2}}) == "doc: unknown key(s) inner.x, inner.y (known: size, share)"
    assert message({"inner": []}) == "doc: inner=[]: expected a mapping"
    assert message("text") == "doc: expected a mapping of settings, got str"
    assert from_mapping(Outer, {"inner": None, "limit": None}) == Outer(limit=None)  # an empty section: its defaults


def test_cross_field_error_from_a_nested_section_is_named_by_its_path():
    with pytest.raises(SettingError, match=r"^x: qos\.max_margin=0\.1: expected a number >= initial_margin=0\.2; "):
        from_mapping(HarvestConfig, {"qos": {"initial_margin": 0.2, "max_margin": 0.1}}, where="x: ")
    error = SettingError.bad_value("max_margin", 0.1, "a number >= initial_margin=0.2", "SchedulerConfig.")
    assert str(error.relocated("x: ", "a.b")) == "x: a.b.max_margin=0.1: expected a number >= initial_margin=0.2"


def test_file_paths_resolve_against_the_base_directory(tmp_path):
    (tmp_path / "f.json").write_text("{}")
    kind = FilePath()
    assert kind.convert("f.json", tmp_path) == tmp_path / "f.json"
    assert FilePath(must_exist=False).convert("g.json", tmp_path) == tmp_path / "g.json"


def test_yaml_form_and_schema_come_from_the_declaration():
    assert to_mapping(Outer()) == {"inner": {"size": 4, "share": "auto"}, "names": ["a"], "limit": 8.0}
    schema = json_schema(Outer, title="t", description="d")
    inner = schema["properties"]["inner"]
    assert inner["additionalProperties"] is False and inner["type"] == ["object", "null"]
    assert inner["properties"]["share"] == {"description": "a share", "default": "auto", "anyOf": [
        {"const": "auto"}, {"type": "number", "minimum": 0.0, "exclusiveMaximum": 1.0}]}
    assert schema["properties"]["limit"]["anyOf"][0] == {"type": "null"}
    assert schema["properties"]["names"]["items"]["pattern"] == "^(?:[a-z]+)$"


def test_command_line_flag_takes_default_help_and_bounds_from_the_setting():
    parser = argparse.ArgumentParser(exit_on_error=False)
    parser.add_argument("--trainer-nice", **argument(TrainerConfig, "nice", yaml_path="trainer.nice"))
    assert parser.parse_args([]).trainer_nice == TrainerConfig().nice
    assert parser.parse_args(["--trainer-nice", "7"]).trainer_nice == 7
    for bad in ("20", "x", "1.5"):
        with pytest.raises(argparse.ArgumentError, match=r"expected an integer in \[0, 19\]"):
            parser.parse_args(["--trainer-nice", bad])
    help_text = argument(TrainerConfig, "nice", yaml_path="trainer.nice")["help"]
    assert help_text.startswith(setting_of(TrainerConfig, "nice").description) and "trainer.nice (default 2)" in help_text


def test_job_harvest_section_uses_the_same_mechanism():
    assert HarvestOptions.from_mapping(None) == HarvestOptions()
    assert HarvestOptions.from_mapping({"micro_batch_size": "auto", "window_stages": "all", "memory_budget_mb": None,
                                        "device": "cuda:1"}) == HarvestOptions(device="cuda:1")
    with pytest.raises(JobError, match=r"^harvest\.memory_budget_mb=-1: expected null or a finite number > 0\.0; "):
        HarvestOptions.from_mapping({"memory_budget_mb": -1})
    with pytest.raises(SettingError, match=r"^HarvestOptions\.device='gpu': expected auto, cpu, cuda or cuda:N"):
        HarvestOptions(device="gpu")


def test_sections_validate_their_new_settings():
    with pytest.raises(SettingError, match=r"^MemoryConfig\.lend_interval_s=-1: "):
        MemoryConfig(lend_interval_s=-1)
    with pytest.raises(SettingError, match=r"^OnlineSettings\.refit_min_interval_s=nan: "):
        OnlineSettings(refit_min_interval_s=float("nan"))


def test_every_job_harvest_option_is_reachable_from_yaml():
    written = {"micro_batch_size": 4, "unit_target_ms": 20, "window_stages": 3, "memory_budget_mb": 512,
               "microbatches_per_pass": 2, "device": "cpu", "name": "alpaca-v2", "weight": 3.0,
               "serve_as": "support-bot"}
    fleet = {"rendezvous": "trainer-store.internal:29500", "job_id": "alpaca-fleet", "host_store": "never",
             "min_members": 2, "max_members": 8, "sync": "every_step", "sync_interval_s": 10.0,
             "outer_optimizer": "nesterov", "outer_lr": 0.5, "outer_momentum": 0.8, "heartbeat_s": 2.0,
             "dead_after_s": 20.0, "collective_timeout_s": 30.0}
    assert {path for path, _ in setting_paths(HarvestOptions)} == set(written) | {f"fleet.{k}" for k in fleet}
    options = HarvestOptions.from_mapping({**written, "fleet": fleet})
    for name, value in written.items():
        assert getattr(options, name) == value != getattr(HarvestOptions(), name), name
    for name, value in fleet.items():
        assert getattr(options.fleet, name) == value != getattr(HarvestOptions().fleet, name), name
    defaults = to_mapping(HarvestOptions())
    assert defaults.pop("fleet")["rendezvous"] is None  # not a fleet job unless a rendezvous is named
    assert defaults == {"micro_batch_size": "auto", "unit_target_ms": "auto", "window_stages": "all",
                        "memory_budget_mb": None, "microbatches_per_pass": 1, "device": "auto",
                        "name": None, "weight": 1.0, "serve_as": None}
