"""The core imports with torch, numpy and scikit-learn only; policy without torch at all.

Each check runs in a fresh interpreter whose import system refuses the named packages,
so an accidental top-level import anywhere in the module's import graph fails here.
"""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

from tests.blocked_imports import run_with_blocked

HARVEST_DIR = Path(__file__).resolve().parent.parent / "harvest"
OPTIONAL = ["sglang", "llamafactory", "prometheus_client", "peft", "transformers", "pynvml", "cuda"]
CORE_SUBPACKAGES = ["memory", "compute", "predict", "schedule", "train"]
POLICY_SUBPACKAGES = ["predict", "schedule"]


def _import_with_blocked(modules: list[str], blocked: list[str]) -> subprocess.CompletedProcess:
    return run_with_blocked(blocked, f"for module in {modules!r}:\n    importlib.import_module(module)\n")


def _existing(subpackages: list[str]) -> list[str]:
    return [f"harvest.{name}" for name in subpackages if (HARVEST_DIR / name / "__init__.py").is_file()]


def test_top_level_and_cli_need_no_optional_package():
    out = _import_with_blocked(["harvest", "harvest.cli", "harvest.native", "harvest.doctor"], OPTIONAL + ["torch"])
    assert out.returncode == 0, out.stderr


def test_core_imports_without_sglang_llamafactory_prometheus():
    modules = _existing(CORE_SUBPACKAGES)
    if not modules:
        pytest.skip("no core subpackage exists yet")
    # Import every module of each core subpackage, not only its __init__.
    modules += [
        f"harvest.{path.parent.name}.{path.stem}"
        for sub in CORE_SUBPACKAGES
        for path in sorted((HARVEST_DIR / sub).glob("*.py"))
        if path.stem != "__init__" and not path.stem.startswith("cli")
    ]
    out = _import_with_blocked(modules, OPTIONAL)
    assert out.returncode == 0, out.stderr


def test_policy_imports_without_torch():
    modules = _existing(POLICY_SUBPACKAGES)
    if not modules:
        pytest.skip("no policy subpackage exists yet")
    out = _import_with_blocked(modules, OPTIONAL + ["torch"])
    assert out.returncode == 0, out.stderr
