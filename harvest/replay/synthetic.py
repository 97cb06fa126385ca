"""Synthetic latency profiles with exactly known coefficients, for replay tests and for
the replay benchmark until a measured GPU profile exists.

A synthetic profile is a real :class:`~harvest.predict.schema.Profile` whose grid points are
computed, noise-free, from the coefficients it stores; its provenance says ``synthetic``
(device name, command line, finetune description), so it is never mistaken for a
measurement. :func:`harli_a100_llama3_8b` is shaped after what Harli reports for
Llama-3-8B decode on an A100 (§2, §5, fig. 8-10), not measured: ~11 ms fixed cost per step,
≈ 0.09 µs per context token, sublinear slow-down with fewer SMs, and a co-location
slow-down linear in the trainer's SM share (eq. 3).
"""

from __future__ import annotations

from typing import Sequence

from harvest.predict.buckets import BatchSizeBuckets
from harvest.predict.fit import FitQuality
from harvest.ladder import GREEN_CONTEXTS, Ladder, Level
from harvest.predict.latency_model import CoRunCoefficients, ProfiledRange, SoloCoefficients
from harvest.predict.schema import (
    SCHEMA_NAME,
    SCHEMA_VERSION,
    FinetuneIdentity,
    Grid,
    GridPointRecord,
    MeasurementSettings,
    ModelIdentity,
    Profile,
    Provenance,
    Stage1Fit,
    Stage2,
    Stage2Fit,
)

SYNTHETIC = "synthetic"
# What harvest.compute.plan_ladder builds on a 108-SM A100 (compute capability 8.0,
# 6 levels): decode near i/6 of the device, trainer the remainder, then the whole device.
A100_LADDER = Ladder(
    108,
    (Level(18, 90), Level(36, 72), Level(54, 54), Level(72, 36), Level(90, 18), Level(108, 0)),
    GREEN_CONTEXTS,
)
# SGLang's default CUDA-graph capture sizes on a large GPU (1, 2, 4, 8, then every 8 to 256).
SGLANG_BUCKETS = BatchSizeBuckets((1, 2, 4, 8) + tuple(range(16, 257, 8)))
HARLI_GRID = Grid((4, 16, 64), (64, 128, 256, 512))  # Harli (arXiv:2511.11729) §8.8: batch sizes 4, 16, 64, seqlen up to 512
_EXACT = FitQuality(num_samples=1, mape=0.0, max_error=0.0, cv_mape=None)


def harli_a100_solo(ladder: Ladder = A100_LADDER) -> list[SoloCoefficients]:
    """Stage 1 per level: whole-GPU coefficients times ``(total / decode SMs) ** 0.6``
    (memory-bound decode slows sublinearly as it loses SMs, Harli fig. 9)."""
    coefficients = []
    for level in ladder.levels:
        slowdown = (ladder.total_sms / level.decode_sms) ** 0.6
        coefficients.append(SoloCoefficients(b0=6e-5 * slowdown, c0=11e-3 * slowdown, k0=9e-8 * slowdown))
    return coefficients


HARLI_A100_CORUN = CoRunCoefficients(b1=1.0, k1=1.3)  # a disjoint split slows decode by 1 + 0.3 × trainer share


def build_profile(
    ladder: Ladder,
    solo: Sequence[SoloCoefficients],
    corun: CoRunCoefficients,
    *,
    buckets: BatchSizeBuckets = SGLANG_BUCKETS,
    grid: Grid = HARLI_GRID,
    device_name: str = "synthetic GPU",
    model_name: str = "synthetic-model",
    description: str = "synthetic profile",
    tp_size: int = 1,
) -> Profile:
    """A profile whose fits are exactly ``solo``/``corun`` and whose grid points those
    coefficients produce (one step per point, trainer units unrecorded), as if measured on
    a decode instance of ``tp_size`` tensor-parallel ranks."""
    if len(solo) != ladder.num_levels:
        raise ValueError(f"build_profile: {len(solo)} stage-1 models for a ladder of {ladder.num_levels} levels")
    records = []
    for index, level in enumerate(ladder.levels):
        stages = [("solo", None)] + ([("corun", "mixed")] if level.trainer_sms > 0 else [])
        factor = corun.factor(ladder.decode_fraction(index), ladder.trainer_fraction(index))
        for stage, phase in stages:
            for batch_size in grid.batch_sizes:
                for context in grid.context_lengths:
                    sum_context = float(batch_size * (context + 1))
                    latency = solo[index].predict(buckets.padded(batch_size), sum_context)
                    latency *= factor if stage == "corun" else 1.0
                    records.append(
                        GridPointRecord(index, stage, phase, batch_size, context, sum_context, latency, (latency,), (sum_context,), None)
                    )
    sums = [r.sum_context for r in records]
    fit2 = Stage2Fit(corun.b1, corun.k1, ladder.num_levels > 2, _EXACT)
    return Profile(
        schema=SCHEMA_NAME,
        schema_version=SCHEMA_VERSION,
        provenance=_provenance(ladder, device_name, model_name, description, tp_size),
        ladder=ladder,
        batch_size_buckets=buckets.capture_sizes,
        grid=grid,
        profiled_range=ProfiledRange(min(grid.batch_sizes), max(grid.batch_sizes), min(sums), max(sums)),
        samples=tuple(records),
        stage1=tuple(Stage1Fit(c.b0, c.c0, c.k0, _EXACT) for c in solo),
        stage2=Stage2(combined=fit2, by_phase={}, use_phase_models=False),
    )


def harli_a100_llama3_8b() -> Profile:
    """The labelled stand-in for a measured A100 / Llama-3-8B profile (see module doc)."""
    return build_profile(
        A100_LADDER,
        harli_a100_solo(),
        HARLI_A100_CORUN,
        device_name="synthetic: shaped like Harli's A100 40GB (108 SMs), not measured",
        model_name="llama3-8b (synthetic)",
        description="synthetic: Harli-shaped co-location slowdown b1=1.0 k1=1.3, not measured",
    )


def without_stage2(profile: Profile) -> dict:
    """``profile`` as JSON data with its co-run samples and stage-2 fit removed: what a
    profile measured with the co-run stage skipped or cut short looks like."""
    data = profile.to_dict()
    data["samples"] = [s for s in data["samples"] if s["stage"] == "solo"]
    del data["stage2"]
    return data


def _provenance(ladder: Ladder, device_name: str, model_name: str, description: str, tp_size: int) -> Provenance:
    return Provenance(
        device_kind="cuda",
        device_name=device_name,
        sm_count=ladder.total_sms,
        compute_capability=None,
        driver_version=None,
        torch_version=SYNTHETIC,
        sglang_version=None,
        transformers_version=None,
        peft_version=None,
        harvest_version=SYNTHETIC,
        python_version=SYNTHETIC,
        platform=SYNTHETIC,
        engine="sglang",
        model=ModelIdentity(SYNTHETIC, model_name, SYNTHETIC, "bfloat16", True),
        finetune=FinetuneIdentity("peft-lora", SYNTHETIC, description, None),
        measurement=MeasurementSettings("cuda-events", 0, 1, 0.0, 0.005, 1),
        created_utc="1970-01-01T00:00:00Z",
        command_line=SYNTHETIC,
        tp_size=tp_size,
    )
