"""Synthetic profiles with known coefficients (tests and benchmarks of harvest.predict)."""

from __future__ import annotations

import random

from harvest.predict.buckets import BatchSizeBuckets
from harvest.ladder import Ladder, Level
from harvest.predict.latency_model import CoRunCoefficients, SoloCoefficients
from harvest.predict.schema import (
    FinetuneIdentity,
    GridPointRecord,
    MeasurementSettings,
    ModelIdentity,
    Provenance,
)

H100_LADDER = Ladder(
    132,
    (Level(32, 100), Level(48, 84), Level(64, 68), Level(80, 52), Level(96, 36), Level(112, 20), Level(132, 0)),
    "green-context",
)
BUCKETS = BatchSizeBuckets((1, 2, 4, 8, 16, 24, 32, 48, 64))


def true_solo(ladder: Ladder) -> list[SoloCoefficients]:
    """Fewer SMs: slower per request, per token and in fixed cost (sublinear, like Harli fig. 9)."""
    coefficients = []
    for level in ladder.levels:
        slowdown = (ladder.total_sms / level.decode_sms) ** 0.7
        coefficients.append(SoloCoefficients(b0=1.5e-4 * slowdown, c0=9e-3 * slowdown, k0=2.5e-7 * slowdown))
    return coefficients


# Slowdown 1 + 0.35 (forward) or 0.2 (backward) times the trainer's SM share: co-location never
# speeds decode up.
TRUE_CORUN = {"forward": CoRunCoefficients(b1=1.0, k1=1.35), "backward": CoRunCoefficients(b1=1.0, k1=1.2)}


def records(
    ladder: Ladder = H100_LADDER,
    buckets: BatchSizeBuckets = BUCKETS,
    batch_sizes=(4, 16, 64),
    context_lengths=(64, 128, 256, 512),
    noise: float = 0.01,
    steps: int = 5,
    phases=("forward", "backward"),
    seed: int = 0,
) -> list[GridPointRecord]:
    rng = random.Random(seed)
    solo = true_solo(ladder)
    out = []
    for level_index, level in enumerate(ladder.levels):
        blocks = [("solo", None)] + ([("corun", p) for p in phases] if level.trainer_sms > 0 else [])
        for stage, phase in blocks:
            for bs in batch_sizes:
                for ctx in context_lengths:
                    sums = [float(bs * (ctx + 1 + i)) for i in range(steps)]
                    base = [solo[level_index].predict(buckets.padded(bs), s) for s in sums]
                    if phase is not None:
                        factor = TRUE_CORUN[phase].factor(ladder.decode_fraction(level_index), ladder.trainer_fraction(level_index))
                        base = [factor * b for b in base]
                    lat = [b * (1.0 + rng.gauss(0.0, noise)) for b in base]
                    out.append(
                        GridPointRecord(level_index, stage, phase, bs, ctx, sum(sums) / steps, sum(lat) / steps, tuple(lat), tuple(sums), 3 if phase else None)
                    )
    return out


def provenance(ladder: Ladder = H100_LADDER, device_name: str = "NVIDIA H100 80GB HBM3", config_hash: str = "0123456789abcdef") -> Provenance:
    return Provenance(
        device_kind="cuda",
        device_name=device_name,
        sm_count=ladder.total_sms,
        compute_capability="9.0",
        driver_version="12080",
        torch_version="2.13.0",
        sglang_version="0.5.23",
        transformers_version="5.19.0",
        peft_version="0.18.1",
        harvest_version="0.1.0",
        python_version="3.11.7",
        platform="Linux",
        engine="sglang",
        model=ModelIdentity("/models/llama3-8b", "llama3-8b", config_hash, "bfloat16", True),
        finetune=FinetuneIdentity("peft-lora", "/models/llama3-8b", "synthetic", config_hash),
        measurement=MeasurementSettings("cuda-events", 3, 5, 0.2, 0.005, 1),
        created_utc="2026-01-01T00:00:00Z",
        command_line="synthetic",
    )
