"""``harvest.yaml``: the co-location configuration, validated once at start-up.

:class:`HarvestConfig` nests one frozen dataclass per section; every setting is declared
once, as a field with its bounds and description (:mod:`harvest.settings`), and all of
them are reachable from the YAML: ``qos`` is the scheduler's :class:`SchedulerConfig`,
``online`` the predictor refiner's :class:`OnlineSettings`, the rest are declared here.
Loading refuses unknown keys, wrong types and out-of-range values with an error naming the
YAML path, the value and what is expected. Relative paths resolve against the YAML file's
directory. Every key is optional: ``harvest config-schema`` prints them all (committed as
``docs/harvest.schema.json``); an example is in README.md, 'Using it on a server'.
"""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path
from typing import Any

from harvest.predict.online import OnlineSettings
from harvest.schedule.scheduler_config import SchedulerConfig
from harvest.schedule.fair_share import JobQueueConfig
from harvest.setting_kinds import LabelSet
from harvest.settings import (Boolean, FilePath, Host, Integer, ListOf, Number, Port, SettingError, from_mapping, invalid,
                              json_schema, section, setting, validate, yaml_problem)
from harvest.train.trainer_cpu import TrainerConfig


DEFAULT_METRICS_PORT = 18400
DEFAULT_ENDPOINT_NICE = 10  # harvest.sglang.control_endpoint.EndpointSettings.nice
# Label names harvest's own series use (and Prometheus's target labels): metrics.labels
# cannot take them.
RESERVED_LABELS = ("model_name", "job", "instance", "job_name", "state", "le", "quantile")


class ConfigError(ValueError):
    """A bad harvest.yaml; the message names the field."""


@dataclasses.dataclass(frozen=True)
class MemoryConfig:
    reserve_tokens: int | None = setting(None, "free KV slots kept mapped for decode; auto: what decode allocated "
                                         "within one reclaim, never below Harli's formula",
                                         Integer(minimum=0), words={"auto": None})
    reserve_percentile: float = setting(99.0, "auto reserve: the percentile of the demand seen that it covers",
                                        Number(minimum=1.0, maximum=100.0))
    reserve_window_s: float = setting(60.0, "auto reserve: how far back allocations count, in seconds",
                                      Number(minimum=1.0))
    reserve_lower_after_s: float = setting(30.0, "auto reserve: how long a lower demand must last before the "
                                           "reserve falls, in seconds (it rises at once)", Number(minimum=0.0))
    reclaim_ms_per_chunk: float | None = setting(None, "the driver's time to reclaim one KV chunk, in ms (the auto "
                                                 "reserve's horizon); auto: the profile's measured figure, else 7 ms "
                                                 "with a warning",
                                                 Number(minimum=0.0), words={"auto": None})
    hysteresis_chunks: int = setting(1, "free slots kept above the reserve, in chunks, before anything is lent "
                                     "(hysteresis)", Integer(minimum=0))
    max_lend_fraction: float = setting(0.8, "never lend more than this share of the KV pool",
                                       Number(minimum=0.0, maximum=1.0))
    reclaim_ahead: bool = setting(True, "keep free, beside the reserve, what SGLang's admission sets aside for its "
                                  "running requests' decode (false: the reserve alone)", Boolean())
    lending_thread: bool | None = setting(None, "lend and reclaim KV chunks on a thread of their own, not SGLang's "
                                          "scheduler thread; auto: on a GPU, one rank",
                                          Boolean(), words={"auto": None})
    lend_interval_s: float = setting(0.05, "least time between two lending passes, in seconds (a busy server lends too)",
                                     Number(minimum=0.0))
    urgent_reclaim_wait_s: float = setting(10.0, "longest wait for the trainer to let go of lent memory an allocation "
                                           "needs, in seconds (only a hung trainer takes this long)",
                                           Number(minimum=0.0))
    integrity_check_interval_s: float = setting(5.0, "least time between two idle checks that SGLang's free lists and "
                                                "the lent chunks agree, in seconds", Number(minimum=0.0))
    release_on_pause: bool = setting(True, "an operator's pause gives the lent KV memory back to decode at once "
                                     "(false: the paused trainer keeps it)", Boolean())

    def __post_init__(self) -> None:
        validate(self)


