"""ctypes bindings of libharvest_greenctx (csrc/greenctx/hgc.h), status codes -> exceptions.

Every call goes through a plain C ABI, so ctypes releases the GIL around it: creating a
ladder (milliseconds of driver work) never stalls the other Python thread. No torch here:
streams come back as integers (``CUstream`` handles) for the caller to wrap.
"""

from __future__ import annotations

import ctypes
import dataclasses
import functools
import weakref
from collections.abc import Sequence
from types import SimpleNamespace

from harvest import native
from harvest.ladder import GREEN_CONTEXTS, Ladder, Level

HGC_OK, HGC_ERR_INVALID, HGC_ERR_NO_DRIVER, HGC_ERR_DRIVER, HGC_ERR_UNSUPPORTED = range(5)
HGC_MAX_LEVELS = 8  # hgc.h
_STATUS_NAMES = {
    HGC_ERR_INVALID: "invalid argument",
    HGC_ERR_NO_DRIVER: "no driver",
    HGC_ERR_DRIVER: "driver call failed",
    HGC_ERR_UNSUPPORTED: "unsupported",
}


class GreenContextError(RuntimeError):
    """A libharvest_greenctx call failed. ``status`` is its hgc_status."""

    def __init__(self, call: str, status: int, message: str) -> None:
        self.call = call
        self.status = status
        super().__init__(f"{call}: {message}")

    @property
    def status_name(self) -> str:
        return _STATUS_NAMES.get(self.status, f"status {self.status}")


class GreenContextsUnavailable(GreenContextError):
    """This machine cannot partition SMs at all: library missing, no driver, or a driver
    older than green contexts (12.4)."""


class DeviceInfoStruct(ctypes.Structure):
    _fields_ = [
        ("name", ctypes.c_char * 256),
        ("driver_version", ctypes.c_int),
        ("sm_count", ctypes.c_int),
        ("cc_major", ctypes.c_int),
        ("cc_minor", ctypes.c_int),
        ("total_memory_bytes", ctypes.c_uint64),
        ("green_contexts_supported", ctypes.c_int),
        ("min_sm_partition_size", ctypes.c_int),
        ("sm_coscheduled_alignment", ctypes.c_int),
    ]


class LadderInfoStruct(ctypes.Structure):
    _fields_ = [
        ("device_ordinal", ctypes.c_int),
        ("total_sms", ctypes.c_int),
        ("num_levels", ctypes.c_int),
        ("green_stream_api", ctypes.c_int),
    ]


class LevelInfoStruct(ctypes.Structure):
    _fields_ = [
        ("decode_sms", ctypes.c_int),
        ("trainer_sms", ctypes.c_int),
        ("decode_stream", ctypes.c_uint64),
        ("trainer_stream", ctypes.c_uint64),
    ]


@dataclasses.dataclass(frozen=True)
class DeviceProperties:
    ordinal: int
    name: str
    driver_version: int
    sm_count: int
    compute_capability: tuple[int, int]
    total_memory_bytes: int
    green_contexts_supported: bool
    min_sm_partition_size: int  # 0: not reported by the driver
    sm_coscheduled_alignment: int  # 0: not reported by the driver


@functools.lru_cache(maxsize=1)
def _api() -> SimpleNamespace:
    try:
        lib = native.load("greenctx")
    except (native.NativeLibraryNotFound, OSError) as exc:
        raise GreenContextsUnavailable("load libharvest_greenctx", HGC_ERR_NO_DRIVER, str(exc)) from exc
    c_int, ptr = ctypes.c_int, ctypes.POINTER
    handle = ctypes.c_void_p
    return SimpleNamespace(
        last_error=native.bind(lib, "hgc_last_error", ctypes.c_char_p),
        device_info=native.bind(lib, "hgc_device_info", c_int, c_int, ptr(DeviceInfoStruct)),
        split_preview=native.bind(lib, "hgc_split_preview", c_int, c_int, c_int, ptr(c_int), ptr(c_int)),
        ladder_create=native.bind(lib, "hgc_ladder_create", c_int, c_int, ptr(c_int), c_int, ptr(handle)),
        ladder_get_info=native.bind(lib, "hgc_ladder_get_info", c_int, handle, ptr(LadderInfoStruct)),
        ladder_get_level=native.bind(lib, "hgc_ladder_get_level", c_int, handle, c_int, ptr(LevelInfoStruct)),
        ladder_destroy=native.bind(lib, "hgc_ladder_destroy", c_int, handle),
        launch_spin_kernel=native.bind(lib, "hgc_launch_spin_kernel", c_int, ctypes.c_uint64, c_int, c_int),
        spin_kernel_ptx=native.bind(lib, "hgc_spin_kernel_ptx", ctypes.c_char_p),
    )


