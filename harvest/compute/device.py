"""What the device is, as harvest's own native libraries and torch see it.

:func:`probe_gpus` asks the CUDA driver through libharvest_vmm and libharvest_greenctx
(the driver API opened at run time, so this works, and says so, without a driver);
:func:`device_identity` is the name profiles give a device, used both when a profile is
measured and when a serving process checks the profile it is given.
"""

from __future__ import annotations

import ctypes
import dataclasses
import os
import platform
from pathlib import Path

from harvest import native
from harvest.compute.greenctx_lib import DeviceInfoStruct


class _VmmProbe(ctypes.Structure):
    # Mirrors hvmm_cuda_probe_t in csrc/vmm_allocator/hvmm.h.
    _fields_ = [
        ("driver_version", ctypes.c_int),
        ("device_count", ctypes.c_int),
        ("vmm_supported", ctypes.c_int),
        ("granularity_bytes", ctypes.c_uint64),
    ]


HGC_ERR_NO_DRIVER = 2


@dataclasses.dataclass(frozen=True)
class GpuInfo:
    ordinal: int
    name: str
    sm_count: int
    compute_capability: str
    total_memory_bytes: int
    vmm_supported: bool
    vmm_granularity_bytes: int
    green_contexts_supported: bool
    min_sm_partition_size: int  # 0: not reported by the driver
    sm_coscheduled_alignment: int  # 0: not reported by the driver


def probe_gpus() -> tuple[list[GpuInfo], str | None, int | None]:
    """(GPUs, reason there are none or None, driver version or None)."""
    try:
        hgc = native.load("greenctx")
        hvmm = native.load("vmm")
    except (native.NativeLibraryNotFound, OSError) as exc:
        return [], f"native libraries unavailable: {exc}", None
    device_info = native.bind(hgc, "hgc_device_info", ctypes.c_int, ctypes.c_int, ctypes.POINTER(DeviceInfoStruct))
    hgc_error = native.bind(hgc, "hgc_last_error", ctypes.c_char_p)
    vmm_probe = native.bind(hvmm, "hvmm_cuda_probe", ctypes.c_int, ctypes.c_int, ctypes.POINTER(_VmmProbe))
    vmm_error = native.bind(hvmm, "hvmm_last_error", ctypes.c_char_p)

    probe = _VmmProbe()
    status = vmm_probe(0, ctypes.byref(probe))
    if status == HGC_ERR_NO_DRIVER:
        return [], vmm_error().decode(), None
    if probe.device_count == 0:
        return [], "CUDA driver present but no GPU visible", probe.driver_version
    gpus = []
    for ordinal in range(probe.device_count):
        info = DeviceInfoStruct()
        if device_info(ordinal, ctypes.byref(info)) != 0:
            raise RuntimeError(f"hgc_device_info({ordinal}): {hgc_error().decode()}")
        if vmm_probe(ordinal, ctypes.byref(probe)) != 0:
            raise RuntimeError(f"hvmm_cuda_probe({ordinal}): {vmm_error().decode()}")
        gpus.append(
            GpuInfo(
                ordinal=ordinal,
                name=info.name.decode(errors="replace"),
                sm_count=info.sm_count,
                compute_capability=f"{info.cc_major}.{info.cc_minor}",
                total_memory_bytes=info.total_memory_bytes,
                vmm_supported=bool(probe.vmm_supported),
                vmm_granularity_bytes=probe.granularity_bytes,
                green_contexts_supported=bool(info.green_contexts_supported),
                min_sm_partition_size=info.min_sm_partition_size,
                sm_coscheduled_alignment=info.sm_coscheduled_alignment,
            )
        )
    return gpus, None, probe.driver_version


@dataclasses.dataclass(frozen=True)
class DeviceIdentity:
    kind: str  # "cuda" or "cpu"
    name: str
    compute_capability: str | None
    driver_version: str | None


def _cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def device_identity(device: str) -> DeviceIdentity:
    """The device as profiles name it. A CPU's name includes its core count, since that,
    not an SM ladder, decides how fast it decodes."""
    if device == "cpu":
        return DeviceIdentity("cpu", f"{_cpu_name()} ({os.cpu_count()} logical cores)", None, None)
    import torch

    index = torch.device(device).index or 0
    props = torch.cuda.get_device_properties(index)
    driver = None
    try:
        _, _, driver_version = probe_gpus()
        driver = str(driver_version) if driver_version is not None else None
    except Exception:  # noqa: BLE001 - the driver version is informative, not required
        driver = None
    return DeviceIdentity("cuda", props.name, f"{props.major}.{props.minor}", driver)
