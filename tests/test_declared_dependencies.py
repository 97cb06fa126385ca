"""pyproject.toml declares every third-party package harvest/ imports, and nothing it does
not: an import added without its declaration (or a declaration left behind) fails here.

Every import statement counts, the ones inside functions too (most optional packages are
imported where used). Imports at module scope must be core dependencies, since importing
the module needs them; extras (sglang, llamafactory, ...) are imported inside functions.
"""

from __future__ import annotations

import ast
import re
import sys
from pathlib import Path

import pytest

tomllib = pytest.importorskip("tomllib")

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "harvest"
# Import name -> distribution name, where they differ.
DISTRIBUTION = {
    "sklearn": "scikit-learn",
    "yaml": "pyyaml",
    "pynvml": "nvidia-ml-py",
    "prometheus_client": "prometheus-client",
}
# Declared for tooling, not imported by harvest/.
NOT_IMPORTED = {"test": {"pytest", "pytest-timeout", "pytest-xdist"}}


def _canonical(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def _third_party(node: ast.AST) -> list[str]:
    if isinstance(node, ast.Import):
        names = [alias.name for alias in node.names]
    elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
        names = [node.module]
    else:
        return []
    tops = {name.split(".")[0] for name in names}
    return [_canonical(DISTRIBUTION.get(t, t)) for t in tops if t not in sys.stdlib_module_names and t != "harvest"]


def _imports() -> tuple[dict[str, set[str]], dict[str, set[str]]]:
    """(distribution -> modules importing it anywhere, distribution -> modules importing it
    at module scope)."""
    anywhere: dict[str, set[str]] = {}
    module_scope: dict[str, set[str]] = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        tree = ast.parse(path.read_text(), str(path))
        rel = str(path.relative_to(ROOT))
        for node in ast.walk(tree):
            for dist in _third_party(node):
                anywhere.setdefault(dist, set()).add(rel)
        scope_nodes = [n for top in tree.body for n in (ast.walk(top) if isinstance(top, (ast.If, ast.Try)) else [top])]
        for node in scope_nodes:
            for dist in _third_party(node):
                module_scope.setdefault(dist, set()).add(rel)
    return anywhere, module_scope


def _declared() -> tuple[set[str], dict[str, set[str]]]:
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    name = lambda line: _canonical(re.split(r"[\s<>=!~;\[(]", line, maxsplit=1)[0])  # noqa: E731
    core = {name(line) for line in project["dependencies"]}
    extras = {group: {name(line) for line in lines} for group, lines in project["optional-dependencies"].items()}
    return core, extras


def test_every_import_is_declared():
    anywhere, _ = _imports()
    core, extras = _declared()
    declared = core.union(*extras.values())
    missing = {dist: sorted(mods) for dist, mods in anywhere.items() if dist not in declared}
    assert not missing, f"imported but not declared in pyproject.toml: {missing}"


def test_every_declaration_is_imported():
    anywhere, _ = _imports()
    core, extras = _declared()
    unused = {dist for dist in core if dist not in anywhere}
    for group, dists in extras.items():
        unused |= {dist for dist in dists if dist not in anywhere and dist not in NOT_IMPORTED.get(group, set())}
    assert not unused, f"declared in pyproject.toml but imported nowhere in harvest/: {sorted(unused)}"


def test_module_scope_imports_are_core_dependencies():
    _, module_scope = _imports()
    core, _ = _declared()
    outside = {dist: sorted(mods) for dist, mods in module_scope.items() if dist not in core}
    assert not outside, f"imported at module scope but only an optional dependency: {outside}"
