"""The `harvest` command line: version, doctor, and how it treats bad input."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

HARVEST = [sys.executable, "-m", "harvest.cli"]


def run(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([*HARVEST, *args], capture_output=True, text=True, timeout=120)


def test_version():
    import harvest

    out = run("--version")
    assert out.returncode == 0
    assert out.stdout.strip() == f"harvest {harvest.__version__}"


@pytest.mark.parametrize(
    "argv, fragment",
    [
        (["no-such-command"], "invalid choice: 'no-such-command'"),
        (["doctor", "--no-such-option"], "unrecognized arguments: --no-such-option"),
        ([], "a command is required"),
    ],
)
def test_bad_input_exits_2_with_one_line_and_usage(argv, fragment):
    out = run(*argv)
    assert out.returncode == 2
    assert out.stdout == ""
    lines = out.stderr.strip().splitlines()
    assert lines[0].startswith("usage: harvest")
    errors = [line for line in lines if line.startswith("harvest") and "error:" in line]
    assert len(errors) == 1 and fragment in errors[0]


def test_doctor_json_reports_every_field():
    out = run("doctor", "--json")
    assert out.returncode == 0, out.stderr
    report = json.loads(out.stdout)
    assert report["python"] == ".".join(map(str, sys.version_info[:3]))
    for package in ("torch", "sglang", "llamafactory"):
        assert package in report["packages"]
    import torch

    assert report["packages"]["torch"] == torch.__version__
    assert set(report["cuda_driver"]) == {"present", "version"}
    assert isinstance(report["gpu_present"], bool)
    for name in ("vmm", "greenctx"):
        lib = report["native_libraries"][name]
        assert lib["path"] and lib["path"].endswith(f"libharvest_{name}.so"), lib
        assert lib["version"] == "0.1.0"
    if report["gpu_present"]:
        gpu = report["gpus"][0]
        for field in ("name", "sm_count", "compute_capability", "vmm_supported", "green_contexts_supported"):
            assert field in gpu
        assert gpu["sm_count"] > 0
    else:
        assert report["gpus"] == [] and report["no_gpu_reason"]


def test_doctor_text_says_plainly_when_there_is_no_gpu():
    from tests.conftest import gpu_unavailable_reason

    out = run("doctor")
    assert out.returncode == 0, out.stderr
    if gpu_unavailable_reason() is None:
        assert "GPU 0:" in out.stdout
    else:
        assert "GPU: none (" in out.stdout
        assert "CPU mode" in out.stdout
