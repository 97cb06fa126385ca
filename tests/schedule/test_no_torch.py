"""Policy imports no torch: every harvest.schedule module imports and decides in a fresh
interpreter where torch, numpy, scikit-learn, scipy and the serving stack are unimportable."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.blocked_imports import run_with_blocked

SCHEDULE_DIR = Path(__file__).resolve().parents[2] / "harvest" / "schedule"
BLOCKED = ["torch", "numpy", "sklearn", "scipy", "sglang", "llamafactory", "transformers", "peft", "prometheus_client"]


@pytest.mark.timeout(120)
def test_schedule_imports_and_decides_without_torch_numpy_sklearn():
    stems = [path.stem for path in sorted(SCHEDULE_DIR.glob("*.py")) if path.stem != "__init__"]
    modules = ["harvest.schedule"] + [f"harvest.schedule.{stem}" for stem in stems]
    assert len(modules) >= 5, modules
    code = (
        f"""
        for module in {modules!r}:
            importlib.import_module(module)
        from harvest.ladder import GREEN_CONTEXTS, Ladder, Level
        from harvest.schedule import QoSController, SchedulerConfig, SchedulerInput, TrainerState
        ladder = Ladder(132, (Level(64, 68), Level(100, 32), Level(132, 0)), GREEN_CONTEXTS)
        ctl = QoSController(SchedulerConfig(hysteresis_steps=1), ladder)
        for state in TrainerState:
            d = ctl.decide(SchedulerInput((37.0, 30.0, 20.0), state, 20.0))
            ctl.observe_measurement(41.0)
        ctl.recent_decisions(); ctl.stats().to_dict()
        loaded = sorted(m for m in sys.modules if m.split(".")[0] in BLOCKED)
        assert not loaded, loaded
        print("ok", d.reason.value)
        """
    )
    out = run_with_blocked(BLOCKED, code, timeout=110)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "ok no_trainer"
