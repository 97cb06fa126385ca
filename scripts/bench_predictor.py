#!/usr/bin/env python
"""Benchmark the latency predictor: cost per prediction and per decision, against
scikit-learn in the same run, and accuracy on held-out grid points of a CPU profile.

- ``predict_ns_median``: one stage-1 prediction (``predict_solo``) of the profile's
  predictor; ``predict_colo_ns_median``: one stage-2 prediction.
- ``decision_ns_median``: ``predict_levels`` — both stages for every level of an
  8-level ladder (the scheduler's whole per-step query). The 8 levels reuse the CPU
  profile's coefficients scaled per level: the arithmetic costs the same for any values.
- ``sklearn_predict_ns_median``: the same stage-1 query through the scikit-learn
  ``LinearRegression`` holding the same coefficients (padding the batch size and
  building the 1x2 input array included, as a caller would have to);
  ``sklearn_predict_prebuilt_ns_median`` with the array built beforehand.
- ``stage1_mape`` / ``stage2_mape``: K-fold over grid points of the profile — each fold
  fits both stages on the other points and predicts the held-out ones.

Each timing is the median over ``--rounds`` of the mean of a tight loop of calls (loop
overhead included). The profile is ``--profile`` (default: the committed CPU profile) or,
with ``--make``, a fresh `harvest profile` run on the tiny model. Last stdout line: JSON.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
DEFAULT_PROFILE = ROOT / "profiles" / "cpu-tiny-llama-sglang.json"


def time_calls(fn, calls: int, rounds: int) -> float:
    """Median over rounds of the mean ns per call."""
    per_call = []
    for _ in range(rounds):
        start = time.perf_counter_ns()
        for _ in range(calls):
            fn()
        per_call.append((time.perf_counter_ns() - start) / calls)
    return statistics.median(per_call)


def held_out_mape(profile, folds: int, seed: int) -> tuple[float, float, int]:
    from harvest.predict.fit import fit_models
    from harvest.predict.latency_model import LatencyPredictor

    records = list(profile.samples)
    order = list(range(len(records)))
    random.Random(seed).shuffle(order)
    solo_errors, colo_errors = [], []
    for fold in range(folds):
        held = {order[i] for i in range(fold, len(order), folds)}
        train = [r.as_sample() for i, r in enumerate(records) if i not in held]
        fitted = fit_models(
            [s for s in train if s.phase is None], [s for s in train if s.phase is not None], profile.ladder, profile.buckets
        )
        by_phase = {k: f.coefficients for k, f in fitted.corun_by_phase.items()} if fitted.use_phase_models else None
        predictor = LatencyPredictor(profile.ladder, profile.buckets, fitted.solo, fitted.corun.coefficients, profile.profiled_range, by_phase)
        for i in held:
            r = records[i]
            if r.stage == "solo":
                predicted = predictor.evaluate(r.level, r.batch_size, r.sum_context)
                solo_errors.append(abs(predicted - r.latency_s) / r.latency_s)
            else:
                predicted = predictor.evaluate(r.level, r.batch_size, r.sum_context, predictor.phase_index(r.phase))
                colo_errors.append(abs(predicted - r.latency_s) / r.latency_s)
    return statistics.fmean(solo_errors), statistics.fmean(colo_errors), len(solo_errors) + len(colo_errors)


def eight_level_predictor(profile):
    from harvest.ladder import GREEN_CONTEXTS, Ladder, Level
    from harvest.predict.latency_model import LatencyPredictor, SoloCoefficients

    base = profile.predictor()
    ladder = Ladder(132, tuple(Level(d, 132 - d) for d in (24, 40, 56, 72, 88, 104, 120)) + (Level(132, 0),), GREEN_CONTEXTS)
    s = base.solo_coefficients[0]
    solo = [SoloCoefficients(s.b0 * 132 / lv.decode_sms, s.c0 * 132 / lv.decode_sms, s.k0 * 132 / lv.decode_sms) for lv in ladder.levels]
    corun = base.corun_coefficients
    by_phase = {k: v for k, v in corun.items() if k != "combined"} or None
    return LatencyPredictor(ladder, profile.buckets, solo, corun["combined"], profile.profiled_range, by_phase)


def sklearn_twin(profile, level: int):
    """A fitted scikit-learn LinearRegression whose coefficients are the profile's."""
    import numpy as np

    from harvest.predict.fit import solo_regressor

    samples = [r for r in profile.samples if r.stage == "solo" and r.level == level]
    X = np.array([[profile.buckets.padded(r.batch_size), r.sum_context] for r in samples])
    y = np.array([r.latency_s for r in samples])
    model = solo_regressor().fit(X, y, sample_weight=1.0 / y**2)
    fit = profile.stage1[level]
    model.coef_ = np.array([fit.b0, fit.k0])
    model.intercept_ = fit.c0
    return model


