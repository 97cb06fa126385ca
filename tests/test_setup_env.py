"""scripts/setup_env.sh refuses, naming the tool, on a machine that lacks one; and does
so before touching .venv. Its --cuda mode likewise names what is missing (a driver, a
Python 3.11/3.12, headers) before touching .venv-cuda."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
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


def _run(args: list[str], env: dict[str, str]) -> subprocess.CompletedProcess:
    return subprocess.run([shutil.which("bash"), str(SCRIPT), *args], capture_output=True, text=True, env=env, timeout=60)


def _cuda_path(tmp_path: Path) -> str:
    """A PATH with what `--cuda` checks first (uname, getconf, a Python 3.11/3.12, c++) and
    no driver tools (nvidia-smi, ldconfig), whatever machine runs the test."""
    minor = f"{sys.version_info[0]}.{sys.version_info[1]}"
    if minor not in ("3.11", "3.12"):
        pytest.skip(f"--cuda wants Python 3.11 or 3.12, this is {minor}")
    bin_dir = tmp_path / "cudabin"
    bin_dir.mkdir()
    for tool in ["bash", "dirname", "uname", "getconf", "c++"]:
        found = shutil.which(tool)
        if found is None:
            pytest.skip(f"{tool} not on PATH")
        (bin_dir / tool).symlink_to(found)
    (bin_dir / f"python{minor}").symlink_to(os.path.realpath(sys.executable))
    return str(bin_dir)


def test_unknown_argument_is_refused():
    out = _run(["--bogus"], dict(os.environ))
    assert out.returncode == 2 and "unknown argument --bogus" in out.stderr, out.stderr
    out = _run(["--cuda", "--bogus"], dict(os.environ))
    assert out.returncode == 1 and "unknown argument --bogus" in out.stderr, out.stderr


def test_cuda_mode_without_a_driver_stops_before_touching_anything(tmp_path):
    venv = tmp_path / "venv-cuda"
    env = {"PATH": _cuda_path(tmp_path), "HOME": str(tmp_path), "HARVEST_CUDA_VENV": str(venv)}
    out = _run(["--cuda"], env)
    assert out.returncode == 1
    assert "no NVIDIA driver: neither nvidia-smi nor libcuda.so.1 found" in out.stderr, out.stderr
    assert "HARVEST_CUDA_NO_DRIVER=1" in out.stderr
    # --no-driver goes past the driver check; bad explicit headers still stop it, first.
    out = _run(["--cuda", "--no-driver"], {**env, "HARVEST_CUDA_HEADERS": str(tmp_path / "none")})
    assert out.returncode == 1 and "has no cuda.h and cudaTypedefs.h" in out.stderr, out.stderr
    assert not venv.exists()


def test_cuda_mode_names_a_wrong_python(tmp_path):
    env = {"PATH": _cuda_path(tmp_path), "HOME": str(tmp_path), "HARVEST_PYTHON": "python3.9-absent",
           "HARVEST_CUDA_VENV": str(tmp_path / "venv-cuda")}
    out = _run(["--cuda"], env)
    assert out.returncode == 1 and "is not a working Python 3.11 or 3.12" in out.stderr, out.stderr
