"""The probe that asks a GPU whether cuMemSetAccess can take access away from mapped
memory (harvest.memory.revoke_probe, csrc/vmm_allocator/revoke_probe.cpp): its verdict
from the driver's answers, its command without a driver, its driver calls against the
fake driver (legal, every resource released, the failing call named), its kernel's PTX,
and on a GPU the answer itself."""

from __future__ import annotations

import ctypes
import json
import shutil
import subprocess
import sys

import pytest

from harvest import native
from harvest.compute.device import cuda_driver_present
from harvest.memory import revoke_probe
from tests import fake_cuda

ILLEGAL_ADDRESS = 700  # CUDA_ERROR_ILLEGAL_ADDRESS


@pytest.fixture(scope="module")
def fake_driver_dir(tmp_path_factory):
    return fake_cuda.build_fake_driver(tmp_path_factory.mktemp("fake_cuda"))


def _raw(**changes) -> dict:
    """The fields of a probe that reached every question and saw the revoke protect."""
    raw = dict(pages=64, page_bytes=2 << 20, alias_reads_primary=1, revoke_result=0, first_revoke_us=41.5,
               primary_works_after_revoke=1, regrant_result=0, alias_works_after_regrant=1, timed_repeats=20,
               revoke_us_median=30.25, grant_us_median=35.0, fault_tried=1, write_after_revoke_result=ILLEGAL_ADDRESS)
    raw.update(changes)
    return raw


def _name(code: int) -> str:
    return {ILLEGAL_ADDRESS: "CUDA_ERROR_ILLEGAL_ADDRESS", 1: "CUDA_ERROR_INVALID_VALUE"}[code]


@pytest.mark.parametrize("changes, protects", [
    ({}, True),
    ({"write_after_revoke_result": 0}, False),  # accepted, but the write went through: no protection
    ({"primary_works_after_revoke": 0}, False),  # the revoke broke the other mapping of the same pages
    ({"alias_works_after_regrant": 0}, False),
    ({"alias_reads_primary": 0}, False),
    ({"revoke_result": 1, "primary_works_after_revoke": -1, "regrant_result": -1, "alias_works_after_regrant": -1,
      "revoke_us_median": -1.0, "grant_us_median": -1.0, "timed_repeats": 0, "fault_tried": 0,
      "write_after_revoke_result": 0}, False),  # refused
    ({"fault_tried": 0, "write_after_revoke_result": 0}, None),  # --no-fault: not asked
])
def test_the_verdict_needs_every_answer(changes, protects):
    result = revoke_probe.describe(_raw(**changes), _name)
    assert result["revoke_protects"] is protects
    assert json.loads(json.dumps(result)) == result  # one JSON line, as the command prints it


def test_the_answers_are_named():
    result = revoke_probe.describe(_raw(), _name)
    assert result["revoke"] == "CUDA_SUCCESS" and result["regrant"] == "CUDA_SUCCESS"
    assert result["write_after_revoke"] == "CUDA_ERROR_ILLEGAL_ADDRESS"
    assert result["revoke_us_median"] == 30.25 and result["primary_works_after_revoke"] is True
    refused = revoke_probe.describe(_raw(revoke_result=1, regrant_result=-1, primary_works_after_revoke=-1,
                                         alias_works_after_regrant=-1, revoke_us_median=-1.0, fault_tried=0), _name)
    assert refused["revoke"] == "CUDA_ERROR_INVALID_VALUE" and refused["revoke_accepted"] is False
    assert refused["regrant"] is None and refused["primary_works_after_revoke"] is None
    assert refused["revoke_us_median"] is None and refused["write_after_revoke"] is None


@pytest.mark.skipif(cuda_driver_present(), reason="a CUDA driver is present: the GPU test asks it")
def test_without_a_driver_the_command_says_so_and_the_caller_gets_a_reason():
    done = subprocess.run([sys.executable, "-m", "harvest.memory.revoke_probe"], capture_output=True, text=True,
                          timeout=60)
    assert done.returncode == 2, done.stderr
    assert json.loads(done.stdout.splitlines()[-1])["error"].startswith("no CUDA driver or GPU: ")
    assert revoke_probe.probe_in_child()["error"].startswith("no CUDA driver or GPU: ")


def test_bad_arguments_are_refused_naming_them():
    done = subprocess.run([sys.executable, "-m", "harvest.memory.revoke_probe", "--pages", "0"], capture_output=True,
                          text=True, timeout=60)
    assert done.returncode == 2 and "--pages must be >= 1" in done.stderr
    lib = native.load("vmm")
    run = native.bind(lib, "hvmm_cuda_probe_revoke", ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_int,
                      ctypes.c_int, ctypes.c_void_p)
    assert run(0, 64, 20, 0, None) == 1  # HVMM_ERR_INVALID, before any driver call
    assert b"out must not be NULL" in native.bind(lib, "hvmm_last_error", ctypes.c_char_p)()


@fake_cuda.needs_fake_driver
def test_against_the_fake_driver_every_call_is_legal_and_everything_is_released(fake_driver_dir, tmp_path):
    """The fake has no memory behind its addresses and knows only the spin kernel, so the
    probe stops at loading its own kernel: the reservations, pages, double mappings and
    access grants before it must be what the driver accepts, and all of it released."""
    result, lines = fake_cuda.run_with_fake_driver(fake_driver_dir, tmp_path, """
        from harvest.memory import revoke_probe
        try:
            revoke_probe.probe(pages=4, repeats=2)
        except RuntimeError as exc:
            print(json.dumps({"error": str(exc)}))
    """)
    assert "cuLibraryLoadData" in result["error"] and "CUDA_ERROR_INVALID_VALUE" in result["error"]
    assert sum(line.startswith("mem_map ") for line in lines) == 8  # 4 pages, each at two addresses
    assert sum(line.startswith("mem_set_access ") for line in lines) == 2  # one grant per run
    counts = fake_cuda.exit_counts(lines)
    assert counts["live_reserves"] == counts["live_pages"] == counts["mapped"] == counts["primary_refs"] == 0, counts


@pytest.mark.skipif(shutil.which("ptxas") is None, reason="needs ptxas (CUDA toolkit)")
@pytest.mark.parametrize("arch", ["sm_80", "sm_90"])
def test_the_probe_kernel_ptx_assembles(tmp_path, arch):
    ptx = native.bind(native.load("vmm"), "hvmm_poke_kernel_ptx", ctypes.c_char_p)().decode()
    assert ".visible .entry harvest_poke(" in ptx and ".version 7.0" in ptx
    source = tmp_path / "poke.ptx"
    source.write_text(ptx)
    out = subprocess.run(["ptxas", f"-arch={arch}", "-v", str(source), "-o", str(tmp_path / "poke.cubin")],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert "harvest_poke" in out.stderr


@pytest.mark.gpu
def test_on_a_gpu_the_probe_reaches_every_question():
    """The answer is the measurement (recorded in docs/gpu-validation.md); what must hold
    whatever it is: two mappings of the same pages see the same bytes, and the probe
    either ran to its end or says which call the driver refused."""
    result = revoke_probe.probe_in_child(pages=8, repeats=5)
    assert "error" not in result, result
    assert result["alias_reads_primary"] is True
    print("GPU-VALIDATION revoke-probe " + json.dumps(result))
    if result["revoke_accepted"]:
        assert result["primary_works_after_revoke"] is True and result["revoke_protects"] is not None
