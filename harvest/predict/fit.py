"""Fitting the two-stage model with scikit-learn (offline, or online off the decode path).

Both stages are linear least squares weighted by ``1/latency²``, minimising the squared
*relative* error (what MAPE and a QoS margin measure). Stage 1 constrains b0, k0 >= 0:
latency cannot fall as the batch or context grows. Stage 2 is fitted on stage 1's
*predictions* (all the scheduler has at run time), so stage-1 error shows in stage 2's
error instead of hiding. When every co-run sample has the same SM fractions (one level)
only ``b1·SM_infer + k1·SM_ft`` is determined: the minimum-norm solution is kept and the
fit reported as not identifiable. scikit-learn and numpy are imported inside the functions
(importing :mod:`harvest.predict` must not load them).
"""

from __future__ import annotations

import dataclasses
import math
from typing import Sequence

from harvest.predict.buckets import BatchSizeBuckets
from harvest.ladder import Ladder
from harvest.predict.latency_model import COMBINED_PHASE, CoRunCoefficients, SoloCoefficients

MIN_SOLO_SAMPLES = 3
MIN_CORUN_SAMPLES = 2
MIN_PHASE_SAMPLES = 4  # per phase, to consider a separate stage-2 model for it
MIN_CV_SAMPLES = 6
# Per-phase stage-2 models replace the combined one only when their cross-validated
# MAPE is at least this much lower (relative): twice the parameters must earn their keep.
PHASE_MODEL_MIN_GAIN = 0.05


class FitError(ValueError):
    """The samples cannot determine the model (too few, degenerate, or not finite)."""


@dataclasses.dataclass(frozen=True)
class LatencySample:
    """One measured decode step (or the trimmed mean of several at one grid point)."""

    level: int
    batch_size: int
    sum_context: float
    latency_s: float
    phase: str | None = None  # trainer phase running beside it; None for solo samples


@dataclasses.dataclass(frozen=True)
class FitQuality:
    """Relative errors |predicted - measured| / measured over the fitted samples, and the
    k-fold cross-validated MAPE (None below MIN_CV_SAMPLES samples)."""

    num_samples: int
    mape: float
    max_error: float
    cv_mape: float | None = None

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    def describe(self) -> str:
        cv = f", cross-validated {100 * self.cv_mape:.2f}%" if self.cv_mape is not None else ""
        return f"MAPE {100 * self.mape:.2f}%, max {100 * self.max_error:.2f}%{cv} over {self.num_samples} samples"


@dataclasses.dataclass(frozen=True)
class CoRunFit:
    coefficients: CoRunCoefficients
    quality: FitQuality
    identifiable: bool  # False: one (SM_infer, SM_ft) point, only the level's factor is known


@dataclasses.dataclass(frozen=True)
class FittedModels:
    solo: tuple[SoloCoefficients, ...]
    solo_quality: tuple[FitQuality, ...]
    corun: CoRunFit
    corun_by_phase: dict[str, CoRunFit]
    use_phase_models: bool


def relative_errors(predicted: Sequence[float], measured: Sequence[float]) -> list[float]:
    return [abs(p - m) / m for p, m in zip(predicted, measured)]


def _quality(predicted, measured, cv_predicted=None) -> FitQuality:
    errors = relative_errors(predicted, measured)
    cv = None
    if cv_predicted is not None:
        cv_errors = relative_errors(cv_predicted, measured)
        cv = float(sum(cv_errors) / len(cv_errors))
    return FitQuality(len(errors), float(sum(errors) / len(errors)), float(max(errors)), cv)


def _check_samples(what: str, samples: Sequence, minimum: int) -> None:
    if len(samples) < minimum:
        raise FitError(f"{what}: {len(samples)} samples, need at least {minimum}; profile more grid points")
    for index, s in enumerate(samples):
        if not (isinstance(s.latency_s, (int, float)) and math.isfinite(s.latency_s) and s.latency_s > 0):
            raise FitError(
                f"{what}: sample {index} (batch size {s.batch_size}, context sum {s.sum_context}) has latency "
                f"{s.latency_s!r}; latencies must be finite and > 0 (a NaN means the step failed to time)"
            )
        if isinstance(s.batch_size, bool) or not isinstance(s.batch_size, int) or s.batch_size <= 0:
            raise FitError(f"{what}: sample {index} has batch size {s.batch_size!r}; must be an integer > 0")
        if not (isinstance(s.sum_context, (int, float)) and math.isfinite(s.sum_context) and s.sum_context >= 0):
            raise FitError(f"{what}: sample {index} has context sum {s.sum_context!r}; must be finite and >= 0")


def _weights(samples, extra_weights):
    import numpy as np

    weights = np.array([1.0 / (s.latency_s * s.latency_s) for s in samples])
    if extra_weights is not None:
        if len(extra_weights) != len(samples):
            raise FitError(f"{len(extra_weights)} weights for {len(samples)} samples")
        weights = weights * np.asarray(extra_weights, dtype=float)
    return weights


def _cross_validated(model, X, y, weights):
    if len(y) < MIN_CV_SAMPLES:
        return None
    from sklearn.model_selection import KFold, cross_val_predict

    folds = KFold(n_splits=min(5, len(y)), shuffle=True, random_state=0)
    return cross_val_predict(model, X, y, cv=folds, params={"sample_weight": weights})


def solo_regressor():
    """The scikit-learn estimator of stage 1 (features: padded batch size, context sum)."""
    from sklearn.linear_model import LinearRegression

    return LinearRegression(positive=True)


def corun_regressor():
    """The scikit-learn estimator of stage 2 (features: SM_infer·L_solo, SM_ft·L_solo)."""
    from sklearn.linear_model import LinearRegression

    return LinearRegression(fit_intercept=False)


