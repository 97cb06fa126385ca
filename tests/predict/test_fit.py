"""Fitting: known coefficients come back from noisy data; our arithmetic equals sklearn's;
degenerate input is refused with a message that says what to profile."""

from __future__ import annotations

import math
import random

import numpy as np
import pytest

from harvest.predict.buckets import BatchSizeBuckets
from harvest.predict.fit import FitError, LatencySample, corun_features, corun_regressor, fit_corun, fit_models, fit_solo, solo_regressor
from harvest.ladder import Ladder
from harvest.predict.latency_model import LatencyPredictor, ProfiledRange
from tests.predict.synthetic import BUCKETS, H100_LADDER, TRUE_CORUN, records, true_solo


def _samples(stage: str, noise: float, seed: int = 0, **kwargs) -> list[LatencySample]:
    return [r.as_sample() for r in records(noise=noise, seed=seed, **kwargs) if r.stage == stage]


def test_stage1_recovers_known_coefficients_from_noisy_samples():
    samples = _samples("solo", noise=0.01, context_lengths=(32, 64, 128, 256, 512, 1024))
    for level, truth in enumerate(true_solo(H100_LADDER)):
        fitted, quality = fit_solo([s for s in samples if s.level == level], BUCKETS)
        assert fitted.b0 == pytest.approx(truth.b0, rel=0.15)
        assert fitted.c0 == pytest.approx(truth.c0, rel=0.03)
        assert fitted.k0 == pytest.approx(truth.k0, rel=0.10)
        assert quality.mape < 0.01 and quality.max_error < 0.04 and quality.cv_mape < 0.015
        assert quality.num_samples == 18


def test_stage1_is_exact_without_noise():
    samples = _samples("solo", noise=0.0)
    fitted, quality = fit_solo([s for s in samples if s.level == 3], BUCKETS)
    truth = true_solo(H100_LADDER)[3]
    assert (fitted.b0, fitted.c0, fitted.k0) == pytest.approx((truth.b0, truth.c0, truth.k0), rel=1e-6)
    assert quality.mape < 1e-9


def test_stage2_recovers_known_coefficients_per_phase_and_prefers_phase_models():
    solo_samples, corun_samples = _samples("solo", 0.005), _samples("corun", 0.005)
    fitted = fit_models(solo_samples, corun_samples, H100_LADDER, BUCKETS)
    for phase, truth in TRUE_CORUN.items():
        fit = fitted.corun_by_phase[phase]
        assert fit.identifiable
        assert (fit.coefficients.b1, fit.coefficients.k1) == pytest.approx((truth.b1, truth.k1), rel=0.03)
        assert fit.quality.mape < 0.01
    # The two phases slow decode differently: one combined model is visibly worse.
    assert fitted.corun.quality.mape > 2 * max(f.quality.mape for f in fitted.corun_by_phase.values())
    assert fitted.use_phase_models


def test_one_phase_workload_gets_only_the_combined_model():
    corun = _samples("corun", 0.005, phases=("forward",))
    fitted = fit_models(_samples("solo", 0.005), corun, H100_LADDER, BUCKETS)
    assert fitted.corun_by_phase == {} and not fitted.use_phase_models
    truth = TRUE_CORUN["forward"]
    assert (fitted.corun.coefficients.b1, fitted.corun.coefficients.k1) == pytest.approx((truth.b1, truth.k1), rel=0.03)


def test_single_shared_level_fits_the_factor_and_says_it_is_not_identifiable():
    ladder = Ladder.whole_device(1)
    solo = [LatencySample(0, bs, bs * ctx, 1e-3 + 1e-4 * bs + 1e-7 * bs * ctx) for bs in (1, 4, 16) for ctx in (16, 128)]
    corun = [LatencySample(0, s.batch_size, s.sum_context, 1.8 * s.latency_s, "forward") for s in solo]
    fitted = fit_models(solo, corun, ladder, BatchSizeBuckets())
    assert not fitted.corun.identifiable
    c = fitted.corun.coefficients
    assert c.b1 + c.k1 == pytest.approx(1.8, rel=1e-6)  # only the level's factor is determined


