"""Calibration profiles: the versioned JSON file `harvest profile` writes (profiles/*.json).

A profile holds where and how it was measured (provenance), the ladder and batch-size
buckets it was measured on, every raw step latency, the fitted coefficients of both
stages and their error. ``profiles/README.md`` documents each field. Loading validates
everything (:mod:`harvest.predict.strict_json`) and the cross-field invariants below, so
a profile that loads is one the predictor can use; whether it matches the *running*
GPU, model and ladder is :mod:`harvest.predict.compat`'s question.

Bump SCHEMA_VERSION on any change a reader of the previous version would misread.
Version 2 added the optional ``trainer`` section (the finetune workload's rate alone);
version-1 files still load, with ``trainer`` None, and save back as version 1.
"""

from __future__ import annotations

import dataclasses
import math
import os
import tempfile
from pathlib import Path

from harvest.predict import strict_json
from harvest.predict.buckets import BatchSizeBuckets
from harvest.predict.fit import FitQuality, LatencySample
from harvest.ladder import Ladder
from harvest.predict.model import CoRunCoefficients, LatencyPredictor, ProfiledRange, SoloCoefficients

SCHEMA_NAME = "harvest-latency-profile"
SCHEMA_VERSION = 2
READABLE_VERSIONS = (1, 2)  # version 1: no `trainer` section
STAGES = ("solo", "corun")


class ProfileError(ValueError):
    """A profile file is unreadable, corrupt, of another schema version, or inconsistent."""


@dataclasses.dataclass(frozen=True)
class ModelIdentity:
    path: str
    name: str
    config_hash: str  # compat.model_config_hash of the latency-relevant config fields
    dtype: str
    random_weights: bool


@dataclasses.dataclass(frozen=True)
class FinetuneIdentity:
    workload: str  # "harvest-trainer" or "peft-lora": what ran beside decode in the co-run stage
    base_model: str
    description: str  # the job in words (rank, targets, micro-batch, sequence length)
    config_hash: str | None  # of the finetune base model's config, as ModelIdentity.config_hash


@dataclasses.dataclass(frozen=True)
class MeasurementSettings:
    timer: str  # "cuda-events" or "perf_counter_ns"
    warmup_steps: int
    timed_steps: int
    trim_fraction: float  # cut from each end of the sorted step latencies before averaging
    switch_interval_s: float  # sys.getswitchinterval() during the run (GIL hand-over period)
    torch_threads: int  # torch.get_num_threads() (intra-op threads; decisive on a CPU)


@dataclasses.dataclass(frozen=True)
class Provenance:
    device_kind: str  # "cuda" or "cpu"
    device_name: str
    sm_count: int  # streaming multiprocessors; logical cores on a CPU
    compute_capability: str | None
    driver_version: str | None
    torch_version: str
    sglang_version: str | None
    transformers_version: str | None
    peft_version: str | None
    harvest_version: str
    python_version: str
    platform: str
    engine: str  # "sglang" or "transformers"
    model: ModelIdentity
    finetune: FinetuneIdentity
    measurement: MeasurementSettings
    created_utc: str
    command_line: str


@dataclasses.dataclass(frozen=True)
class Grid:
    batch_sizes: tuple[int, ...]
    context_lengths: tuple[int, ...]


@dataclasses.dataclass(frozen=True)
class GridPointRecord:
    """All timed decode steps at one (level, stage, phase, batch size, context length)."""

    level: int
    stage: str  # "solo" or "corun"
    phase: str | None  # trainer phase during a co-run point; None for solo
    batch_size: int
    context_length: int  # tokens per request at the first timed step
    sum_context: float  # mean Σctx over the kept steps (the fit's feature)
    latency_s: float  # trimmed mean of step_latencies_s (the fit's target)
    step_latencies_s: tuple[float, ...]
    step_sum_contexts: tuple[float, ...]
    trainer_units: int | None  # trainer units completed during the timed steps (co-run)

    def __post_init__(self) -> None:
        if self.stage not in STAGES:
            raise ValueError(f"stage={self.stage!r}: one of {', '.join(STAGES)}")
        if (self.stage == "corun") != (self.phase is not None):
            raise ValueError(f"phase={self.phase!r}: co-run points name a trainer phase, solo points none")
        if not self.step_latencies_s or len(self.step_latencies_s) != len(self.step_sum_contexts):
            raise ValueError("step_latencies_s and step_sum_contexts: equal, non-zero lengths")
        if self.latency_s <= 0 or any(v <= 0 for v in self.step_latencies_s):
            raise ValueError("latencies must be > 0")
        if self.batch_size <= 0 or self.context_length <= 0 or self.level < 0:
            raise ValueError("level >= 0, batch_size > 0 and context_length > 0")

    def as_sample(self) -> LatencySample:
        return LatencySample(self.level, self.batch_size, self.sum_context, self.latency_s, self.phase)


