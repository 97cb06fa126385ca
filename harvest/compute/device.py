"""What the device is, as harvest's own native libraries and torch see it.

:func:`probe_gpus` asks the CUDA driver through libharvest_vmm and libharvest_greenctx
(the driver API opened at run time, so this works, and says so, without a driver);
:func:`cuda_driver_present` says whether a CUDA context could exist in this process at all;
:func:`device_identity` is the name profiles give a device, used both when a profile is
measured and when a serving process checks the profile it is given;
:func:`connections_problem` says when ``CUDA_DEVICE_MAX_CONNECTIONS`` gives the streams
harvest creates too few hardware queues; :func:`on_stream` issues a block's CUDA work on
a stream, or leaves everything as it is.
"""

from __future__ import annotations

import contextlib
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

# CUDA_DEVICE_MAX_CONNECTIONS: how many hardware work queues (connections) the driver gives
# a context; streams beyond that share queues, and work on streams sharing a queue can
# serialise behind each other. cuda.h warns that this holds across green contexts too:
# kernels in disjoint SM partitions "may not run concurrently" because of shared HW
# connections. harvest makes two streams per partial ladder level (decode + trainer), one
# for the whole-device level, a copy stream for the trainer's weight window, beside the
# engine's own, more than the driver's default of 8. 32 is the most the driver accepts,
# and the queues cost next to nothing; an operator's own value always wins (setdefault).
CUDA_CONNECTIONS_VAR = "CUDA_DEVICE_MAX_CONNECTIONS"
CUDA_DEFAULT_CONNECTIONS = 8  # the driver's value when the variable is unset
HARVEST_CUDA_CONNECTIONS = 32  # the driver's maximum
# Streams a process running harvest has besides the ladder's: the engine's (default or
# forward) stream and the trainer window's host-to-device copy stream.
EXTRA_STREAMS = 2


def default_cuda_connections(environ=None) -> str:
    """Set CUDA_DEVICE_MAX_CONNECTIONS to harvest's value unless it is set already (the
    operator's value wins); returns the value in force. Must run before CUDA starts in
    this process: the driver reads it when it creates a context."""
    environ = os.environ if environ is None else environ
    return environ.setdefault(CUDA_CONNECTIONS_VAR, str(HARVEST_CUDA_CONNECTIONS))


def cuda_connections(environ=None) -> int:
    """The connections the driver will give a context here (8 when unset or unreadable)."""
    value = (os.environ if environ is None else environ).get(CUDA_CONNECTIONS_VAR, "")
    return int(value) if value.strip().isdigit() and int(value) > 0 else CUDA_DEFAULT_CONNECTIONS


def ladder_streams(num_levels: int, spatial: bool = True) -> int:
    """Streams harvest creates for a ladder of ``num_levels`` levels plus the ones beside
    it (:data:`EXTRA_STREAMS`): a decode and a trainer stream per partial level, one decode
    stream for the whole-device level; the whole-device fallback makes two."""
    ladder = 2 * (num_levels - 1) + 1 if spatial else 2
    return ladder + EXTRA_STREAMS


def connections_problem(num_streams: int, environ=None) -> str | None:
    """A warning when CUDA_DEVICE_MAX_CONNECTIONS (default 8) is below ``num_streams``
    (the streams harvest will use), else None."""
    environ = os.environ if environ is None else environ
    have = cuda_connections(environ)
    if have >= num_streams:
        return None
    value = environ.get(CUDA_CONNECTIONS_VAR)
    source = f"{CUDA_CONNECTIONS_VAR}={value}" if value else f"{CUDA_CONNECTIONS_VAR} unset (driver default {have})"
    return (
        f"{source}: {have} hardware queues for the {num_streams} CUDA streams harvest uses; streams sharing a "
        f"queue can serialise, so decode and trainer kernels in disjoint green contexts may wait on each other. "
        f"Set {CUDA_CONNECTIONS_VAR}={HARVEST_CUDA_CONNECTIONS} before the process starts CUDA "
        f"(harvest launch and harvest's scripts do when it is unset)"
    )


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


CUDA_DRIVER_LIBRARY = "libcuda.so.1"


def cuda_driver_present() -> bool:
    """Whether this process could load the CUDA driver. Without it nothing in the process
    can create a CUDA context. Loading the library initializes nothing (no ``cuInit``)."""
    try:
        ctypes.CDLL(CUDA_DRIVER_LIBRARY)
    except OSError:
        return False
    return True


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


def on_stream(stream):
    """``with on_stream(stream):`` issues the block's CUDA work on ``stream``; None (a CPU
    device, or the thread's current stream) changes nothing and makes no CUDA call:
    ``torch.cuda.stream(None)`` asks for the current device, which starts CUDA even in a
    process whose work runs on a CPU."""
    if stream is None:
        return contextlib.nullcontext()
    import torch

    return torch.cuda.stream(stream)

