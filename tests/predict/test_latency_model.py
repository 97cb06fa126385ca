"""The predictor's arithmetic: buckets, both stages, all-level queries, counting, swaps."""

from __future__ import annotations

import random

import pytest

from harvest.predict.buckets import BatchSizeBuckets
from harvest.ladder import Ladder, Level
from harvest.predict.latency_model import CoRunCoefficients, LatencyPredictor, ProfiledRange, SoloCoefficients
from tests.predict.synthetic import BUCKETS, H100_LADDER, TRUE_CORUN, true_solo

RANGE = ProfiledRange(4, 64, 256.0, 33000.0)


def make_predictor(by_phase=True) -> LatencyPredictor:
    return LatencyPredictor(H100_LADDER, BUCKETS, true_solo(H100_LADDER), TRUE_CORUN["forward"], RANGE, TRUE_CORUN if by_phase else None)


def test_buckets_pad_to_the_next_capture_size_and_leave_larger_batches_alone():
    buckets = BatchSizeBuckets((1, 2, 4, 8, 16, 24, 32))
    assert [buckets.padded(b) for b in range(1, 10)] == [1, 2, 4, 4, 8, 8, 8, 8, 16]
    assert buckets.padded(24) == 24 and buckets.padded(25) == 32 and buckets.padded(33) == 33 and buckets.padded(500) == 500
    assert [BatchSizeBuckets().padded(b) for b in (1, 3, 64)] == [1, 3, 64]


@pytest.mark.parametrize("sizes", [(4, 2), (0, 4), (2, 2), (1.5,)])
def test_buckets_reject_bad_capture_sizes(sizes):
    with pytest.raises(ValueError, match="bucket"):
        BatchSizeBuckets(sizes)


def test_solo_and_colo_equal_the_formulas_with_padding():
    predictor = make_predictor()
    solo = true_solo(H100_LADDER)
    rng = random.Random(1)
    for _ in range(500):
        level, bs, ctx = rng.randrange(H100_LADDER.num_levels), rng.randint(1, 80), rng.uniform(0, 40000)
        padded = BUCKETS.padded(bs)
        expected_solo = solo[level].b0 * padded + solo[level].c0 + solo[level].k0 * ctx
        assert predictor.predict_solo(level, bs, ctx) == pytest.approx(expected_solo, rel=1e-12)
        for phase_name in ("forward", "backward"):
            c = TRUE_CORUN[phase_name]
            factor = H100_LADDER.decode_fraction(level) * c.b1 + H100_LADDER.trainer_fraction(level) * c.k1
            colo = predictor.predict_colo(level, bs, ctx, predictor.phase_index(phase_name))
            assert colo == pytest.approx(factor * expected_solo, rel=1e-12)


def test_padding_makes_small_batches_cost_the_same():
    predictor = make_predictor()
    assert predictor.predict_solo(0, 3, 1000) == predictor.predict_solo(0, 4, 1000)
    assert predictor.predict_solo(0, 4, 1000) < predictor.predict_solo(0, 5, 1000)


def test_predict_levels_matches_single_predictions_and_fills_in_place():
    predictor = make_predictor()
    solo_out, colo_out = [0.0] * 8, [0.0] * 8
    for phase in range(len(predictor.phase_names)):
        predictor.predict_levels(20, 5000.0, solo_out, colo_out, phase)
        for level in range(H100_LADDER.num_levels):
            assert solo_out[level] == predictor.predict_solo(level, 20, 5000.0)
            assert colo_out[level] == predictor.predict_colo(level, 20, 5000.0, phase)
    assert solo_out[7] == 0.0  # the ladder has 7 levels: the spare slot is untouched


