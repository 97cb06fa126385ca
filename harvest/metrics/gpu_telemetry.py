"""GPU telemetry through NVML (the ``pynvml`` module of nvidia-ml-py).

``nvmlDeviceGetUtilizationRates`` gives two shares of NVML's last sample period (1/6 s
to 1 s, depending on the product): ``gpu``, the share in which *any* kernel was running
on the device, and ``memory``, the share in which device memory was being read or
written. Neither says how many SMs were busy: one kernel on one SM counts as fully busy.
SM activity and occupancy come from DCGM's profiling counters (dcgm-exporter's
``DCGM_FI_PROF_SM_ACTIVE``, ``DCGM_FI_PROF_SM_OCCUPANCY``; docs/metrics.md). Without a
driver, :func:`open_sampler` returns None and says why; nothing is faked.
"""

from __future__ import annotations

import dataclasses


@dataclasses.dataclass(frozen=True)
class GpuSample:
    busy_ratio: float  # NVML utilization.gpu: share of the period with any kernel running (not SM occupancy)
    memory_busy_ratio: float  # NVML utilization.memory: share of the period with device memory read or written
    memory_used_bytes: int  # device memory in use, every process's


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


def cuda_device_pci_bus_id(device_index: int) -> str | None:
    """The PCI bus id NVML understands ("0000:3B:00.0") of torch's CUDA device
    ``device_index``. NVML numbers devices physically; CUDA ordinals follow
    CUDA_VISIBLE_DEVICES, so the index alone can name another GPU."""
    import torch

    props = torch.cuda.get_device_properties(device_index)
    if not hasattr(props, "pci_bus_id"):
        return None
    return f"{props.pci_domain_id:08X}:{props.pci_bus_id:02X}:{props.pci_device_id:02X}.0"


def open_sampler(device_index: int = 0, pci_bus_id: str | None = None) -> tuple[NvmlSampler | None, str | None]:
    """(sampler, None) on a machine with an NVIDIA driver, else (None, reason). The device is
    found by ``pci_bus_id`` when given (see cuda_device_pci_bus_id), else by NVML index."""
    try:
        import pynvml
    except ImportError as exc:
        return None, f"nvidia-ml-py not installed: {exc}"
    try:
        pynvml.nvmlInit()
        if pci_bus_id is not None:
            handle = pynvml.nvmlDeviceGetHandleByPciBusId(pci_bus_id.encode())
        else:
            handle = pynvml.nvmlDeviceGetHandleByIndex(device_index)
    except pynvml.NVMLError as exc:
        return None, f"NVML unavailable: {exc}"
    return NvmlSampler(pynvml, handle), None