@dataclasses.dataclass(frozen=True)
class TrainerAloneRecord:
    """The co-run workload running alone, held in one phase, for ``seconds``."""

    level: int | None  # ladder level whose trainer SMs it ran on; None: the whole device outside any partition
    phase: str
    units: int
    seconds: float

    def __post_init__(self) -> None:
        if self.units < 0 or self.seconds <= 0 or (self.level is not None and self.level < 0):
            raise ValueError(f"units={self.units}, seconds={self.seconds}, level={self.level}: need >= 0, > 0, >= 0")

    @property
    def units_per_s(self) -> float:
        return self.units / self.seconds


@dataclasses.dataclass(frozen=True)
class TrainerSection:
    """What the finetune workload does with no decode running: ``alone`` holds one record
    per (trainer level, phase) plus the whole device's (``whole_device_level``: the level
    that gives the trainer every SM, or None when it was measured outside the ladder)."""

    tokens_per_unit: float  # mean training tokens per unit of the workload
    seconds_per_phase: float  # how long each alone measurement was asked to run
    whole_device_level: int | None
    alone: tuple[TrainerAloneRecord, ...]

    def __post_init__(self) -> None:
        if self.tokens_per_unit <= 0 or self.seconds_per_phase <= 0:
            raise ValueError(f"tokens_per_unit={self.tokens_per_unit}, seconds_per_phase={self.seconds_per_phase}: must be > 0")

    def records(self, level: int | None) -> list[TrainerAloneRecord]:
        return [r for r in self.alone if r.level == level]


@dataclasses.dataclass(frozen=True)
class Stage1Fit:
    b0: float
    c0: float
    k0: float
    quality: FitQuality


@dataclasses.dataclass(frozen=True)
class Stage2Fit:
    b1: float
    k1: float
    identifiable: bool
    quality: FitQuality


@dataclasses.dataclass(frozen=True)
class Stage2:
    combined: Stage2Fit
    by_phase: dict[str, Stage2Fit]
    use_phase_models: bool  # True: the predictor uses by_phase models when told the phase


@dataclasses.dataclass(frozen=True)
class Profile:
    schema: str
    schema_version: int
    provenance: Provenance
    ladder: Ladder
    batch_size_buckets: tuple[int, ...]
    grid: Grid
    profiled_range: ProfiledRange
    samples: tuple[GridPointRecord, ...]
    stage1: tuple[Stage1Fit, ...]
    stage2: Stage2
    trainer: TrainerSection | None = None  # schema version >= 2, when `harvest profile` measured it

    def __post_init__(self) -> None:
        _check_consistency(self)

    # -- views --------------------------------------------------------------------------
    @property
    def buckets(self) -> BatchSizeBuckets:
        return BatchSizeBuckets(self.batch_size_buckets)

    def solo_samples(self) -> list[LatencySample]:
        return [r.as_sample() for r in self.samples if r.stage == "solo"]

    def corun_samples(self) -> list[LatencySample]:
        return [r.as_sample() for r in self.samples if r.stage == "corun"]

    def predictor(self) -> LatencyPredictor:
        solo = [SoloCoefficients(f.b0, f.c0, f.k0) for f in self.stage1]
        combined = CoRunCoefficients(self.stage2.combined.b1, self.stage2.combined.k1)
        by_phase = None
        if self.stage2.use_phase_models:
            by_phase = {name: CoRunCoefficients(f.b1, f.k1) for name, f in self.stage2.by_phase.items()}
        return LatencyPredictor(self.ladder, self.buckets, solo, combined, self.profiled_range, by_phase)

    # -- I/O ----------------------------------------------------------------------------
    def to_dict(self) -> dict:
        data = {f.name: strict_json.to_jsonable(getattr(self, f.name)) for f in dataclasses.fields(self)}
        if self.schema_version == 1:
            del data["trainer"]  # version 1 has no such field: written back as read
        return data

    def to_json(self) -> str:
        return strict_json.dumps(self.to_dict(), indent=1) + "\n"

    def save(self, path: str | Path) -> None:
        """Write atomically: a reader never sees half a profile."""
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent)
        try:
            with os.fdopen(fd, "w") as out:
                out.write(self.to_json())
            os.chmod(tmp, 0o644)  # mkstemp makes it owner-only; a profile is meant to be shared
            os.replace(tmp, path)
        except BaseException:
            Path(tmp).unlink(missing_ok=True)
            raise

    @classmethod
    def from_dict(cls, data) -> "Profile":
        if not isinstance(data, dict):
            raise ProfileError(f"profile: expected a JSON object, got {type(data).__name__}")
        if data.get("schema") != SCHEMA_NAME:
            raise ProfileError(f"profile.schema={data.get('schema')!r}: not a harvest latency profile ({SCHEMA_NAME!r})")
        version = data.get("schema_version")
        if isinstance(version, bool) or version not in READABLE_VERSIONS:
            raise ProfileError(
                f"profile.schema_version={version!r}: this harvest reads versions {', '.join(map(str, READABLE_VERSIONS))}; "
                f"re-run `harvest profile` to produce a compatible profile"
            )
        if version == 1:
            if "trainer" in data:
                raise ProfileError("profile.trainer: not a field of schema version 1 (a version-2 profile with the wrong version?)")
            data = {**data, "trainer": None}
        try:
            return strict_json.dataclass_from_dict(cls, data, "profile")
        except strict_json.StrictJsonError as exc:
            raise ProfileError(str(exc)) from exc

    @classmethod
    def from_json(cls, text: str) -> "Profile":
        try:
            data = strict_json.loads(text)
        except (ValueError, RecursionError) as exc:
            raise ProfileError(f"profile is not valid JSON: {exc}") from exc
        return cls.from_dict(data)

    @classmethod
    def load(cls, path: str | Path) -> "Profile":
        try:
            text = Path(path).read_text()
        except (OSError, UnicodeDecodeError) as exc:
            raise ProfileError(f"cannot read profile {path}: {exc}") from exc
        try:
            return cls.from_json(text)
        except ProfileError as exc:
            raise ProfileError(f"{path}: {exc}") from exc


