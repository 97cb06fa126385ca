"""The latency profile as the replay needs it: stage 1 always, stage 2 when present.

A full profile loads through :class:`~harvest.predict.schema.Profile` (every invariant
checked) and gives the real :class:`~harvest.predict.latency_model.LatencyPredictor`. A profile
without stage 2 (the co-run stage skipped or cut short: ``stage2`` absent or null) loads
through :class:`~harvest.predict.schema.Stage1Profile`, checked the same way but for
stage 2, so the baselines that need no co-location model (decode-only, separate) run,
and the policies that do (harvest, static) are refused with
:attr:`ReplayProfile.stage2_missing` as the reason. Anything wrong with the file is a
:class:`ProfileError` naming it and the JSON path of the value.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

from harvest.predict.buckets import BatchSizeBuckets
from harvest.ladder import Ladder
from harvest.predict.latency_model import CoRunCoefficients, LatencyPredictor, ProfiledRange, SoloCoefficients
from harvest.predict.schema import (
    GridPointRecord,
    MemorySection,
    Profile,
    ProfileError,
    Provenance,
    Stage1Profile,
    TrainerSection,
    read_profile_json,
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
    finished beside decode, over the wall seconds they were counted in (`_window_s`);
    ``phases`` splits them by the phase the trainer was held in."""

    level: int
    num_points: int
    trainer_units: int
    window_s: float
    phases: tuple[PhaseUnits, ...] = ()

    @property
    def units_per_s(self) -> float:
        return self.trainer_units / self.window_s if self.window_s > 0 else 0.0


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
    tp_size: int = 1  # tensor-parallel ranks of the measured decode instance (provenance.tp_size)
    memory: MemorySection | None = None  # the KV chunk's lend and reclaim times, if the profile has them

    @property
    def has_stage2(self) -> bool:
        return self.predictor is not None


def from_profile(profile: Profile, label: str) -> ReplayProfile:
    return ReplayProfile(
        **_measured(profile, label),
        corun=CoRunCoefficients(profile.stage2.combined.b1, profile.stage2.combined.k1),
        predictor=profile.predictor(),
        stage2_missing=None,
        trainer_records=_trainer_records(profile.samples),
        trainer_alone=profile.trainer,
    )


def _measured(profile: Profile | Stage1Profile, label: str) -> dict:
    """The ReplayProfile fields a profile with or without stage 2 gives alike."""
    prov = profile.provenance
    return dict(label=label, description=_describe(prov), synthetic=_is_synthetic(prov), device_kind=prov.device_kind,
                ladder=profile.ladder, buckets=profile.buckets, profiled_range=profile.profiled_range,
                solo=tuple(SoloCoefficients(f.b0, f.c0, f.k0) for f in profile.stage1),
                finetune_description=prov.finetune.description, tp_size=prov.tp_size, memory=profile.memory)


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
    data = read_profile_json(path)
    try:
        if isinstance(data, dict) and data.get("stage2") is None:
            return _stage1_only(Stage1Profile.from_dict(data), path, "stage2" in data)
        return from_profile(Profile.from_dict(data), path.name)
    except ProfileError as exc:
        raise ProfileError(f"{path}: {exc}") from exc


def _stage1_only(profile: Stage1Profile, path: Path, stage2_null: bool) -> ReplayProfile:
    return ReplayProfile(
        **_measured(profile, path.name),
        corun=None,
        predictor=None,
        stage2_missing=(
            f"{path.name} has no stage-2 (co-run) data (profile.stage2 is {'null' if stage2_null else 'missing'}); "
            "re-run `harvest profile` to completion so the co-run stage is measured"
        ),
        trainer_records=(),
    )


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
            sum(_window_s(r) for r in records),
            _phase_units(records),
        )
        for level, records in sorted(by_level.items())
    )


def _phase_units(records: list[GridPointRecord]) -> tuple[PhaseUnits, ...]:
    by_phase: dict[str, list[GridPointRecord]] = {}
    for record in records:
        by_phase.setdefault(record.phase, []).append(record)
    return tuple(
        PhaseUnits(phase, sum(r.trainer_units for r in rs), sum(_window_s(r) for r in rs))
        for phase, rs in sorted(by_phase.items())
    )


def _window_s(record: GridPointRecord) -> float:
    """The wall seconds a co-run point counted its trainer units over. Profiles written
    before it was recorded give only the steps' summed latencies, which leave out the host
    work between the steps, so the rate reads high there (up to 30 % above the same SMs'
    alone rate in the H100/H200 profiles of 2026-11-24/26); the trainer model caps it
    (harvest.replay.trainer_model)."""
    return record.trainer_window_s if record.trainer_window_s is not None else sum(record.step_latencies_s)


def _is_synthetic(prov: Provenance) -> bool:
    return "synthetic" in prov.command_line or prov.device_name.startswith("synthetic")


def _describe(prov: Provenance) -> str:
    tp = f" x {prov.tp_size} (tensor parallel)" if prov.tp_size > 1 else ""
    return f"{prov.model.name} ({prov.model.dtype}) on {prov.device_name}{tp}, {prov.engine} engine"
