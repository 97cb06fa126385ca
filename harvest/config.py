"""``harvest.yaml``: the co-location configuration, validated once at start-up.

Every section is a frozen dataclass. Loading rejects unknown keys (a typo must not be
silently ignored), wrong types and out-of-range values with an error naming the field
path, the value and what is expected. Relative paths resolve against the YAML file's
directory, so a config and its job files can move together.

Example::

    qos:
      target_tpot_ms: 40        # per-token latency target of every decode step
    profile: profiles/h100-llama3-8b.json   # `harvest profile` output; required with jobs
    allow_profile_mismatch: false           # true: use a profile of another GPU/model (warns)
    jobs: [jobs/alpaca-lora.yaml]           # LlamaFactory-style job files, run in order
    share_served_weights: true  # a job whose base is the served checkpoint uses its weights in place
    ladder: auto                # or a list of decode SM counts, e.g. [132, 96, 64, 32]
    trainer:
      cpu_threads: 1            # torch CPU threads of the trainer's thread (on a CPU, decode keeps the other cores)
      nice: 2                   # the trainer thread's nice increment: decode wins a contended core
    memory:
      reserve_tokens: auto      # free KV slots kept mapped; auto = Harli's formula
      hysteresis_chunks: 1      # lend only this many chunks above the reserve
      max_lend_fraction: 0.8    # never lend more than this share of the KV pool
    metrics:
      port: 9400                # harvest's /metrics and control endpoints; 0 = off
"""

from __future__ import annotations

import dataclasses
import math
from pathlib import Path
from typing import Any

from harvest.train.trainer_cpu import DEFAULT_TRAINER_CPU_THREADS, DEFAULT_TRAINER_NICE, MAX_NICE


class ConfigError(ValueError):
    """A bad harvest.yaml; the message names the field."""


@dataclasses.dataclass(frozen=True)
class QosConfig:
    target_tpot_ms: float = 40.0
    margin: float = 0.05  # initial safety margin: decisions aim under target x (1 - margin)


@dataclasses.dataclass(frozen=True)
class TrainerConfig:
    cpu_threads: int = DEFAULT_TRAINER_CPU_THREADS
    nice: int = DEFAULT_TRAINER_NICE


@dataclasses.dataclass(frozen=True)
class MemoryConfig:
    reserve_tokens: int | None = None  # None: Harli's reserve formula (harvest.memory)
    hysteresis_chunks: int = 1
    max_lend_fraction: float = 0.8


@dataclasses.dataclass(frozen=True)
class MetricsConfig:
    port: int = 9400


@dataclasses.dataclass(frozen=True)
class HarvestConfig:
    qos: QosConfig = QosConfig()
    profile: Path | None = None
    allow_profile_mismatch: bool = False
    jobs: tuple[Path, ...] = ()
    share_served_weights: bool = True
    ladder: tuple[int, ...] | None = None  # None: planned from the device ("auto")
    trainer: TrainerConfig = TrainerConfig()
    memory: MemoryConfig = MemoryConfig()
    metrics: MetricsConfig = MetricsConfig()
    source: Path | None = None  # the file it was loaded from


def _fail(field: str, value: Any, expected: str) -> ConfigError:
    return ConfigError(f"harvest config: {field}={value!r}: expected {expected}")


def _number(section: dict, key: str, path: str, default, *, low=None, high=None, integer=False, low_open=False):
    value = section.pop(key, default)
    kind = "an integer" if integer else "a number"
    if isinstance(value, bool) or not isinstance(value, (int, float)) or (integer and not isinstance(value, int)):
        raise _fail(f"{path}.{key}", value, kind)
    if not math.isfinite(value):
        raise _fail(f"{path}.{key}", value, f"{kind}, finite")
    if low is not None and (value <= low if low_open else value < low):
        raise _fail(f"{path}.{key}", value, f"{kind} {'>' if low_open else '>='} {low}")
    if high is not None and value > high:
        raise _fail(f"{path}.{key}", value, f"{kind} <= {high}")
    return value


def _section(raw: dict, key: str) -> dict:
    value = raw.pop(key, None)
    if value is None:
        return {}
    if not isinstance(value, dict):
        raise _fail(key, value, "a mapping")
    return dict(value)


def _no_leftovers(section: dict, path: str, known: tuple[str, ...]) -> None:
    if section:
        unknown = ", ".join(sorted(map(str, section)))
        where = f"{path}." if path else ""
        raise ConfigError(f"harvest config: unknown key(s) {where}{unknown} (known: {', '.join(known)})")


def _path(value: Any, field: str, base: Path, must_exist: bool) -> Path:
    if not isinstance(value, str) or not value:
        raise _fail(field, value, "a path string")
    path = Path(value).expanduser()
    path = path if path.is_absolute() else base / path
    if must_exist and not path.exists():
        raise ConfigError(f"harvest config: {field}={value!r}: file not found ({path})")
    return path


