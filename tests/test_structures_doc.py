"""docs/structures.md keeps one line per module: none missing, none for a module that is gone."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
DOC = ROOT / "docs" / "structures.md"


def test_every_module_has_its_line_and_every_line_a_module():
    named = set(re.findall(r"`(harvest/[\w/]+\.py)`", DOC.read_text()))
    files = {str(p.relative_to(ROOT)) for p in (ROOT / "harvest").rglob("*.py")}
    modules = {f for f in files if not f.endswith("/__init__.py")}  # a package's __init__ may have a line
    assert not modules - named, f"modules without a line in docs/structures.md: {sorted(modules - named)}"
    assert not named - files, f"lines for modules that are gone: {sorted(named - files)}"
