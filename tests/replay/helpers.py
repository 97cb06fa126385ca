"""Small synthetic profiles with hand-checkable latencies, for the replay tests."""

from __future__ import annotations

from typing import Sequence

from harvest.predict.buckets import BatchSizeBuckets
from harvest.ladder import Ladder, Level
from harvest.predict.latency_model import CoRunCoefficients, SoloCoefficients
from harvest.replay import profile_source, synthetic
from harvest.replay.comparison import ReplaySettings
from harvest.replay.simulator import DecodeLimits
from harvest.replay.trace import TraceRequest

# 100 SMs: decode 40 / trainer 60, decode 60 / trainer 40 (static's 60 %), whole device.
THREE_LEVELS = ((40, 60), (60, 40), (100, 0))
NO_PADDING = BatchSizeBuckets(())


def ladder(levels: Sequence[tuple[int, int]] = THREE_LEVELS, total: int = 100) -> Ladder:
    partitioner = "whole-device" if len(levels) == 1 and levels[0] == (total, total) else "green-context"
    return Ladder(total, tuple(Level(d, t) for d, t in levels), partitioner)


def make_profile(
    levels: Sequence[tuple[int, int]] = THREE_LEVELS,
    total: int = 100,
    solo: Sequence[tuple[float, float, float]] | tuple[float, float, float] = (0.0, 0.010, 0.0),
    corun: tuple[float, float] = (1.0, 1.4),
    tp_size: int = 1,
):
    """A ReplayProfile whose stage 1 is ``b0·bs + c0 + k0·Σctx`` (seconds; one triple for
    every level or one per level) and stage 2 ``(SM_d·b1 + SM_t·k1)``; no padding; measured
    at tensor-parallel degree ``tp_size``."""
    spec = ladder(levels, total)
    triples = [solo] * spec.num_levels if isinstance(solo[0], (int, float)) else list(solo)
    coefficients = [SoloCoefficients(*t) for t in triples]
    built = synthetic.build_profile(spec, coefficients, CoRunCoefficients(*corun), buckets=NO_PADDING, tp_size=tp_size)
    return profile_source.from_profile(built, "test-profile")


def requests(*rows: tuple[float, int, int]) -> list[TraceRequest]:
    return [TraceRequest(a, c, g) for a, c, g in rows]


def settings(max_batch: int = 64, kv: int = 1_000_000, **kwargs) -> ReplaySettings:
    return ReplaySettings(limits=DecodeLimits(max_batch, kv), **kwargs)
