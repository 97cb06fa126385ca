"""GPU telemetry through NVML (the ``pynvml`` module of nvidia-ml-py).

``nvmlDeviceGetUtilizationRates`` gives the share of the last sample period in which a
kernel ran (``gpu``) and in which device memory was read or written (``memory``); the
latter is NVML's memory-bandwidth utilisation. Without a driver, :func:`open_sampler`
returns None and says why; nothing is faked.
"""

from __future__ import annotations

import dataclasses


@dataclasses.dataclass(frozen=True)
class GpuSample:
    sm_utilization: float  # 0..1
    memory_bandwidth_utilization: float  # 0..1
    memory_used_bytes: int


class NvmlSampler:
    def __init__(self, pynvml, handle):
        self._nvml = pynvml
        self._handle = handle

    def sample(self) -> GpuSample:
        rates = self._nvml.nvmlDeviceGetUtilizationRates(self._handle)
        memory = self._nvml.nvmlDeviceGetMemoryInfo(self._handle)
        return GpuSample(rates.gpu / 100.0, rates.memory / 100.0, int(memory.used))

    def close(self) -> None:
        self._nvml.nvmlShutdown()


def open_sampler(device_index: int = 0) -> tuple[NvmlSampler | None, str | None]:
    """(sampler, None) on a machine with an NVIDIA driver, else (None, reason)."""
    try:
        import pynvml
    except ImportError as exc:
        return None, f"nvidia-ml-py not installed: {exc}"
    try:
        pynvml.nvmlInit()
        handle = pynvml.nvmlDeviceGetHandleByIndex(device_index)
    except pynvml.NVMLError as exc:
        return None, f"NVML unavailable: {exc}"
    return NvmlSampler(pynvml, handle), None
