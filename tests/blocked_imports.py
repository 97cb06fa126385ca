"""Run Python code in a fresh interpreter where some top-level packages cannot be imported.

The "policy imports no torch" and "core imports without the serving stack" tests all need
this; the interpreter is fresh so nothing imported by the test process leaks in. The code
runs with ``BLOCKED`` (the list) defined and the import refusal installed.
"""

from __future__ import annotations

import subprocess
import sys
import textwrap

_PRELUDE = """
import importlib, importlib.abc, sys
BLOCKED = {blocked!r}
class _Refuse(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in BLOCKED:
            raise ImportError(name + " is blocked for this test")
sys.meta_path.insert(0, _Refuse())
"""


def run_with_blocked(blocked: list[str], code: str, timeout: float = 120) -> subprocess.CompletedProcess:
    program = _PRELUDE.format(blocked=list(blocked)) + textwrap.dedent(code)
    return subprocess.run([sys.executable, "-c", program], capture_output=True, text=True, timeout=timeout)
