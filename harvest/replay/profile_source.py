"""The latency profile as the replay needs it: stage 1 always, stage 2 when present.

A full profile loads through :class:`~harvest.predict.schema.Profile` (every invariant
checked) and gives the real :class:`~harvest.predict.model.LatencyPredictor`. A profile
without stage-2 data (the co-run stage skipped or cut short: no co-run samples, no
``stage2`` fit) is refused by ``Profile``; the replay still reads its stage-1 fits, so
the baselines that need no co-location model (decode-only, separate) run, and the
policies that do (harvest, static) are refused with :attr:`ReplayProfile.stage2_missing`
as the reason. Anything else wrong with the file is a :class:`ProfileError`.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

from harvest.predict import strict_json
from harvest.predict.buckets import BatchSizeBuckets
from harvest.ladder import Ladder
from harvest.predict.model import CoRunCoefficients, LatencyPredictor, ProfiledRange, SoloCoefficients
from harvest.predict.schema import (
    READABLE_VERSIONS,
    SCHEMA_NAME,
    GridPointRecord,
    Profile,
    ProfileError,
    Provenance,
    Stage1Fit,
    TrainerSection,
)


@dataclasses.dataclass(frozen=True)
class PhaseUnits:
    """Trainer units finished in one phase over ``seconds``."""

    phase: str
    units: int
    seconds: float

    @property
    def units_per_s(self) -> float:
        return self.units / self.seconds if self.seconds > 0 else 0.0


@dataclasses.dataclass(frozen=True)
class LevelTrainerRecord:
    """What the profile's co-run grid points at one level say about the trainer: units it
    finished beside decode, over the summed latency of the timed decode steps (the steps
    run back to back, so that sum is the window the units were counted in); ``phases``
    splits them by the phase the trainer was held in."""

    level: int
    num_points: int
    trainer_units: int
    decode_seconds: float
    phases: tuple[PhaseUnits, ...] = ()

    @property
    def units_per_s(self) -> float:
        return self.trainer_units / self.decode_seconds if self.decode_seconds > 0 else 0.0


@dataclasses.dataclass(frozen=True)
class ReplayProfile:
    """``predictor`` is None exactly when ``stage2_missing`` says why."""

    label: str  # file name, or the synthetic profile's name
    description: str  # device, model, engine: one line for reports
    synthetic: bool
    device_kind: str
    ladder: Ladder
    buckets: BatchSizeBuckets
    profiled_range: ProfiledRange
    solo: tuple[SoloCoefficients, ...]
    corun: CoRunCoefficients | None
    predictor: LatencyPredictor | None
    stage2_missing: str | None
    finetune_description: str
    trainer_records: tuple[LevelTrainerRecord, ...]
    trainer_alone: TrainerSection | None = None  # the profile's trainer section (schema 2), if measured

    @property
    def has_stage2(self) -> bool:
        return self.predictor is not None


def from_profile(profile: Profile, label: str) -> ReplayProfile:
    prov = profile.provenance
    return ReplayProfile(
        label=label,
        description=_describe(prov),
        synthetic=_is_synthetic(prov),
        device_kind=prov.device_kind,
        ladder=profile.ladder,
        buckets=profile.buckets,
        profiled_range=profile.profiled_range,
        solo=tuple(SoloCoefficients(f.b0, f.c0, f.k0) for f in profile.stage1),
        corun=CoRunCoefficients(profile.stage2.combined.b1, profile.stage2.combined.k1),
        predictor=profile.predictor(),
        stage2_missing=None,
        finetune_description=prov.finetune.description,
        trainer_records=_trainer_records(profile.samples),
        trainer_alone=profile.trainer,
    )


def committed_profiles(directory: Path) -> list[ReplayProfile]:
    """The loadable profiles in ``directory`` (the project's ``profiles/``), measured GPU
    profiles first, then CPU ones, each group by file name; unreadable files are skipped
    (``harvest replay --profile`` names one explicitly to see its error)."""
    found = []
    for path in sorted(Path(directory).glob("*.json")):
        try:
            found.append(load(path))
        except ProfileError:
            continue
    return sorted(found, key=lambda p: (p.synthetic, p.device_kind != "cuda"))


def load(path: str | Path) -> ReplayProfile:
    """Load a profile file for replay; raises ProfileError naming the file and field."""
    path = Path(path)
    try:
        data = strict_json.loads(path.read_text())
    except (OSError, UnicodeDecodeError) as exc:
        raise ProfileError(f"cannot read profile {path}: {exc}") from exc
    except (ValueError, RecursionError) as exc:
        raise ProfileError(f"{path}: not valid JSON: {exc}") from exc
    try:
        return from_profile(Profile.from_dict(data), path.name)
    except ProfileError as exc:
        if not _lacks_stage2(data):
            raise ProfileError(f"{path}: {exc}") from exc
        return _stage1_only(data, path, reason=str(exc))


def _lacks_stage2(data) -> bool:
    """A harvest profile of this schema version whose only defect may be missing stage 2."""
    if not isinstance(data, dict) or data.get("schema") != SCHEMA_NAME or data.get("schema_version") not in READABLE_VERSIONS:
        return False
    samples = data.get("samples")
    no_corun = isinstance(samples, list) and not any(isinstance(s, dict) and s.get("stage") == "corun" for s in samples)
    return data.get("stage2") is None or no_corun


def _stage1_only(data: dict, path: Path, reason: str) -> ReplayProfile:
    """Read what decode-only replay needs from a profile without stage 2, as strictly
    as ``Profile`` would read those fields."""
    where = str(path)
    try:
        ladder = strict_json.from_jsonable(Ladder, _field(data, "ladder", where), f"{where}: profile.ladder")
        stage1 = strict_json.from_jsonable(tuple[Stage1Fit, ...], _field(data, "stage1", where), f"{where}: profile.stage1")
        buckets = BatchSizeBuckets(strict_json.from_jsonable(tuple[int, ...], _field(data, "batch_size_buckets", where), "buckets"))
        profiled_range = strict_json.from_jsonable(ProfiledRange, _field(data, "profiled_range", where), f"{where}: profile.profiled_range")
        provenance = strict_json.from_jsonable(Provenance, _field(data, "provenance", where), f"{where}: profile.provenance")
    except (strict_json.StrictJsonError, ValueError) as exc:
        raise ProfileError(f"{where}: {exc}") from exc
    if len(stage1) != ladder.num_levels:
        raise ProfileError(f"{where}: profile.stage1 has {len(stage1)} entries for a ladder of {ladder.num_levels} levels")
    try:
        solo = tuple(SoloCoefficients(f.b0, f.c0, f.k0) for f in stage1)
    except ValueError as exc:
        raise ProfileError(f"{where}: profile.stage1: {exc}") from exc
    return ReplayProfile(
        label=path.name,
        description=_describe(provenance),
        synthetic=_is_synthetic(provenance),
        device_kind=provenance.device_kind,
        ladder=ladder,
        buckets=buckets,
        profiled_range=profiled_range,
        solo=solo,
        corun=None,
        predictor=None,
        stage2_missing=(
            f"{path.name} has no stage-2 (co-run) data ({reason}); re-run `harvest profile` to completion "
            "so the co-run stage is measured"
        ),
        finetune_description=provenance.finetune.description,
        trainer_records=(),
    )


def _field(data: dict, name: str, where: str):
    if name not in data:
        raise ProfileError(f"{where}: profile.{name} is missing")
    return data[name]


def _trainer_records(samples: tuple[GridPointRecord, ...]) -> tuple[LevelTrainerRecord, ...]:
    by_level: dict[int, list[GridPointRecord]] = {}
    for record in samples:
        if record.stage == "corun" and record.trainer_units is not None:
            by_level.setdefault(record.level, []).append(record)
    return tuple(
        LevelTrainerRecord(
            level,
            len(records),
            sum(r.trainer_units for r in records),
            sum(sum(r.step_latencies_s) for r in records),
            _phase_units(records),
        )
        for level, records in sorted(by_level.items())
    )


def _phase_units(records: list[GridPointRecord]) -> tuple[PhaseUnits, ...]:
    by_phase: dict[str, list[GridPointRecord]] = {}
    for record in records:
        by_phase.setdefault(record.phase, []).append(record)
    return tuple(
        PhaseUnits(phase, sum(r.trainer_units for r in rs), sum(sum(r.step_latencies_s) for r in rs))
        for phase, rs in sorted(by_phase.items())
    )


def _is_synthetic(prov: Provenance) -> bool:
    return "synthetic" in prov.command_line or prov.device_name.startswith("synthetic")


def _describe(prov: Provenance) -> str:
    return f"{prov.model.name} ({prov.model.dtype}) on {prov.device_name}, {prov.engine} engine"