def test_our_prediction_equals_sklearn_predict_for_the_same_coefficients():
    solo_samples, corun_samples = _samples("solo", 0.02, seed=3), _samples("corun", 0.02, seed=3)
    level = 2
    level_samples = [s for s in solo_samples if s.level == level]
    X = np.array([[BUCKETS.padded(s.batch_size), s.sum_context] for s in level_samples])
    y = np.array([s.latency_s for s in level_samples])
    sk_solo = solo_regressor().fit(X, y, sample_weight=1 / y**2)
    solo = list(true_solo(H100_LADDER))
    solo[level] = fit_solo(level_samples, BUCKETS)[0]
    corun = fit_corun(corun_samples, H100_LADDER, BUCKETS, solo).coefficients
    predictor = LatencyPredictor(H100_LADDER, BUCKETS, solo, corun, ProfiledRange(4, 64, 0.0, 1e5))
    Xc = corun_features(corun_samples, H100_LADDER, BUCKETS, solo)
    yc = np.array([s.latency_s for s in corun_samples])
    sk_corun = corun_regressor().fit(Xc, yc, sample_weight=1 / yc**2)

    rng = random.Random(7)
    queries = [(rng.randint(1, 100), rng.uniform(0, 60000)) for _ in range(300)]
    ours = [predictor.predict_solo(level, bs, ctx) for bs, ctx in queries]
    theirs = sk_solo.predict(np.array([[BUCKETS.padded(bs), ctx] for bs, ctx in queries]))
    np.testing.assert_allclose(ours, theirs, rtol=1e-12)
    fi, ff = H100_LADDER.decode_fraction(level), H100_LADDER.trainer_fraction(level)
    ours_colo = [predictor.predict_colo(level, bs, ctx) for bs, ctx in queries]
    theirs_colo = sk_corun.predict(np.array([[fi * s, ff * s] for s in theirs]))
    np.testing.assert_allclose(ours_colo, theirs_colo, rtol=1e-12)


def test_too_few_samples_are_refused():
    samples = [LatencySample(0, 4, 256.0, 0.01), LatencySample(0, 16, 1024.0, 0.02)]
    with pytest.raises(FitError, match="2 samples, need at least 3"):
        fit_solo(samples, BUCKETS)
    with pytest.raises(FitError, match="0 samples"):
        fit_corun([], H100_LADDER, BUCKETS, true_solo(H100_LADDER))


@pytest.mark.parametrize("bad", [math.nan, math.inf, 0.0, -1e-3])
def test_non_finite_or_non_positive_latencies_are_refused(bad):
    samples = [LatencySample(0, bs, bs * 100.0, 1e-2) for bs in (4, 16, 64)] + [LatencySample(0, 8, 50.0, bad)]
    with pytest.raises(FitError, match=r"sample 3 .* has latency .*finite and > 0"):
        fit_solo(samples, BUCKETS)


def test_samples_that_cannot_separate_the_coefficients_are_refused():
    # Batch sizes 1..4 all pad to 4 on this ladder's CUDA graphs and the context sum is
    # fixed: no way to tell b0 from c0 from k0.
    samples = [LatencySample(0, bs, 512.0, 0.01 + 0.001 * i) for i, bs in enumerate((1, 2, 3, 4))]
    with pytest.raises(FitError, match="fewer than 3 independent directions.*1 distinct padded batch sizes"):
        fit_solo(samples, BatchSizeBuckets((4, 8)))


def test_negative_slopes_are_clamped_to_zero():
    # Noise that makes latency fall with context: the fitted k0 stays >= 0.
    samples = [LatencySample(0, bs, bs * ctx, 1e-3 * bs + 0.01 - 1e-9 * bs * ctx) for bs in (4, 16) for ctx in (64, 512)]
    fitted, _ = fit_solo(samples, BatchSizeBuckets())
    assert fitted.k0 >= 0.0 and fitted.b0 >= 0.0
