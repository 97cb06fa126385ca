"""The two-stage latency model and its run-time predictor (Harli (arXiv:2511.11729) §5, docs/design.md §3).

Stage 1, per ladder level s:   L_solo(s) = b0·bs + c0 + k0·Σctx
Stage 2, per (model, job):     L_colo(s) = (SM_infer(s)·b1 + SM_ft(s)·k1) · L_solo(s)

Invariants: prediction is plain float arithmetic on coefficients in tuples (it runs for
every level before every decode step: nothing allocated per call); coefficients are
replaced by assigning new tuples in one statement, so a reader finishes consistently.

Rules: docs/design.md §3, 'The predictor's hot path (harvest/predict/latency_model.py)'.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Mapping, Sequence

from harvest.predict.buckets import BatchSizeBuckets
from harvest.ladder import Ladder

COMBINED_PHASE = "combined"


def _check_finite(owner: str, **values: float) -> None:
    for name, value in values.items():
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
            raise ValueError(f"{owner}.{name}={value!r}: must be a finite number")


@dataclasses.dataclass(frozen=True)
class SoloCoefficients:
    """Stage 1 of one level: seconds per (padded) request, fixed seconds, seconds per
    context token."""

    b0: float
    c0: float
    k0: float

    def __post_init__(self) -> None:
        _check_finite("SoloCoefficients", b0=self.b0, c0=self.c0, k0=self.k0)

    def predict(self, padded_batch_size: float, sum_context: float) -> float:
        return self.b0 * padded_batch_size + self.c0 + self.k0 * sum_context


@dataclasses.dataclass(frozen=True)
class CoRunCoefficients:
    """Stage 2: the co-location slowdown is ``decode_fraction·b1 + trainer_fraction·k1``."""

    b1: float
    k1: float

    def __post_init__(self) -> None:
        _check_finite("CoRunCoefficients", b1=self.b1, k1=self.k1)

    def factor(self, decode_fraction: float, trainer_fraction: float) -> float:
        return decode_fraction * self.b1 + trainer_fraction * self.k1


@dataclasses.dataclass(frozen=True)
class ProfiledRange:
    """The (raw) batch sizes and context sums the profile measured; queries outside are
    extrapolations, answered but counted."""

    min_batch_size: int
    max_batch_size: int
    min_sum_context: float
    max_sum_context: float

    def __post_init__(self) -> None:
        _check_finite(
            "ProfiledRange",
            min_batch_size=self.min_batch_size,
            max_batch_size=self.max_batch_size,
            min_sum_context=self.min_sum_context,
            max_sum_context=self.max_sum_context,
        )
        if not (0 < self.min_batch_size <= self.max_batch_size and 0 <= self.min_sum_context <= self.max_sum_context):
            raise ValueError(f"ProfiledRange {self}: need 0 < min_batch_size <= max_batch_size, 0 <= min <= max context")

    def contains(self, batch_size: int, sum_context: float) -> bool:
        return (
            self.min_batch_size <= batch_size <= self.max_batch_size
            and self.min_sum_context <= sum_context <= self.max_sum_context
        )

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


class LatencyPredictor:
    """Predicts one decode step's latency on every ladder level, alone and co-located.

    ``phase`` arguments are integer indices from :meth:`phase_index` (0 = the combined
    stage-2 model); resolve names once, outside the per-step path.
    """

    def __init__(
        self,
        ladder: Ladder,
        buckets: BatchSizeBuckets,
        solo: Sequence[SoloCoefficients],
        corun: CoRunCoefficients,
        profiled_range: ProfiledRange,
        corun_by_phase: Mapping[str, CoRunCoefficients] | None = None,
    ):
        if len(solo) != ladder.num_levels:
            raise ValueError(f"LatencyPredictor: {len(solo)} stage-1 models for a ladder of {ladder.num_levels} levels")
        self.ladder = ladder
        self.buckets = buckets
        self.profiled_range = profiled_range
        self._pad_table = buckets.table
        self._pad_limit = buckets.limit
        r = profiled_range
        self._min_bs, self._max_bs = r.min_batch_size, r.max_batch_size
        self._min_ctx, self._max_ctx = r.min_sum_context, r.max_sum_context
        self._fractions = tuple((ladder.decode_fraction(i), ladder.trainer_fraction(i)) for i in range(ladder.num_levels))
        self.phase_names: tuple[str, ...] = (COMBINED_PHASE,) + tuple(sorted(corun_by_phase or ()))
        # The phase index that predicts with the worst per-phase stage-2 model (the combined
        # one when the profile has none): for a step during which any phase may run.
        self.worst_phase = len(self.phase_names) if len(self.phase_names) > 1 else 0
        self.num_queries = 0
        self.num_extrapolated = 0
        self._solo: tuple[SoloCoefficients, ...] = ()
        self._corun: tuple[CoRunCoefficients, ...] = ()
        # _rows[phase][level] = (b0, c0, k0, stage-2 factor): all a prediction reads (one
        # row per phase, then the worst-phase row when there are per-phase models).
        self._rows: tuple[tuple[tuple[float, float, float, float], ...], ...] = ()
        self.update(solo=solo, corun=[corun] + [corun_by_phase[name] for name in self.phase_names[1:]])

    # -- coefficients -----------------------------------------------------------------
    @property
    def solo_coefficients(self) -> tuple[SoloCoefficients, ...]:
        return self._solo

    @property
    def corun_coefficients(self) -> dict[str, CoRunCoefficients]:
        return dict(zip(self.phase_names, self._corun))

    def update(
        self,
        solo: Sequence[SoloCoefficients] | None = None,
        corun: Sequence[CoRunCoefficients] | None = None,
    ) -> None:
        """Replace stage-1 (per level) and/or stage-2 (per phase, in ``phase_names``
        order) coefficients; readers see either the old or the new set, never a mix."""
        new_solo = tuple(self._solo if solo is None else solo)
        new_corun = tuple(self._corun if corun is None else corun)
        if len(new_solo) != self.ladder.num_levels or len(new_corun) != len(self.phase_names):
            raise ValueError(
                f"LatencyPredictor.update: need {self.ladder.num_levels} stage-1 and "
                f"{len(self.phase_names)} stage-2 models, got {len(new_solo)} and {len(new_corun)}"
            )
        rows = tuple(
            tuple((s.b0, s.c0, s.k0, c.factor(fi, ff)) for s, (fi, ff) in zip(new_solo, self._fractions))
            for c in new_corun
        )
        if len(rows) > 1:
            # The worst of the per-phase stage-2 models, as one more row (``worst_phase``):
            # the phases share stage 1, so the worst is the largest factor (for predictions
            # > 0; a prediction <= 0 never fits either way).
            rows += (tuple(
                (b0, c0, k0, max(phase_rows[level][3] for phase_rows in rows[1:]))
                for level, (b0, c0, k0, _) in enumerate(rows[0])
            ),)
        self._solo, self._corun = new_solo, new_corun
        self._rows = rows

    def phase_index(self, phase: str | None) -> int:
        """Index of ``phase``'s stage-2 model; unknown phases and None use the combined one."""
        try:
            return self.phase_names.index(phase) if phase is not None else 0
        except ValueError:
            return 0

    # -- hot path ---------------------------------------------------------------------
    def predict_solo(self, level: int, batch_size: int, sum_context: float) -> float:
        """Stage 1: seconds for one decode step at ``level`` with the trainer paused."""
        self.num_queries += 1
        if not (self._min_bs <= batch_size <= self._max_bs and self._min_ctx <= sum_context <= self._max_ctx):
            self.num_extrapolated += 1
        bs = self._pad_table[batch_size] if batch_size < self._pad_limit else batch_size
        b0, c0, k0, _ = self._rows[0][level]
        return b0 * bs + c0 + k0 * sum_context

    def predict_colo(self, level: int, batch_size: int, sum_context: float, phase: int = 0) -> float:
        """Stage 2: seconds for one decode step at ``level`` with the trainer running."""
        self.num_queries += 1
        if not (self._min_bs <= batch_size <= self._max_bs and self._min_ctx <= sum_context <= self._max_ctx):
            self.num_extrapolated += 1
        bs = self._pad_table[batch_size] if batch_size < self._pad_limit else batch_size
        b0, c0, k0, factor = self._rows[phase][level]
        return factor * (b0 * bs + c0 + k0 * sum_context)

    def predict_levels(self, batch_size: int, sum_context: float, solo_out: list, colo_out: list, phase: int = 0,
                       scale: float = 1.0) -> None:
        """Both stages for every level into the caller's lists (``len >= num_levels``):
        the scheduler's whole per-step query, one call. ``phase`` may be ``worst_phase``;
        ``scale`` multiplies what is written (1e3: milliseconds)."""
        self.num_queries += 1
        if not (self._min_bs <= batch_size <= self._max_bs and self._min_ctx <= sum_context <= self._max_ctx):
            self.num_extrapolated += 1
        bs = self._pad_table[batch_size] if batch_size < self._pad_limit else batch_size
        level = 0
        for b0, c0, k0, factor in self._rows[phase]:
            solo = (b0 * bs + c0 + k0 * sum_context) * scale
            solo_out[level] = solo
            colo_out[level] = factor * solo
            level += 1

    def evaluate(self, level: int, batch_size: int, sum_context: float, phase: int | None = None) -> float:
        """Stage 1 (``phase`` None) or stage 2 without counting the query: for scoring
        measured steps, not for decisions."""
        bs = self.buckets.padded(batch_size)
        b0, c0, k0, factor = self._rows[0 if phase is None else phase][level]
        solo = b0 * bs + c0 + k0 * sum_context
        return solo if phase is None else factor * solo

    # -- reporting --------------------------------------------------------------------
    @property
    def extrapolated_fraction(self) -> float:
        return self.num_extrapolated / self.num_queries if self.num_queries else 0.0

    def extrapolation_report(self) -> str:
        r = self.profiled_range
        return (
            f"{self.num_extrapolated} of {self.num_queries} predictions were outside the profiled range "
            f"(batch size {r.min_batch_size}..{r.max_batch_size}, context sum "
            f"{r.min_sum_context:g}..{r.max_sum_context:g}) and were extrapolated"
        )