def parse(raw: Any, *, base_dir: Path, source: Path | None = None) -> HarvestConfig:
    """Validate a parsed YAML document into a HarvestConfig."""
    if raw is None:
        raw = {}
    if not isinstance(raw, dict):
        raise ConfigError(f"harvest config: the document must be a mapping, got {type(raw).__name__}")
    raw = dict(raw)

    qos_raw = _section(raw, "qos")
    qos = QosConfig(
        target_tpot_ms=_number(qos_raw, "target_tpot_ms", "qos", 40.0, low=0, low_open=True),
        margin=_number(qos_raw, "margin", "qos", 0.05, low=0, high=0.9),
    )
    _no_leftovers(qos_raw, "qos", ("target_tpot_ms", "margin"))

    profile_raw = raw.pop("profile", None)
    profile = None if profile_raw is None else _path(profile_raw, "profile", base_dir, must_exist=True)

    allow_mismatch = raw.pop("allow_profile_mismatch", False)
    if not isinstance(allow_mismatch, bool):
        raise _fail("allow_profile_mismatch", allow_mismatch, "true or false")

    jobs_raw = raw.pop("jobs", [])
    if isinstance(jobs_raw, str):
        jobs_raw = [jobs_raw]
    if not isinstance(jobs_raw, list):
        raise _fail("jobs", jobs_raw, "a list of job file paths")
    jobs = tuple(_path(j, f"jobs[{i}]", base_dir, must_exist=True) for i, j in enumerate(jobs_raw))
    if jobs and profile is None:
        raise ConfigError("harvest config: profile is required when jobs are given (run `harvest profile` for this GPU and model)")

    share = raw.pop("share_served_weights", True)
    if not isinstance(share, bool):
        raise _fail("share_served_weights", share, "true or false")

    ladder_raw = raw.pop("ladder", "auto")
    if ladder_raw == "auto":
        ladder = None
    elif isinstance(ladder_raw, list) and ladder_raw and all(isinstance(x, int) and not isinstance(x, bool) and x > 0 for x in ladder_raw):
        if len(set(ladder_raw)) != len(ladder_raw):
            raise _fail("ladder", ladder_raw, "distinct decode SM counts")
        ladder = tuple(sorted(ladder_raw, reverse=True))
    else:
        raise _fail("ladder", ladder_raw, "'auto' or a non-empty list of positive decode SM counts")

    trainer_raw = _section(raw, "trainer")
    trainer = TrainerConfig(
        cpu_threads=_number(trainer_raw, "cpu_threads", "trainer", DEFAULT_TRAINER_CPU_THREADS, low=1, high=1024, integer=True),
        nice=_number(trainer_raw, "nice", "trainer", DEFAULT_TRAINER_NICE, low=0, high=MAX_NICE, integer=True),
    )
    _no_leftovers(trainer_raw, "trainer", ("cpu_threads", "nice"))

    memory_raw = _section(raw, "memory")
    reserve_raw = memory_raw.pop("reserve_tokens", "auto")
    if reserve_raw == "auto":
        reserve = None
    else:
        memory_raw["reserve_tokens"] = reserve_raw
        reserve = _number(memory_raw, "reserve_tokens", "memory", 0, low=0, integer=True)
    memory = MemoryConfig(
        reserve_tokens=reserve,
        hysteresis_chunks=_number(memory_raw, "hysteresis_chunks", "memory", 1, low=0, integer=True),
        max_lend_fraction=_number(memory_raw, "max_lend_fraction", "memory", 0.8, low=0, high=1),
    )
    _no_leftovers(memory_raw, "memory", ("reserve_tokens", "hysteresis_chunks", "max_lend_fraction"))

    metrics_raw = _section(raw, "metrics")
    metrics = MetricsConfig(port=_number(metrics_raw, "port", "metrics", 9400, low=0, high=65535, integer=True))
    _no_leftovers(metrics_raw, "metrics", ("port",))

    _no_leftovers(raw, "", ("qos", "profile", "allow_profile_mismatch", "jobs", "share_served_weights", "ladder", "trainer",
                            "memory", "metrics"))
    return HarvestConfig(qos=qos, profile=profile, allow_profile_mismatch=allow_mismatch, jobs=jobs, share_served_weights=share,
                         ladder=ladder, trainer=trainer, memory=memory, metrics=metrics, source=source)


def load(path: str | Path) -> HarvestConfig:
    import yaml

    path = Path(path).expanduser().resolve()
    try:
        text = path.read_text()
    except OSError as exc:
        raise ConfigError(f"harvest config: cannot read {path}: {exc.strerror or exc}") from None
    try:
        raw = yaml.safe_load(text)
    except yaml.YAMLError as exc:
        raise ConfigError(f"harvest config: {path} is not valid YAML: {exc}") from None
    return parse(raw, base_dir=path.parent, source=path)