@dataclasses.dataclass(frozen=True)
class MetricsConfig:
    # 18400: outside Prometheus's exporter range 9100-9999 (fully allocated; NVIDIA's
    # dcgm-exporter, often on the same GPU servers, has 9400), SGLang's 30000 and the
    # ports SGLang derives from its own, and the kernel's ephemeral range (32768-).
    port: int = setting(DEFAULT_METRICS_PORT, "port of harvest's /metrics and control endpoints (0: off); per "
                        "instance: --harvest-metrics-port or HARVEST_METRICS_PORT", Port(zero="off"))
    host: str | None = setting(None, "address harvest's endpoints listen on (0.0.0.0: every interface); null: SGLang's "
                               "--host; per instance: --harvest-metrics-host or HARVEST_METRICS_HOST",
                               Host(), nullable=True)
    publish_interval_s: float = setting(0.5, "least time between two metric updates while idle, in seconds",
                                        Number(minimum=0.0))
    # A nice value, not Linux's SCHED_IDLE: SCHED_IDLE's weight (3 against a nice-0
    # thread's 1024; nice 10: 110) starved the endpoint while decode and the trainer kept
    # the cores busy, which is when /metrics and /harvest/status are needed
    # (harvest.sglang.endpoint_server._lower_priority).
    endpoint_nice: int = setting(DEFAULT_ENDPOINT_NICE, "nice increment of harvest's endpoint process: decode and "
                                 "the trainer win a contended core, the endpoint still gets a share (0: the server's)",
                                 Integer(minimum=0, maximum=19))
    # SGLang's metrics carry model_name (and --tokenizer-metrics-custom-labels for its own
    # request labels); harvest's carry model_name plus these on every series, so one
    # dashboard selects a fleet's servers by any of them.
    labels: tuple = setting((), "extra labels on every harvest series, e.g. {cluster: eu-1, pool: decode} "
                            "(model_name is always there)", LabelSet(reserved=RESERVED_LABELS))

    def __post_init__(self) -> None:
        validate(self)


@dataclasses.dataclass(frozen=True)
class HarvestConfig:
    qos: SchedulerConfig = section(SchedulerConfig, "the QoS scheduler: the per-token target and how decisions keep it")
    profile: Path | None = setting(None, "calibration profile from `harvest profile` for this GPU and model; "
                                   "required with jobs", FilePath(), nullable=True)
    allow_profile_mismatch: bool = setting(False, "use a profile of another GPU, model or ladder (warns)", Boolean())
    jobs: tuple[Path, ...] = setting((), "LlamaFactory job files (with a `harvest:` section); up to queue.max_running "
                                     "share the trainer, the rest wait in order", ListOf(FilePath(), one_as_list=True))
    queue: JobQueueConfig = section(JobQueueConfig, "the server's job queue: how many jobs share the trainer and "
                                    "how its time is shared (fair share by job weight)")
    share_served_weights: bool = setting(True, "a job whose base model is the served checkpoint trains on its "
                                         "weights in place", Boolean())
    ladder: tuple[int, ...] | None = setting(None, "decode SM counts of the ladder levels; auto: planned from the device",
                                             ListOf(Integer(minimum=1), non_empty=True, distinct=True, descending=True),
                                             words={"auto": None})
    trainer: TrainerConfig = section(TrainerConfig, "the trainer: its thread's share of the CPU, compiled layer units")
    memory: MemoryConfig = section(MemoryConfig, "lending free KV chunks to the trainer")
    metrics: MetricsConfig = section(MetricsConfig, "harvest's metrics and control endpoints")
    online: OnlineSettings = section(OnlineSettings, "online refinement of the latency predictor from measured steps")
    source: Path | None = None  # the file it was loaded from (not a setting)

    def __post_init__(self) -> None:
        validate(self)
        if self.jobs and self.profile is None:
            raise invalid(self, "profile", "a calibration profile when jobs are given; run `harvest profile` for "
                          "this GPU and model")


def where(source: Path | None) -> str:
    """The start of every message about a config: which harvest.yaml (when it came from a file)."""
    return "harvest config: " if source is None else f"harvest config {source}: "


def parse(raw: Any, *, base_dir: Path, source: Path | None = None) -> HarvestConfig:
    """Validate a parsed YAML document into a HarvestConfig; errors name ``source``."""
    try:
        return from_mapping(HarvestConfig, raw, where=where(source), base_dir=base_dir, extra={"source": source})
    except SettingError as error:
        raise ConfigError(str(error)) from None


def load(path: str | Path) -> HarvestConfig:
    import yaml

    path = Path(path).expanduser().resolve()
    try:
        text = path.read_text()
    except OSError as exc:
        raise ConfigError(f"harvest config: cannot read {path}: {exc.strerror or exc}") from None
    try:
        raw = yaml.load(text, Loader=_yaml_loader())
    except yaml.YAMLError as exc:
        raise ConfigError(f"harvest config: {path} is not valid YAML: {yaml_problem(exc)}") from None
    return parse(raw, base_dir=path.parent, source=path)


def schema() -> dict[str, Any]:
    """The JSON Schema (draft 2020-12) of harvest.yaml."""
    return json_schema(HarvestConfig, title="harvest.yaml",
                       description="harvest's co-location configuration (`--harvest-config`); every key is optional")


def _yaml_loader():
    """PyYAML's safe loader reading floats as YAML 1.2 does: plain PyYAML (YAML 1.1) reads
    ``2e-4`` (no dot) as a string, which a number setting such as ``qos.margin_decay``
    would then refuse."""
    import yaml

    class Loader(yaml.SafeLoader):
        pass

    # Tried after PyYAML's own int and float patterns: only an exponent without a dot is new.
    exponent_without_dot = re.compile(r"^[-+]?[0-9][0-9_]*[eE][-+]?[0-9]+$")
    Loader.add_implicit_resolver("tag:yaml.org,2002:float", exponent_without_dot, list("-+0123456789"))
    return Loader
