"""Policies on the same trace: trainer accounting by hand, sanity between policies, the
real scheduler in the loop, and predictor error injection."""

from __future__ import annotations

import dataclasses
import math

import pytest

from harvest.replay import comparison, trainer_model
from harvest.replay.policies import HarvestPolicy, LatencyErrors, PolicyRefused, static_level
from harvest.schedule import QoSController, SchedulerConfig

from tests.replay.helpers import ladder, make_profile, requests, settings

STEADY = requests(*[(0.05 * i, 200, 40) for i in range(40)])  # 2 s of steady load, never idle long


def replay(profile, reqs=STEADY, seed=0, **kwargs):
    return comparison.run(reqs, profile, trainer_model.build(profile), settings(**kwargs), seed)


def test_trainer_model_shares():
    model = trainer_model.build(make_profile())
    assert model.colo_share == pytest.approx((0.6, 0.4, 0.0))
    assert model.idle_share == pytest.approx((0.6, 0.4, 0.0))
    shared = trainer_model.build(make_profile(levels=((1, 1),), total=1, corun=(0.7, 0.7)))
    assert shared.colo_share == pytest.approx((1 - 1 / 1.4,))  # time-sharing: the time decode lost
    assert shared.idle_share == (1.0,)
    assert shared.to_tokens(0.5) is None
    assert trainer_model.build(make_profile(), 1000.0).to_tokens(0.5) == 500.0
    with pytest.raises(ValueError, match="--trainer-tokens-per-s"):
        trainer_model.build(make_profile(), -1.0)


def test_static_takes_the_level_closest_to_60_percent():
    assert static_level(make_profile()) == 1
    assert static_level(make_profile(levels=((18, 90), (36, 72), (54, 54), (72, 36), (90, 18), (108, 0)), total=108)) == 3
    with pytest.raises(PolicyRefused, match="no level where the trainer runs"):
        static_level(dataclasses.replace(make_profile(), ladder=ladder(((100, 0),))))


def test_baselines_by_hand_and_against_each_other():
    result = replay(make_profile())
    static, separate, decode_only = (result.results[n] for n in ("static", "separate", "decode-only"))
    # Static: 40 % of the SMs train during every step and every idle gap.
    assert static.metrics["finetune_per_gpu"] == pytest.approx(0.4)
    assert static.run.kv_capacity_tokens == 600_000
    # Separate: a whole GPU trains alone, over two GPUs.
    assert separate.metrics["finetune_gpu_equivalents"] == pytest.approx(1.0)
    assert separate.metrics["finetune_per_gpu"] == pytest.approx(0.5)
    assert decode_only.metrics["finetune_per_gpu"] == 0.0
    for key in ("tpot_p50_ms", "tpot_p99_ms", "violation_rate", "decode_steps", "kv_held_peak_tokens"):
        assert separate.metrics[key] == decode_only.metrics[key]
    assert decode_only.metrics["tpot_p50_ms"] == pytest.approx(10.0)
    assert static.metrics["tpot_p50_ms"] == pytest.approx(11.6)  # 10 ms × (0.6·1.0 + 0.4·1.4)
    assert static.gain_vs["separate"] == pytest.approx(0.4 / 0.5 - 1)
    assert decode_only.gain_vs == {"separate": -1.0, "static": -1.0}


def test_harvest_with_a_generous_target_runs_the_real_controller_on_the_most_trainer_sms():
    result = replay(make_profile(), target_tpot_ms=1000.0)
    harvest = result.results["harvest"]
    m = harvest.metrics
    # Closest under target = the slowest co-located level = 60 trainer SMs; the first two
    # steps wait out the scheduler's hysteresis (3 steps) on the whole GPU (level 2).
    assert m["steps_by_level"] == {"2": 2, "0": m["decode_steps"] - 2}
    horizon = result.horizon_s
    assert m["finetune_per_gpu"] == pytest.approx(0.6 - 0.6 * 0.020 / horizon)
    assert harvest.gain_vs["static"] > 0.4
    scheduler = harvest.extra["scheduler"]
    assert scheduler["num_decisions"] == scheduler["num_measurements"] == m["decode_steps"]
    assert m["violation_rate"] == 0.0