def test_worst_phase_predicts_the_larger_of_the_per_phase_models_and_follows_updates():
    predictor = make_predictor()
    assert predictor.worst_phase == len(predictor.phase_names) and make_predictor(by_phase=False).worst_phase == 0
    solo_out, colo_out = [0.0] * 7, [0.0] * 7
    for bs, ctx in [(1, 0.0), (20, 5000.0), (64, 33000.0)]:
        predictor.predict_levels(bs, ctx, solo_out, colo_out, predictor.worst_phase, 1e3)
        for level in range(H100_LADDER.num_levels):
            phases = [predictor.predict_colo(level, bs, ctx, predictor.phase_index(p)) for p in ("forward", "backward")]
            assert colo_out[level] == pytest.approx(max(phases) * 1e3, rel=1e-12)  # scale: milliseconds
            assert solo_out[level] == pytest.approx(predictor.predict_solo(level, bs, ctx) * 1e3, rel=1e-12)
    # The worst row is rebuilt with the coefficients (online refits).
    heavier = CoRunCoefficients(TRUE_CORUN["backward"].b1 * 3, TRUE_CORUN["backward"].k1 * 3)
    predictor.update(corun=[TRUE_CORUN["forward"], heavier, TRUE_CORUN["forward"]])
    predictor.predict_levels(20, 5000.0, solo_out, colo_out, predictor.worst_phase)
    assert colo_out[0] == predictor.predict_colo(0, 20, 5000.0, predictor.phase_index("backward"))


def test_phase_names_and_unknown_phase_use_the_combined_model():
    predictor = make_predictor()
    assert predictor.phase_names == ("combined", "backward", "forward")
    assert predictor.phase_index(None) == 0 and predictor.phase_index("mixed") == 0
    assert predictor.phase_index("backward") == 1
    assert make_predictor(by_phase=False).phase_names == ("combined",)


def test_queries_outside_the_profiled_range_are_answered_and_counted():
    predictor = make_predictor()
    predictor.predict_solo(0, 16, 1000.0)
    assert (predictor.num_queries, predictor.num_extrapolated) == (1, 0)
    predictor.predict_solo(0, 128, 1000.0)  # batch above the range
    predictor.predict_colo(0, 2, 1000.0)  # batch below
    predictor.predict_levels(16, 1e6, [0.0] * 7, [0.0] * 7)  # context above
    assert (predictor.num_queries, predictor.num_extrapolated) == (4, 3)
    assert predictor.predict_solo(0, 128, 1e6) > predictor.predict_solo(0, 64, 33000.0)  # extrapolated, not clamped
    assert predictor.extrapolated_fraction == pytest.approx(4 / 6)
    assert "4 of 6 predictions were outside the profiled range" in predictor.extrapolation_report()
    before = predictor.num_queries
    predictor.evaluate(0, 500, 1e7)
    assert predictor.num_queries == before  # scoring measured steps is not a decision


def test_update_swaps_coefficients_and_validates_counts():
    predictor = make_predictor(by_phase=False)
    new_solo = [SoloCoefficients(1e-3, 1e-2, 0.0)] * H100_LADDER.num_levels
    predictor.update(solo=new_solo, corun=[CoRunCoefficients(1.0, 1.0)])
    assert predictor.predict_solo(2, 64, 0.0) == pytest.approx(64e-3 + 1e-2)
    assert predictor.predict_colo(2, 64, 0.0) == pytest.approx((64 / 132 + 68 / 132) * (64e-3 + 1e-2))
    with pytest.raises(ValueError, match="stage-1"):
        predictor.update(solo=new_solo[:2])
    assert predictor.predict_solo(2, 64, 0.0) == pytest.approx(64e-3 + 1e-2)  # unchanged after the refusal


def test_bad_coefficients_and_ladders_are_refused_naming_the_field():
    with pytest.raises(ValueError, match="SoloCoefficients.k0"):
        SoloCoefficients(1.0, 1.0, float("nan"))
    with pytest.raises(ValueError, match="CoRunCoefficients.b1"):
        CoRunCoefficients(float("inf"), 1.0)
    with pytest.raises(ValueError, match="levels is empty"):
        Ladder(132, ())
    with pytest.raises(ValueError, match="more SMs"):
        Ladder(132, (Level(140, 0),))
    with pytest.raises(ValueError, match="decode_sms=0"):
        Level(0, 132)
    with pytest.raises(ValueError, match="3 stage-1 models for a ladder of 7"):
        LatencyPredictor(H100_LADDER, BUCKETS, true_solo(H100_LADDER)[:3], TRUE_CORUN["forward"], RANGE)


def test_whole_device_ladder_shares_the_device():
    ladder = Ladder.whole_device(1)
    assert (ladder.decode_fraction(0), ladder.trainer_fraction(0)) == (1.0, 1.0)
    assert Ladder.from_dict(ladder.to_dict()) == ladder
