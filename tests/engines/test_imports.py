"""Every module of the transformers engine imports without torch, transformers, peft,
sglang or llamafactory (each imports what it needs where it uses it), so the script's
argument parsing and a CPU-only machine without the extras never load them."""

from __future__ import annotations

from pathlib import Path

from tests.blocked_imports import run_with_blocked

PACKAGE = Path(__file__).resolve().parent.parent.parent / "harvest" / "engines" / "transformers"


def test_every_module_imports_without_torch_or_the_model_stack():
    modules = ["harvest.engines", "harvest.engines.transformers"] + [
        f"harvest.engines.transformers.{path.stem}" for path in sorted(PACKAGE.glob("*.py")) if path.stem != "__init__"]
    assert len(modules) > 10
    out = run_with_blocked(["torch", "transformers", "peft", "sglang", "llamafactory"],
                           f"for module in {modules!r}:\n    importlib.import_module(module)\n")
    assert out.returncode == 0, out.stderr
