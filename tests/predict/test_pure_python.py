"""The predictor is policy: it must import and predict with torch, numpy and scikit-learn
all unimportable (fitting alone may load scikit-learn, lazily)."""

from __future__ import annotations

from harvest.predict.calibrate import build_profile
from harvest.predict.schema import Grid
from tests.blocked_imports import run_with_blocked
from tests.predict.synthetic import BUCKETS, H100_LADDER, provenance, records

BLOCKED = ["torch", "numpy", "sklearn", "scipy", "sglang", "transformers", "peft"]


def test_load_predict_and_observe_without_torch_numpy_or_sklearn(tmp_path):
    path = tmp_path / "profile.json"
    build_profile(provenance(), H100_LADDER, BUCKETS, Grid((4, 16, 64), (64, 128, 256, 512)), records()).save(path)
    code = (
        f"""
        import harvest.predict as hp
        from harvest.predict import calibrate, compat, online, schema, strict_json
        profile = hp.Profile.load({str(path)!r})
        predictor = profile.predictor()
        solo, colo = [0.0] * 8, [0.0] * 8
        predictor.predict_levels(16, 4000.0, solo, colo)
        assert 0 < solo[0] < colo[0], (solo, colo)
        refiner = hp.OnlineRefiner.from_profile(profile)
        refiner.observe(0, 16, 4000.0, solo[0] * 1.1)
        assert 0.05 < refiner.error < 0.15
        try:
            refiner.refit()
        except ImportError as exc:
            print("refit needs:", exc)
        else:
            raise AssertionError("refit ran without scikit-learn?")
        print("ok")
        """
    )
    out = run_with_blocked(BLOCKED, code, timeout=120)
    assert out.returncode == 0, out.stderr
    assert "ok" in out.stdout and "numpy is blocked" in out.stdout
