"""The fake CUDA driver (tests/compute/fake_libcuda.c): build it, run a script under it.

The real driver is opened once per process with dlopen("libcuda.so.1"), so each case
runs in a fresh interpreter whose LD_LIBRARY_PATH puts the fake first. The fake appends
what it was asked to do to a log and flags misuse with lines starting with "BAD"; its
header says what it models (green contexts for libharvest_greenctx, VMM and events on
streams for libharvest_vmm's cuda backend).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

CUDA_INCLUDE = Path(os.environ.get("CUDA_HOME", "/usr/local/cuda")) / "include"
SOURCE = Path(__file__).parent / "compute" / "fake_libcuda.c"

needs_fake_driver = pytest.mark.skipif(
    shutil.which("gcc") is None or not (CUDA_INCLUDE / "cuda.h").is_file(),
    reason="needs gcc and the CUDA headers to build the fake driver",
)


def build_fake_driver(directory: Path) -> Path:
    """Compile the fake into `directory`/libcuda.so.1; returns `directory`."""
    subprocess.run(
        ["gcc", "-shared", "-fPIC", "-I", str(CUDA_INCLUDE), str(SOURCE), "-o", str(directory / "libcuda.so.1")],
        check=True,
        timeout=120,
    )
    return directory


def run_with_fake_driver(driver_dir: Path, tmp_path: Path, script: str, *, prelude: str = "", allow_bad: bool = False,
                         **knobs) -> tuple[dict, list[str]]:
    """Run `prelude` + `script` (which prints one JSON object last) under the fake; return
    that object and the driver's log. ``knobs`` become FAKE_CUDA_<NAME> variables."""
    log = tmp_path / "driver.log"
    log.unlink(missing_ok=True)
    env = dict(os.environ, LD_LIBRARY_PATH=str(driver_dir), FAKE_CUDA_LOG=str(log))
    env.update({f"FAKE_CUDA_{name.upper()}": str(value) for name, value in knobs.items()})
    out = subprocess.run(
        [sys.executable, "-c", "import ctypes, json\n" + prelude + textwrap.dedent(script)], capture_output=True,
        text=True, env=env, timeout=120,
    )
    assert out.returncode == 0, out.stderr
    lines = log.read_text().splitlines() if log.exists() else []
    if not allow_bad:
        assert not [line for line in lines if line.startswith("BAD")], lines
    return json.loads(out.stdout.strip().splitlines()[-1]), lines


def exit_counts(lines: list[str]) -> dict[str, int]:
    """The counts of live driver objects the fake reports at process exit (its last line)."""
    assert lines and lines[-1].startswith("exit "), lines[-3:]
    return {key: int(value) for key, value in (item.split("=") for item in lines[-1].split()[1:])}
