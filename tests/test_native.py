"""Both native libraries build, load without a driver, and report its absence cleanly."""

from __future__ import annotations

import ctypes

import pytest

from harvest import native
from harvest.compute import device
from tests.conftest import gpu_unavailable_reason


@pytest.mark.parametrize("name, prefix", [("vmm", "hvmm"), ("greenctx", "hgc")])
def test_library_loads_and_exports_only_its_c_abi(name, prefix):
    lib = native.load(name)
    version = native.bind(lib, f"{prefix}_version", ctypes.c_char_p)()
    assert version == b"0.1.0"
    # Internal C++ symbols (the shared driver loader) must not leak out of the library.
    with pytest.raises(AttributeError):
        lib._ZN7harvest6driverEv


def test_unknown_library_name_is_refused():
    with pytest.raises(ValueError, match="unknown native library 'nope'"):
        native.load("nope")


def test_missing_library_names_the_fix(monkeypatch, tmp_path):
    monkeypatch.setattr(native, "_candidate_dirs", lambda: [tmp_path])
    with pytest.raises(native.NativeLibraryNotFound, match="make native"):
        native.library_path("vmm")


def test_native_dir_env_must_exist(monkeypatch, tmp_path):
    from harvest import config_env

    monkeypatch.setenv("HARVEST_NATIVE_DIR", str(tmp_path / "missing"))
    with pytest.raises(ValueError, match="HARVEST_NATIVE_DIR"):
        config_env.native_lib_dir()


@pytest.mark.skipif(gpu_unavailable_reason() is None, reason="a GPU is present")
def test_no_driver_is_reported_not_raised():
    gpus, reason, driver_version = device.probe_gpus()
    assert gpus == []
    assert reason  # e.g. "libcuda.so.1 not found (no NVIDIA driver): ..."
    hvmm = native.load("vmm")
    probe = native.bind(hvmm, "hvmm_cuda_probe", ctypes.c_int, ctypes.c_int, ctypes.POINTER(device._VmmProbe))
    last_error = native.bind(hvmm, "hvmm_last_error", ctypes.c_char_p)
    out = device._VmmProbe()
    status = probe(0, ctypes.byref(out))
    if driver_version is None:
        assert status == 2  # HVMM_ERR_NO_DRIVER
        assert b"libcuda.so.1" in last_error() or b"cuInit" in last_error()


def test_null_out_pointer_is_an_error_not_a_crash():
    hvmm = native.load("vmm")
    probe = native.bind(hvmm, "hvmm_cuda_probe", ctypes.c_int, ctypes.c_int, ctypes.c_void_p)
    last_error = native.bind(hvmm, "hvmm_last_error", ctypes.c_char_p)
    assert probe(0, None) == 1  # HVMM_ERR_INVALID
    assert b"out is NULL" in last_error()


@pytest.mark.gpu
def test_gpu_probe_reports_a_real_device():
    gpus, reason, driver_version = device.probe_gpus()
    assert gpus, reason
    assert driver_version and driver_version >= 12000
    assert gpus[0].sm_count > 0
    assert gpus[0].vmm_supported
    assert gpus[0].vmm_granularity_bytes >= 2 * 1024 * 1024
