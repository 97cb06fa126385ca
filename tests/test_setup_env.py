"""scripts/setup_env.sh refuses, naming the tool, on a machine that lacks one; and does
so before touching .venv."""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "setup_env.sh"
TOOLS = {"python3.11": "python3.11", "c++": "c++", "cmake": "cmake", "make": "make"}


def _path_without(tmp_path: Path, missing: str) -> str:
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    # Basic utilities the script itself uses, then every tool but the missing one.
    for tool in ["bash", "dirname", "cat", "find", "sort", "xargs", "sha256sum", "cut", *TOOLS]:
        if tool == missing:
            continue
        found = shutil.which(tool)
        if found:
            (bin_dir / tool).symlink_to(found)
    return str(bin_dir)


@pytest.mark.parametrize("missing, message", [
    ("c++", "no C++ compiler (c++/g++) on PATH"),
    ("cmake", "cmake not found on PATH"),
    ("make", "make not found on PATH"),
    ("python3.11", "python3.11 not found"),
])
def test_missing_tool_is_named(tmp_path, missing, message):
    env = {"PATH": _path_without(tmp_path, missing), "HOME": os.environ.get("HOME", "/tmp")}
    out = subprocess.run([shutil.which("bash"), str(SCRIPT)], capture_output=True, text=True, env=env, timeout=60)
    assert out.returncode != 0
    assert message in out.stderr, out.stderr
