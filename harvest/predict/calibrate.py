"""Measured grid points -> a fitted, validated :class:`~harvest.predict.schema.Profile`.

The step between the profiler (which only measures) and the profile file: fit both
stages on the grid points' trimmed means, derive the profiled range from the solo
points, and assemble the profile, whose constructor checks every invariant.
"""

from __future__ import annotations

from typing import Sequence

from harvest.predict.buckets import BatchSizeBuckets
from harvest.predict.fit import CoRunFit, FitError, fit_models
from harvest.ladder import Ladder
from harvest.predict.latency_model import ProfiledRange
from harvest.predict.schema import (
    SCHEMA_NAME,
    SCHEMA_VERSION,
    Grid,
    GridPointRecord,
    Profile,
    Provenance,
    Stage1Fit,
    Stage2,
    Stage2Fit,
    TrainerSection,
)


def profiled_range(records: Sequence[GridPointRecord]) -> ProfiledRange:
    solo = [r for r in records if r.stage == "solo"]
    if not solo:
        raise FitError("no solo grid points: nothing was profiled")
    return ProfiledRange(
        min_batch_size=min(r.batch_size for r in solo),
        max_batch_size=max(r.batch_size for r in solo),
        min_sum_context=min(min(r.step_sum_contexts) for r in solo),
        max_sum_context=max(max(r.step_sum_contexts) for r in solo),
    )


def _stage2_fit(fit: CoRunFit) -> Stage2Fit:
    return Stage2Fit(fit.coefficients.b1, fit.coefficients.k1, fit.identifiable, fit.quality)


def build_profile(
    provenance: Provenance,
    ladder: Ladder,
    buckets: BatchSizeBuckets,
    grid: Grid,
    records: Sequence[GridPointRecord],
    trainer: TrainerSection | None = None,
) -> Profile:
    """Fit and assemble; raises FitError when the records cannot determine the model."""
    records = tuple(records)
    solo = [r.as_sample() for r in records if r.stage == "solo"]
    corun = [r.as_sample() for r in records if r.stage == "corun"]
    fitted = fit_models(solo, corun, ladder, buckets)
    stage1 = tuple(
        Stage1Fit(c.b0, c.c0, c.k0, quality) for c, quality in zip(fitted.solo, fitted.solo_quality)
    )
    stage2 = Stage2(
        combined=_stage2_fit(fitted.corun),
        by_phase={name: _stage2_fit(fit) for name, fit in fitted.corun_by_phase.items()},
        use_phase_models=fitted.use_phase_models,
    )
    return Profile(
        schema=SCHEMA_NAME,
        schema_version=SCHEMA_VERSION,
        provenance=provenance,
        ladder=ladder,
        batch_size_buckets=buckets.capture_sizes,
        grid=grid,
        profiled_range=profiled_range(records),
        samples=records,
        stage1=stage1,
        stage2=stage2,
        trainer=trainer,
    )


def describe_fit(profile: Profile) -> str:
    """The fit-quality summary `harvest profile` prints."""
    lines = [f"fit quality ({profile.provenance.engine} engine, {profile.ladder.describe()}):"]
    for level, fit in enumerate(profile.stage1):
        lv = profile.ladder.levels[level]
        lines.append(
            f"  stage 1, level {level} ({lv.decode_sms}/{lv.trainer_sms} SMs): b0={fit.b0 * 1e3:.4f} ms/req "
            f"c0={fit.c0 * 1e3:.4f} ms k0={fit.k0 * 1e6:.5f} us/token; {fit.quality.describe()}"
        )
    s2 = profile.stage2
    note = "" if s2.combined.identifiable else " (one SM split profiled: only the level's slowdown factor is determined)"
    lines.append(f"  stage 2, combined: b1={s2.combined.b1:.4f} k1={s2.combined.k1:.4f}; {s2.combined.quality.describe()}{note}")
    for name, fit in sorted(s2.by_phase.items()):
        lines.append(f"  stage 2, {name}: b1={fit.b1:.4f} k1={fit.k1:.4f}; {fit.quality.describe()}")
    if s2.by_phase:
        lines.append(f"  per-phase stage-2 models {'in use' if s2.use_phase_models else 'not better than combined; combined in use'}")
    if profile.trainer is not None:
        rates = "; ".join(
            f"{'whole device' if r.level is None else f'level {r.level}'} {r.phase}: {r.units_per_s:.3g} units/s"
            for r in profile.trainer.alone
        )
        lines.append(f"  trainer alone ({profile.trainer.tokens_per_unit:.4g} tokens/unit): {rates}")
    return "\n".join(lines)