def fit_solo(
    samples: Sequence[LatencySample],
    buckets: BatchSizeBuckets,
    weights: Sequence[float] | None = None,
    what: str = "stage 1",
    cross_validate: bool = True,
) -> tuple[SoloCoefficients, FitQuality]:
    """Fit ``L_solo = b0·bs + c0 + k0·Σctx`` to one level's solo samples. Without
    ``cross_validate`` the quality's cross-validated error is None (an online refit skips
    it: it is three quarters of the fit's time, spent holding the GIL beside decode)."""
    import numpy as np

    _check_samples(what, samples, MIN_SOLO_SAMPLES)
    X = np.array([[buckets.padded(s.batch_size), s.sum_context] for s in samples], dtype=float)
    y = np.array([s.latency_s for s in samples])
    design = np.column_stack([X, np.ones(len(y))])
    if np.linalg.matrix_rank(design) < 3:
        raise FitError(
            f"{what}: the samples span fewer than 3 independent directions of (padded batch size, context "
            f"sum, 1): {len(set(X[:, 0]))} distinct padded batch sizes, {len(set(X[:, 1]))} distinct context "
            f"sums; profile at least two batch sizes that pad differently (buckets {list(buckets.capture_sizes)}) "
            f"and two context lengths"
        )
    w = _weights(samples, weights)
    model = solo_regressor().fit(X, y, sample_weight=w)
    coefficients = SoloCoefficients(b0=float(model.coef_[0]), c0=float(model.intercept_), k0=float(model.coef_[1]))
    cv = _cross_validated(solo_regressor(), X, y, w) if cross_validate else None
    return coefficients, _quality(model.predict(X), y, cv)


def corun_features(samples, ladder: Ladder, buckets: BatchSizeBuckets, solo: Sequence[SoloCoefficients]):
    """Stage-2 design matrix rows ``[SM_infer·L_solo, SM_ft·L_solo]`` for ``samples``."""
    import numpy as np

    rows = []
    for s in samples:
        if not 0 <= s.level < ladder.num_levels:
            raise FitError(f"stage 2: sample at level {s.level}, the ladder has {ladder.num_levels} levels")
        l_solo = solo[s.level].predict(buckets.padded(s.batch_size), s.sum_context)
        rows.append([ladder.decode_fraction(s.level) * l_solo, ladder.trainer_fraction(s.level) * l_solo])
    return np.array(rows, dtype=float)


def fit_corun(
    samples: Sequence[LatencySample],
    ladder: Ladder,
    buckets: BatchSizeBuckets,
    solo: Sequence[SoloCoefficients],
    weights: Sequence[float] | None = None,
    what: str = "stage 2",
    cross_validate: bool = True,
) -> CoRunFit:
    """Fit ``L_colo = (SM_infer·b1 + SM_ft·k1)·L_solo`` to co-run samples (``cross_validate``
    as in :func:`fit_solo`)."""
    import numpy as np

    _check_samples(what, samples, MIN_CORUN_SAMPLES)
    X = corun_features(samples, ladder, buckets, solo)
    if not np.all(np.isfinite(X)) or np.any(X.sum(axis=1) <= 0):
        raise FitError(f"{what}: stage 1 predicts a non-positive solo latency for some co-run sample; refit stage 1")
    y = np.array([s.latency_s for s in samples])
    w = _weights(samples, weights)
    model = corun_regressor().fit(X, y, sample_weight=w)
    coefficients = CoRunCoefficients(b1=float(model.coef_[0]), k1=float(model.coef_[1]))
    cv = _cross_validated(corun_regressor(), X, y, w) if cross_validate else None
    quality = _quality(model.predict(X), y, cv)
    return CoRunFit(coefficients, quality, identifiable=bool(np.linalg.matrix_rank(X) == 2))


def fit_models(
    solo_samples: Sequence[LatencySample],
    corun_samples: Sequence[LatencySample],
    ladder: Ladder,
    buckets: BatchSizeBuckets,
) -> FittedModels:
    """Stage 1 for every level, stage 2 combined, and per-phase stage-2 models when the
    co-run samples carry two or more phases and separate models cross-validate better."""
    solo, solo_quality = [], []
    for level in range(ladder.num_levels):
        level_samples = [s for s in solo_samples if s.level == level]
        coefficients, quality = fit_solo(level_samples, buckets, what=f"stage 1, level {level}")
        solo.append(coefficients)
        solo_quality.append(quality)
    combined = fit_corun(corun_samples, ladder, buckets, solo)

    phases = sorted({s.phase for s in corun_samples if s.phase not in (None, COMBINED_PHASE)})
    by_phase: dict[str, CoRunFit] = {}
    if len(phases) >= 2 and all(sum(s.phase == p for s in corun_samples) >= MIN_PHASE_SAMPLES for p in phases):
        for phase in phases:
            by_phase[phase] = fit_corun(
                [s for s in corun_samples if s.phase == phase], ladder, buckets, solo, what=f"stage 2, phase {phase}"
            )
    use_phase_models = False
    if by_phase and combined.quality.cv_mape is not None and all(f.quality.cv_mape is not None for f in by_phase.values()):
        total = sum(f.quality.num_samples for f in by_phase.values())
        pooled_cv = sum(f.quality.cv_mape * f.quality.num_samples for f in by_phase.values()) / total
        use_phase_models = bool(pooled_cv < combined.quality.cv_mape * (1.0 - PHASE_MODEL_MIN_GAIN))
    return FittedModels(tuple(solo), tuple(solo_quality), combined, by_phase, use_phase_models)