def test_harvest_pauses_the_trainer_when_no_level_fits():
    # Co-located steps take 11.6 / 12.4 ms, decode alone 10 ms: an 11 ms target fits none.
    result = replay(make_profile(), target_tpot_ms=11.0)
    m = result.results["harvest"].metrics
    assert m["steps_by_level"] == {"2": m["decode_steps"]}  # the whole-device level
    assert m["violation_rate"] == 0.0 and m["tpot_p99_ms"] == pytest.approx(10.0)
    assert result.results["harvest"].extra["scheduler"]["decisions_by_reason"]["none_fits"] == m["decode_steps"]


def test_harvest_policy_holds_a_real_qos_controller():
    profile = make_profile()
    policy = HarvestPolicy(profile, trainer_model.build(profile), LatencyErrors(), SchedulerConfig(target_tpot_ms=40.0))
    assert type(policy.qos) is QoSController
    latency, level, share = policy.step(4, 800)
    assert (level, share, latency) == (2, 0.0, pytest.approx(0.010))  # hysteresis: paused first, on the whole device


# Level 0 (50/50) co-runs at 10 ms × 1.2 = 12 ms, the whole GPU decodes alone in 8 ms.
ERROR_PROFILE = dict(levels=((50, 50), (100, 0)), solo=[(0.0, 0.010, 0.0), (0.0, 0.008, 0.0)], corun=(1.0, 1.4))
LONG = requests((0.0, 100, 400))


def _violations(scale: float, target_tpot_ms: float = 12.9, **scheduler) -> tuple[float, dict]:
    result = replay(make_profile(**ERROR_PROFILE), LONG, target_tpot_ms=target_tpot_ms, error_scale=scale,
                    scheduler_overrides=scheduler)
    harvest = result.results["harvest"]
    return harvest.metrics["violation_rate"], harvest.extra["scheduler"]


def test_injected_error_is_caught_by_the_feedback_margin():
    # True co-located latency 12 × 1.1 = 13.2 ms > 12.9 ms target, predicted 12 ms <= 12.9 × 0.95.
    exact, _ = _violations(1.0)
    assert exact == 0.0
    fixed, _ = _violations(1.1, margin_growth=0.0)
    assert fixed > 0.9
    feedback, stats = _violations(1.1, floor_after_paused_steps=None)
    assert stats["num_colocated_violations"] == 1 and feedback < 0.01
    assert stats["margin"] == pytest.approx(0.1)
    with_floor, stats = _violations(1.1)
    assert 0 < with_floor < 0.1 and stats["decisions_by_reason"]["floor"] == stats["num_colocated_violations"] - 1


def test_error_beyond_the_margin_is_caught_by_the_backoff():
    # Predicted 12 ms fits even the maximum margin's budget (25 × 0.5); true 30 ms > 25 ms.
    without, stats = _violations(2.5, target_tpot_ms=25.0, backoff_steps=None)
    assert without > 0.9 and stats["margin"] == pytest.approx(0.5) and stats["num_backoffs"] == 0
    backoff, stats = _violations(2.5, target_tpot_ms=25.0)
    assert backoff < 0.05 and stats["num_backoffs"] >= 3
    assert stats["decisions_by_reason"]["qos_backoff"] > 300  # of the request's 400 decode steps


def test_noise_is_seeded():
    profile = make_profile()
    a = replay(profile, seed=1, error_noise=0.05, target_tpot_ms=12.5).results["harvest"].metrics
    b = replay(profile, seed=1, error_noise=0.05, target_tpot_ms=12.5).results["harvest"].metrics
    c = replay(profile, seed=2, error_noise=0.05, target_tpot_ms=12.5).results["harvest"].metrics
    assert a == b and a != c
    assert a["tpot_max_ms"] > 12.4  # noise moved some step above anything the profile predicts


