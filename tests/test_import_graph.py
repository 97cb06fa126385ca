"""The import graph of harvest/: no circles, and serving never reaches the profiler or a
CLI command. Every import counts, the ones inside functions too: a lazy import hides a
circle from Python, not from the next person reading the code."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "harvest"

# What an SGLang server with harvest enabled runs: the plugin entry point and everything
# it reaches. Profiling and CLI commands are separate processes.
SERVING_ENTRY = "harvest.sglang.plugin"
NEVER_SERVING = ("harvest.predict.profiler", "harvest.doctor", "harvest.cli", "harvest.demo")


def _module_name(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _modules() -> dict[str, Path]:
    return {_module_name(path): path for path in PACKAGE.rglob("*.py")}


def import_graph() -> dict[str, set[str]]:
    """module -> the harvest modules it imports (``from pkg import name`` counts as
    ``pkg.name`` when that is a module, else as ``pkg``)."""
    modules = _modules()
    graph: dict[str, set[str]] = {}
    for name, path in modules.items():
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        targets: set[str] = set()
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                targets.update(alias.name for alias in node.names)
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                    base = ".".join(anchor + ([base] if base else []))
                for alias in node.names:
                    candidate = f"{base}.{alias.name}"
                    targets.add(candidate if candidate in modules else base)
        graph[name] = {t for t in targets if t in modules and t != name}
    return graph


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components with more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for succ in sorted(graph[node]):
            if succ not in index:
                visit(succ)
                low[node] = min(low[node], low[succ])
            elif succ in on_stack:
                low[node] = min(low[node], index[succ])
        if low[node] == index[node]:
            component = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                component.append(member)
                if member == node:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return found


def _reachable(graph: dict[str, set[str]], start: str) -> dict[str, str]:
    """Every module reachable from ``start``, with the module that imports it first."""
    seen = {start: ""}
    frontier = [start]
    while frontier:
        node = frontier.pop()
        for succ in sorted(graph[node]):
            if succ not in seen:
                seen[succ] = node
                frontier.append(succ)
    return seen


def test_graph_sees_lazy_and_relative_imports():
    graph = import_graph()
    # hooks imports the runtime inside a function, and the runtime the composition root.
    assert "harvest.sglang.runtime" in graph["harvest.sglang.hooks"]
    assert "harvest.colocate.assemble" in graph["harvest.sglang.runtime"]


def test_no_import_circle_in_harvest():
    cycles = _cycles(import_graph())
    assert not cycles, "import circles (each a set of modules that import each other): " + "; ".join(
        " <-> ".join(c) for c in cycles)


@pytest.mark.parametrize("forbidden", NEVER_SERVING)
def test_serving_never_reaches_the_profiler_or_a_cli_command(forbidden):
    reached = _reachable(import_graph(), SERVING_ENTRY)
    bad = sorted(m for m in reached if m == forbidden or m.startswith(forbidden + "."))
    chains = []
    for module in bad:
        chain = [module]
        while reached[chain[-1]]:
            chain.append(reached[chain[-1]])
        chains.append(" <- ".join(chain))
    assert not bad, "serving imports " + "; ".join(chains)
