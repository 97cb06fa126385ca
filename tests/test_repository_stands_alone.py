"""The repository stands alone: no tracked file reads or names a folder outside it that a
user's clone does not have (the team's notes and data beside the checkout). Recorded
outputs included: a path a measurement ran with is written as the file's name, as the
docs name it."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
# The team's folder beside the checkout, by a relative or an absolute path; the pattern is split so that
# this file does not name it either.
OUTSIDE = re.compile(r"(\.\./|/work/)" + "shared" + r"\b")


# What .gitignore leaves out (build outputs, environments), for a checkout that is not a git work tree.
_UNTRACKED_DIRS = {".git", ".venv", ".venv-cuda", "build", ".cache", "__pycache__", ".pytest_cache", "out", ".whl"}


def _tracked_files() -> list[str]:
    listed = subprocess.run(["git", "ls-files", "-z"], cwd=ROOT, capture_output=True)
    if listed.returncode == 0 and listed.stdout:
        return [name for name in listed.stdout.decode().split("\0") if name]
    names = []
    for path in ROOT.rglob("*"):
        parts = path.relative_to(ROOT).parts
        if path.is_file() and not any(p in _UNTRACKED_DIRS or p.endswith(".egg-info") for p in parts) \
                and parts[:2] != ("harvest", "_native") and path.suffix != ".so":
            names.append(str(path.relative_to(ROOT)))
    return names


def test_no_tracked_file_points_outside_the_repository():
    found = []
    for name in _tracked_files():
        path = ROOT / name
        if path == Path(__file__) or not path.is_file():
            continue
        data = path.read_bytes()
        if b"\0" in data[:8192]:  # binary (images, archives)
            continue
        for number, line in enumerate(data.decode(errors="replace").splitlines(), 1):
            if OUTSIDE.search(line):
                found.append(f"{name}:{number}: {line.strip()[:120]}")
    assert not found, "\n".join(found)