def make_profile(out: Path) -> None:
    cmd = [sys.executable, "-m", "harvest.cli", "profile", "--model-path", "tiny-llama", "--torch-threads", "1", "--out", str(out)]
    subprocess.run(cmd, check=True, stdout=sys.stderr)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--json", action="store_true", help="print the result as one JSON object on the last line")
    parser.add_argument("--profile", type=Path, default=DEFAULT_PROFILE)
    parser.add_argument("--make", action="store_true", help="measure a fresh CPU profile of the tiny model first")
    parser.add_argument("--rounds", type=int, default=31)
    parser.add_argument("--folds", type=int, default=4)
    args = parser.parse_args()

    import numpy as np

    from harvest.predict.schema import Profile

    path = args.profile
    if args.make:
        path = Path(tempfile.mkdtemp(prefix="harvest-bench-")) / "cpu-tiny.json"
        make_profile(path)
    profile = Profile.load(path)
    predictor = profile.predictor()
    level, bs, ctx = 0, 12, 3000.0
    padded = profile.buckets.padded(bs)

    twin = sklearn_twin(profile, level)
    ours = predictor.predict_solo(level, bs, ctx)
    theirs = float(twin.predict(np.array([[padded, ctx]]))[0])
    if abs(ours - theirs) > 1e-12 * abs(theirs):
        raise SystemExit(f"prediction mismatch: ours {ours!r}, scikit-learn {theirs!r}")

    predict_ns = time_calls(lambda: predictor.predict_solo(level, bs, ctx), 20000, args.rounds)
    predict_colo_ns = time_calls(lambda: predictor.predict_colo(level, bs, ctx), 20000, args.rounds)
    ladder8 = eight_level_predictor(profile)
    solo_out, colo_out = [0.0] * 8, [0.0] * 8
    decision_ns = time_calls(lambda: ladder8.predict_levels(bs, ctx, solo_out, colo_out), 20000, args.rounds)
    buckets = profile.buckets
    sklearn_ns = time_calls(lambda: twin.predict(np.array([[buckets.padded(bs), ctx]])), 300, args.rounds)
    prebuilt = np.array([[padded, ctx]])
    sklearn_prebuilt_ns = time_calls(lambda: twin.predict(prebuilt), 300, args.rounds)
    stage1_mape, stage2_mape, held_out = held_out_mape(profile, args.folds, seed=0)

    result = {
        "predict_ns_median": round(predict_ns, 1),
        "predict_colo_ns_median": round(predict_colo_ns, 1),
        "decision_ns_median": round(decision_ns, 1),
        "decision_levels": ladder8.ladder.num_levels,
        "sklearn_predict_ns_median": round(sklearn_ns, 1),
        "sklearn_predict_prebuilt_ns_median": round(sklearn_prebuilt_ns, 1),
        "speedup_vs_sklearn": round(sklearn_ns / predict_ns, 1),
        "stage1_mape": round(stage1_mape, 4),
        "stage2_mape": round(stage2_mape, 4),
        "held_out_points": held_out,
        "folds": args.folds,
        "profile": str(path.relative_to(ROOT) if path.is_relative_to(ROOT) else path),
        "profile_device": profile.provenance.device_name,
        "profile_engine": profile.provenance.engine,
    }
    print(f"one prediction {predict_ns:.0f} ns (stage 2: {predict_colo_ns:.0f} ns), scikit-learn {sklearn_ns:.0f} ns "
          f"({sklearn_ns / predict_ns:.0f}x slower); decision over {ladder8.ladder.num_levels} levels {decision_ns / 1e3:.2f} us")
    print(f"held-out MAPE ({args.folds}-fold over {held_out} grid points of {path.name}): "
          f"stage 1 {100 * stage1_mape:.2f}%, stage 2 {100 * stage2_mape:.2f}%")
    if args.json:
        print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