def _check_consistency(p: Profile) -> None:
    """Invariants across fields (each field's own type is checked on construction)."""
    if p.schema != SCHEMA_NAME or p.schema_version not in READABLE_VERSIONS:
        raise ProfileError(f"profile: schema {p.schema!r} version {p.schema_version}, expected {SCHEMA_NAME!r} {READABLE_VERSIONS}")
    if p.trainer is not None:
        _check_trainer(p)
    if not isinstance(p.ladder, Ladder):
        raise ProfileError("profile.ladder: expected a Ladder")
    try:
        BatchSizeBuckets(p.batch_size_buckets)
    except ValueError as exc:
        raise ProfileError(f"profile.batch_size_buckets: {exc}") from exc
    if len(p.stage1) != p.ladder.num_levels:
        raise ProfileError(f"profile.stage1: {len(p.stage1)} entries for a ladder of {p.ladder.num_levels} levels")
    for index, fit in enumerate(p.stage1):
        SoloCoefficients(fit.b0, fit.c0, fit.k0)
        _check_quality(fit.quality, f"profile.stage1[{index}].quality")
    for name, fit in [("combined", p.stage2.combined)] + sorted(p.stage2.by_phase.items()):
        _check_quality(fit.quality, f"profile.stage2.{name}.quality")
    if p.stage2.use_phase_models and len(p.stage2.by_phase) < 2:
        raise ProfileError("profile.stage2.use_phase_models is true but by_phase has fewer than 2 phases")
    if not p.grid.batch_sizes or not p.grid.context_lengths:
        raise ProfileError("profile.grid: batch_sizes and context_lengths must be non-empty")
    levels_with_solo = set()
    for index, record in enumerate(p.samples):
        if record.level >= p.ladder.num_levels:
            raise ProfileError(f"profile.samples[{index}].level={record.level}: the ladder has {p.ladder.num_levels} levels")
        if record.stage == "solo":
            levels_with_solo.add(record.level)
    missing = sorted(set(range(p.ladder.num_levels)) - levels_with_solo)
    if missing:
        raise ProfileError(f"profile.samples: no solo samples for level(s) {missing}")
    if not any(r.stage == "corun" for r in p.samples):
        raise ProfileError("profile.samples: no co-run samples (stage 2 cannot have been fitted)")


def _check_trainer(p: Profile) -> None:
    """Every level that gives the trainer SMs, and the whole device, measured in the same phases."""
    section, levels = p.trainer, p.ladder.levels
    if p.schema_version < 2:
        raise ProfileError(f"profile.trainer: needs schema version 2, the file says {p.schema_version}")
    where = section.whole_device_level
    if where is not None and not (0 <= where < len(levels) and levels[where].trainer_sms == p.ladder.total_sms):
        raise ProfileError(f"profile.trainer.whole_device_level={where}: not a level giving the trainer all {p.ladder.total_sms} SMs")
    expected = {i for i, level in enumerate(levels) if level.trainer_sms > 0} | {where}
    phases_by_level: dict = {}
    for index, record in enumerate(section.alone):
        if record.level not in expected:
            raise ProfileError(f"profile.trainer.alone[{index}].level={record.level}: expected one of {sorted(expected, key=str)}")
        phases = phases_by_level.setdefault(record.level, [])
        if record.phase in phases:
            raise ProfileError(f"profile.trainer.alone[{index}]: level {record.level} phase {record.phase!r} measured twice")
        phases.append(record.phase)
    if set(phases_by_level) != expected or len({frozenset(v) for v in phases_by_level.values()}) != 1:
        raise ProfileError(
            f"profile.trainer.alone: expected the same phases on every level in {sorted(expected, key=str)}, got {phases_by_level}"
        )
    if not any(r.units > 0 for r in section.records(where)):
        raise ProfileError("profile.trainer.alone: no unit finished on the whole device; its rate is unknown")


def _check_quality(quality: FitQuality, path: str) -> None:
    values = [quality.mape, quality.max_error] + ([quality.cv_mape] if quality.cv_mape is not None else [])
    if quality.num_samples <= 0 or any(not math.isfinite(v) or v < 0 for v in values):
        raise ProfileError(f"{path}: num_samples > 0 and finite, non-negative errors required, got {quality}")
