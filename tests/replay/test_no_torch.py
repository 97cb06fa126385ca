"""The replay is a planning tool that must run where no serving stack is installed:
every harvest.replay module imports, replays and plots in a fresh interpreter where
torch, scikit-learn and the serving stack are unimportable (numpy and matplotlib are
its only third-party needs)."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.blocked_imports import run_with_blocked

REPLAY_DIR = Path(__file__).resolve().parents[2] / "harvest" / "replay"
BLOCKED = ["torch", "sklearn", "scipy", "sglang", "llamafactory", "transformers", "peft", "prometheus_client"]


@pytest.mark.timeout(120)
def test_replay_runs_without_torch_or_sklearn(tmp_path):
    modules = ["harvest.replay"] + [f"harvest.replay.{p.stem}" for p in sorted(REPLAY_DIR.glob("*.py")) if p.stem != "__init__"]
    assert len(modules) >= 10, modules
    code = (
        f"""
        for module in {modules!r}:
            importlib.import_module(module)
        import argparse
        from harvest.replay import command
        parser = argparse.ArgumentParser()
        command.add_arguments(parser)
        args = parser.parse_args(["--profile", "synthetic-a100", "--max-requests", "40", "--out-dir", {str(tmp_path)!r}, "--no-progress"])
        code = command.run(args)
        assert code == 0, code
        loaded = sorted(m for m in sys.modules if m.split(".")[0] in BLOCKED)
        assert not loaded, loaded
        print("ok")
        """
    )
    out = run_with_blocked(BLOCKED, code, timeout=110)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip().endswith("ok")
    assert (tmp_path / "sm_split.png").is_file()