def _check(call: str, status: int) -> None:
    if status == HGC_OK:
        return
    message = _api().last_error().decode(errors="replace")
    error = GreenContextsUnavailable if status in (HGC_ERR_NO_DRIVER, HGC_ERR_UNSUPPORTED) else GreenContextError
    raise error(call, status, message)


def query_device(ordinal: int) -> DeviceProperties:
    info = DeviceInfoStruct()
    _check(f"hgc_device_info({ordinal})", _api().device_info(ordinal, ctypes.byref(info)))
    return DeviceProperties(
        ordinal=ordinal,
        name=info.name.decode(errors="replace"),
        driver_version=info.driver_version,
        sm_count=info.sm_count,
        compute_capability=(info.cc_major, info.cc_minor),
        total_memory_bytes=info.total_memory_bytes,
        green_contexts_supported=bool(info.green_contexts_supported),
        min_sm_partition_size=info.min_sm_partition_size,
        sm_coscheduled_alignment=info.sm_coscheduled_alignment,
    )


def split_preview(ordinal: int, decode_sms: int) -> tuple[int, int]:
    """(decode SMs, trainer SMs) the driver's split would give for ``decode_sms``."""
    decode, trainer = ctypes.c_int(), ctypes.c_int()
    status = _api().split_preview(ordinal, decode_sms, ctypes.byref(decode), ctypes.byref(trainer))
    _check(f"hgc_split_preview({ordinal}, {decode_sms})", status)
    return decode.value, trainer.value


def launch_spin_kernel(stream: int, num_blocks: int, iterations: int) -> None:
    """Queue the calibration kernel (hgc.h) on ``stream`` (a CUstream handle)."""
    _check("hgc_launch_spin_kernel", _api().launch_spin_kernel(stream, num_blocks, iterations))


def spin_kernel_ptx() -> str:
    return _api().spin_kernel_ptx().decode()


def _destroy(handle: ctypes.c_void_p) -> None:
    if handle.value:
        _api().ladder_destroy(handle)  # frees even on failure; the library logs it
        handle.value = None


class LadderHandle:
    """Owns one hgc_ladder: every green context and stream of a built ladder.

    ``ladder`` is the ladder as the driver provisioned it; its levels carry their raw
    ``CUstream`` handles (integers; the trainer's is None where it has no SMs).
    ``close()`` (or garbage collection, as a last resort) drains and destroys it; any
    ExternalStream wrapping its streams must not be used afterwards.
    """

    def __init__(self, ordinal: int, decode_sms: Sequence[int]) -> None:
        requested = (ctypes.c_int * len(decode_sms))(*decode_sms)
        handle = ctypes.c_void_p()
        status = _api().ladder_create(ordinal, requested, len(decode_sms), ctypes.byref(handle))
        _check(f"hgc_ladder_create({ordinal}, {list(decode_sms)})", status)
        self._handle = handle
        self._finalizer = weakref.finalize(self, _destroy, handle)
        info = LadderInfoStruct()
        _check("hgc_ladder_get_info", _api().ladder_get_info(handle, ctypes.byref(info)))
        self.green_stream_api = bool(info.green_stream_api)
        levels = []
        for index in range(info.num_levels):
            level = LevelInfoStruct()
            _check(f"hgc_ladder_get_level({index})", _api().ladder_get_level(handle, index, ctypes.byref(level)))
            levels.append(Level(level.decode_sms, level.trainer_sms, level.decode_stream, level.trainer_stream or None))
        self.ladder = Ladder(info.total_sms, tuple(levels), GREEN_CONTEXTS)

    def close(self) -> None:
        """Drain and destroy everything; raises GreenContextError if a stream failed to
        drain (the ladder is freed regardless)."""
        if not self._finalizer.alive:
            return
        self._finalizer.detach()
        status = _api().ladder_destroy(self._handle)
        self._handle.value = None
        _check("hgc_ladder_destroy", status)
