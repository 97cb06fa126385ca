"""Online refinement: windows, exported error, drift flag, refit (inline and in a thread)."""

from __future__ import annotations

import random

import pytest

from harvest.predict.calibrate import build_profile
from harvest.predict.online import OnlineRefiner, OnlineSettings
from harvest.predict.schema import Grid
from tests.predict.synthetic import BUCKETS, H100_LADDER, TRUE_CORUN, provenance, records, true_solo

SETTINGS = OnlineSettings(window=256, refit_every=64, min_observations=32, drift_threshold=0.08, online_share=0.5)


@pytest.fixture()
def profile():
    return build_profile(provenance(), H100_LADDER, BUCKETS, Grid((4, 16, 64), (64, 128, 256, 512)), records(noise=0.01))


def _feed(refiner: OnlineRefiner, slowdown: float, count: int, seed: int = 0, level: int = 2, phase=None) -> None:
    rng = random.Random(seed)
    solo = true_solo(H100_LADDER)[level]
    factor = 1.0
    if phase is not None:
        c = TRUE_CORUN[phase]
        factor = c.factor(H100_LADDER.decode_fraction(level), H100_LADDER.trainer_fraction(level))
    for _ in range(count):
        bs, ctx = rng.choice((8, 16, 24, 32)), rng.uniform(1000, 12000)
        latency = slowdown * factor * solo.predict(BUCKETS.padded(bs), ctx) * (1 + rng.gauss(0, 0.005))
        refiner.observe(level, bs, ctx, latency, phase)


def test_accurate_model_reports_small_error_and_no_drift(profile):
    refiner = OnlineRefiner.from_profile(profile, SETTINGS)
    _feed(refiner, 1.0, 100)
    _feed(refiner, 1.0, 100, seed=1, phase="forward")
    assert refiner.stage1_error < 0.02 and refiner.stage2_error < 0.02 and refiner.error < 0.02
    assert not refiner.drift and refiner.num_observations == 200


def test_drift_is_flagged_and_a_refit_corrects_the_level(profile):
    refiner = OnlineRefiner.from_profile(profile, SETTINGS)
    _feed(refiner, 1.3, 20)  # the GPU got 30% slower at level 2
    assert not refiner.drift and not refiner.refit_due()  # too few observations to trust the error yet
    _feed(refiner, 1.3, 120, seed=1)
    assert refiner.stage1_error == pytest.approx(0.3 / 1.3, abs=0.03)
    assert refiner.drift and refiner.refit_due()
    before = refiner.predictor.predict_solo(2, 16, 6000.0)
    report = refiner.refit()
    assert report.refitted_levels == (2,) and not report.skipped
    after = refiner.predictor.predict_solo(2, 16, 6000.0)
    truth = 1.3 * true_solo(H100_LADDER)[2].predict(16, 6000.0)
    assert abs(after - truth) < abs(before - truth) / 3  # most of the way to the new truth
    assert refiner.stage1_error < 0.05 and not refiner.drift  # error recomputed under the new model
    # Levels without observations keep the profile's coefficients.
    assert refiner.predictor.solo_coefficients[0] == profile.predictor().solo_coefficients[0]
    assert not refiner.refit_due()
    _feed(refiner, 1.3, SETTINGS.min_observations, seed=2)
    assert not refiner.refit_due()  # after the first refit: every refit_every observations
    _feed(refiner, 1.3, SETTINGS.refit_every - SETTINGS.min_observations, seed=3)
    assert refiner.refit_due()


def test_the_first_refit_is_due_after_min_observations(profile):
    refiner = OnlineRefiner.from_profile(profile, SETTINGS)
    _feed(refiner, 1.3, SETTINGS.min_observations - 1)
    assert not refiner.refit_due()
    _feed(refiner, 1.3, 1, seed=1)
    assert refiner.refit_due()


def test_refit_of_stage2_follows_a_changed_slowdown(profile):
    refiner = OnlineRefiner.from_profile(profile, SETTINGS)
    for level in (1, 3, 4):
        _feed(refiner, 1.25, 80, seed=level, level=level, phase="backward")
    assert refiner.stage2_error > 0.1
    report = refiner.refit()
    assert "backward" in report.refitted_corun and "combined" in report.refitted_corun
    assert refiner.stage2_error < 0.06


def test_bad_measurements_are_rejected_not_stored(profile):
    refiner = OnlineRefiner.from_profile(profile, SETTINGS)
    for bad in (float("nan"), float("inf"), 0.0, -1.0):
        refiner.observe(0, 16, 1000.0, bad)
    assert refiner.num_rejected == 4 and refiner.num_observations == 0 and refiner.error == 0.0


def test_settings_are_validated():
    with pytest.raises(ValueError, match="online_share"):
        OnlineSettings(online_share=1.0)
    with pytest.raises(ValueError, match="window"):
        OnlineSettings(window=2)


def test_try_refit_refits_and_a_failure_keeps_the_model(profile, monkeypatch):
    refiner = OnlineRefiner.from_profile(profile, SETTINGS)
    _feed(refiner, 1.3, 200)
    assert refiner.try_refit() and refiner.num_refits == 1 and refiner.num_refit_failures == 0
    truth = 1.3 * true_solo(H100_LADDER)[2].predict(16, 6000.0)
    assert refiner.predictor.predict_solo(2, 16, 6000.0) == pytest.approx(truth, rel=0.08)
    before = refiner.predictor.predict_solo(2, 16, 6000.0)

    def broken(*args, **kwargs):
        raise MemoryError("no memory for the refit")  # not a FitError: refit itself does not catch it

    monkeypatch.setattr("harvest.predict.online.fit_solo", broken)
    _feed(refiner, 2.0, 200)
    assert not refiner.try_refit() and refiner.num_refit_failures == 1
    assert refiner.predictor.predict_solo(2, 16, 6000.0) == before
