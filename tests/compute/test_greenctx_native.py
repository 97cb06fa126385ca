"""libharvest_greenctx without a GPU: it loads, reports "no driver" cleanly, checks every
argument before touching the driver, its structs match the ctypes mirrors, and its
calibration kernel's PTX assembles for current GPUs."""

from __future__ import annotations

import ctypes
import re
import shutil
import subprocess
from pathlib import Path

import pytest

from harvest import native
from harvest.compute import greenctx_lib, ladder_planning as ladder
from harvest.compute.greenctx_lib import GreenContextError, GreenContextsUnavailable
from tests.conftest import gpu_unavailable_reason

HEADER = Path(__file__).resolve().parents[2] / "csrc" / "greenctx" / "hgc.h"
no_driver_only = pytest.mark.skipif(gpu_unavailable_reason() is None, reason="a GPU with a driver is present")


@no_driver_only
def test_device_query_reports_no_driver_through_python():
    with pytest.raises(GreenContextsUnavailable) as info:
        greenctx_lib.query_device(0)
    error = info.value
    assert error.status == greenctx_lib.HGC_ERR_NO_DRIVER and error.status_name == "no driver"
    assert "hgc_device_info(0): no driver: libcuda.so.1" in str(error)


@no_driver_only
@pytest.mark.parametrize(
    "call",
    [
        lambda: greenctx_lib.split_preview(0, 64),
        lambda: greenctx_lib.LadderHandle(0, [64, 132]),
        lambda: greenctx_lib.launch_spin_kernel(0x1234, 132, 10),
    ],
    ids=["split_preview", "ladder_create", "spin_kernel"],
)
def test_valid_calls_without_a_driver_say_no_driver(call):
    with pytest.raises(GreenContextsUnavailable, match="no driver: libcuda.so.1") as info:
        call()
    assert info.value.status == greenctx_lib.HGC_ERR_NO_DRIVER


@pytest.mark.parametrize(
    "decode_sms, message",
    [
        ([], "num_levels is 0; a ladder has 1 to 8 levels"),
        (list(range(1, 10)), "num_levels is 9; a ladder has 1 to 8 levels"),
        ([64, 32], r"strictly ascending \(entry 1 is 32 after 64\)"),
        ([64, 64], "strictly ascending"),
        ([0, 64], r"decode_sms\[0\] is 0; decode needs at least 1 SM"),
        ([-8], "decode needs at least 1 SM"),
    ],
)
def test_ladder_arguments_are_checked_before_the_driver(decode_sms, message):
    with pytest.raises(GreenContextError, match=message) as info:
        greenctx_lib.LadderHandle(0, decode_sms)
    assert info.value.status == greenctx_lib.HGC_ERR_INVALID


@pytest.mark.parametrize(
    "call, message",
    [
        (lambda: greenctx_lib.split_preview(0, 0), "decode_sms is 0; decode needs at least 1 SM"),
        (lambda: greenctx_lib.launch_spin_kernel(0, 132, 10), "stream must be a real stream"),
        (lambda: greenctx_lib.launch_spin_kernel(0x1234, 0, 10), r"num_blocks \(0\) and iterations \(10\)"),
        (lambda: greenctx_lib.launch_spin_kernel(0x1234, 1, -5), r"iterations \(-5\) must be >= 1"),
    ],
)
def test_other_arguments_are_checked_before_the_driver(call, message):
    with pytest.raises(GreenContextError, match=message) as info:
        call()
    assert info.value.status == greenctx_lib.HGC_ERR_INVALID


