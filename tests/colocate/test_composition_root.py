"""Every entry point builds the co-location system through harvest.colocate.assemble: a
second hand-wired copy drifts (one did: a GPU script started a predictor refit thread the
server had dropped for causing QoS violations)."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
ROOT_MODULE = ROOT / "harvest" / "colocate" / "assemble.py"
# The control loop's parts. (A harness's baselines may still host a trainer without them:
# scripts/colocate_gpu.py's static and trainer-alone modes; the engine adapter builds its
# own KV lending mechanism.)
WIRED_ONLY_THERE = {"StepController", "QoSController", "OnlineRefiner"}
# The replay simulates the QoS policy offline (no engine, no trainer): it drives the same
# QoSController class directly.
SIMULATION = {ROOT / "harvest" / "replay" / "policies.py": {"QoSController"}}


def _constructions(path: Path) -> set[str]:
    names = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Call):
            func = node.func
            name = func.id if isinstance(func, ast.Name) else func.attr if isinstance(func, ast.Attribute) else None
            if name in WIRED_ONLY_THERE:
                names.add(name)
    return names


def test_only_the_composition_root_wires_the_control_loop():
    sources = sorted((ROOT / "scripts").glob("*.py")) + sorted((ROOT / "harvest").rglob("*.py"))
    offenders = {}
    for path in sources:
        if path == ROOT_MODULE:
            continue
        built = _constructions(path) - SIMULATION.get(path, set())
        if built:
            offenders[str(path.relative_to(ROOT))] = sorted(built)
    assert not offenders, f"build these through harvest.colocate.assemble instead: {offenders}"


def test_the_check_sees_a_hand_wired_loop(tmp_path):
    script = tmp_path / "hand_wired.py"
    script.write_text("from harvest.colocate import StepController\ncontrol = StepController(partitioner=None)\n"
                      "import harvest.schedule as s\nqos = s.QoSController(None, ())\n")
    assert _constructions(script) == {"StepController", "QoSController"}