def test_shared_single_level_device_by_hand():
    # One shared level (a CPU): decode alone 10 ms, beside the trainer 14 ms; the trainer
    # gets 1 − 1/1.4 of the device while decode runs and all of it while idle.
    profile = make_profile(levels=((1, 1),), total=1, corun=(0.7, 0.7))
    result = replay(profile, requests((0.0, 100, 5)), target_tpot_ms=1000.0)
    share = 1 - 1 / 1.4
    assert result.horizon_s == pytest.approx(0.056)  # static: 4 co-located steps
    assert result.results["static"].metrics["finetune_per_gpu"] == pytest.approx(share)
    # harvest: 2 hysteresis steps alone (10 ms), 2 co-located (14 ms), then idle to the horizon.
    assert result.results["harvest"].metrics["finetune_per_gpu"] == pytest.approx((share * 0.028 + 1.0 * 0.008) / 0.056)


def test_bad_error_settings_are_refused_with_the_flag():
    with pytest.raises(ValueError, match="--error-scale"):
        LatencyErrors(0.0)
    with pytest.raises(ValueError, match="--error-noise"):
        LatencyErrors(1.0, -0.1)
    with pytest.raises(ValueError, match="hysteresis_steps"):
        replay(make_profile(), scheduler_overrides={"hysteresis_steps": 0})
    with pytest.raises(ValueError, match="unknown key"):
        replay(make_profile(), scheduler_overrides={"hysteresis": 1})
    assert not math.isnan(replay(make_profile(), policies=("static",)).horizon_s)


def test_a_trace_without_decode_steps_still_reports():
    result = replay(make_profile(), requests((0.0, 10, 1), (1.0, 10, 1)))  # prefill-only requests
    assert result.horizon_s == 1.0
    for name, expected in (("harvest", 0.6), ("static", 0.4), ("separate", 0.5), ("decode-only", 0.0)):
        m = result.results[name].metrics
        assert m["decode_steps"] == 0 and m["requests_prefill_only"] == 2
        assert m["finetune_per_gpu"] == pytest.approx(expected)


def _with_phase_models(profile, forward: tuple[float, float], backward: tuple[float, float]):
    from harvest.predict.latency_model import CoRunCoefficients, LatencyPredictor

    predictor = LatencyPredictor(profile.ladder, profile.buckets, profile.solo, profile.corun, profile.profiled_range,
                                 corun_by_phase={"forward": CoRunCoefficients(*forward), "backward": CoRunCoefficients(*backward)})
    return dataclasses.replace(profile, predictor=predictor)


def test_harvest_decides_with_the_worst_phase_model_as_the_runtime_does():
    base = make_profile(**ERROR_PROFILE)
    combined_ms = base.predictor.predict_colo(0, 1, 100) * 1e3
    profile = _with_phase_models(base, forward=(1.0, 2.0), backward=(1.0, 1.0))
    solo, colo = [0.0] * 2, [0.0] * 2
    profile.predictor.predict_levels(1, 100, solo, colo, profile.predictor.worst_phase, 1e3)
    assert colo[0] > combined_ms
    # A target the combined model fits under (with the scheduler's margin) but the worst
    # phase does not: the runtime never co-locates, and neither does the replay.
    target = (combined_ms + colo[0]) / 2 / (1 - SchedulerConfig().initial_margin)
    assert combined_ms < target * (1 - SchedulerConfig().initial_margin) < colo[0]
    result = replay(profile, LONG, target_tpot_ms=target)
    m = result.results["harvest"].metrics
    assert m["steps_by_level"] == {"1": m["decode_steps"]}  # the whole-device level
    # The combined-only profile runs the trainer at the same target.
    assert replay(base, LONG, target_tpot_ms=target).results["harvest"].metrics["steps_by_level"].get("0", 0) > 0