def test_null_handles_are_errors_not_crashes():
    api = greenctx_lib._api()
    assert api.ladder_destroy(None) == greenctx_lib.HGC_OK
    assert api.ladder_get_info(None, ctypes.byref(greenctx_lib.LadderInfoStruct())) == greenctx_lib.HGC_ERR_INVALID
    assert b"must not be NULL" in api.last_error()
    assert api.ladder_get_level(None, 0, None) == greenctx_lib.HGC_ERR_INVALID
    lib = native.load("greenctx")
    create = native.bind(lib, "hgc_ladder_create", ctypes.c_int, ctypes.c_int, ctypes.c_void_p, ctypes.c_int, ctypes.c_void_p)
    assert create(0, None, 1, None) == greenctx_lib.HGC_ERR_INVALID
    preview = native.bind(lib, "hgc_split_preview", ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p)
    assert preview(0, 8, None, None) == greenctx_lib.HGC_ERR_INVALID
    assert b"output pointers must not be NULL" in api.last_error()


def test_header_constants_match_python():
    text = HEADER.read_text()
    assert int(re.search(r"#define HGC_MAX_LEVELS (\d+)", text).group(1)) == ladder.MAX_LEVELS == greenctx_lib.HGC_MAX_LEVELS
    statuses = dict(re.findall(r"(HGC_(?:OK|ERR_\w+)) = (\d+)", text))
    assert {name: int(value) for name, value in statuses.items()} == {
        "HGC_OK": greenctx_lib.HGC_OK,
        "HGC_ERR_INVALID": greenctx_lib.HGC_ERR_INVALID,
        "HGC_ERR_NO_DRIVER": greenctx_lib.HGC_ERR_NO_DRIVER,
        "HGC_ERR_DRIVER": greenctx_lib.HGC_ERR_DRIVER,
        "HGC_ERR_UNSUPPORTED": greenctx_lib.HGC_ERR_UNSUPPORTED,
    }




@pytest.mark.skipif(shutil.which("gcc") is None, reason="needs gcc to compile a layout probe")
def test_struct_layouts_match_the_ctypes_mirrors(tmp_path):
    structs = {
        "hgc_device_info_t": greenctx_lib.DeviceInfoStruct,
        "hgc_ladder_info_t": greenctx_lib.LadderInfoStruct,
        "hgc_level_info_t": greenctx_lib.LevelInfoStruct,
    }
    lines = ['#include <stddef.h>', '#include <stdio.h>', '#include "hgc.h"', "int main(void) {"]
    for c_name, mirror in structs.items():
        lines.append(f'printf("{c_name} size %zu\\n", sizeof({c_name}));')
        for field, _ in mirror._fields_:
            lines.append(f'printf("{c_name} {field} %zu\\n", offsetof({c_name}, {field}));')
    lines += ["return 0;", "}"]
    source = tmp_path / "layout.c"
    source.write_text("\n".join(lines))
    binary = tmp_path / "layout"
    subprocess.run(["gcc", "-I", str(HEADER.parent), str(source), "-o", str(binary)], check=True, timeout=60)
    reported = subprocess.run([str(binary)], capture_output=True, text=True, check=True).stdout.split("\n")
    expected = []
    for c_name, mirror in structs.items():
        expected.append(f"{c_name} size {ctypes.sizeof(mirror)}")
        expected += [f"{c_name} {field} {getattr(mirror, field).offset}" for field, _ in mirror._fields_]
    assert [line for line in reported if line] == expected


def test_spin_kernel_ptx_is_the_entry_the_library_launches():
    ptx = greenctx_lib.spin_kernel_ptx()
    assert ".visible .entry harvest_spin(" in ptx and ".version 7.0" in ptx


@pytest.mark.skipif(shutil.which("ptxas") is None, reason="needs ptxas (CUDA toolkit)")
@pytest.mark.parametrize("arch", ["sm_80", "sm_90"])
def test_spin_kernel_ptx_assembles(tmp_path, arch):
    source = tmp_path / "spin.ptx"
    source.write_text(greenctx_lib.spin_kernel_ptx())
    out = subprocess.run(
        ["ptxas", f"-arch={arch}", "-v", str(source), "-o", str(tmp_path / "spin.cubin")],
        capture_output=True, text=True, timeout=120,
    )
    assert out.returncode == 0, out.stderr
    assert "harvest_spin" in out.stderr  # ptxas -v reports the entry it compiled
