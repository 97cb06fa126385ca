"""The Partitioner interface: a fixed ladder of SM levels, one selected at a time.

Decode and the trainer run in one process on two threads. PyTorch keeps the current CUDA
stream per thread, so each thread launches its work on its side's stream of the selected
level (``with torch.cuda.stream(level.decode_stream): ...``); the levels are
harvest.ladder's, carrying those streams. A stream of ``None`` means
"the thread's current stream" (CPU, where ``torch.cuda.stream(None)`` is a no-op).

Two implementations: ``GreenContextPartitioner`` (harvest.compute.green_partitioner)
and ``WholeDevicePartitioner`` here. torch is imported only where a CUDA stream is made,
so this module, like the rest of harvest.compute, imports without torch.
"""

from __future__ import annotations

import abc
from typing import Any

from harvest.ladder import Ladder, Level

CPU_UNITS = 1


class BasePartitioner(abc.ABC):
    """A ladder of levels built once, and the level selected now.

    Contract:
    - ``ladder`` is fixed at construction (harvest.ladder.Ladder: the whole-device level
      last, ``ladder.whole_device_index``); its levels carry their decode and trainer
      streams.
    - ``select(index)`` is O(1) and allocates nothing: it stores a pre-built
      (index, Level) pair. It is one attribute store, so another thread reading
      ``current``/``current_index`` sees the old or the new level, never a torn one. A
      selection applies to work launched after it.
    - ``close()`` synchronises and releases everything the partitioner created; it is
      idempotent. Streams of a closed partitioner must not be used; ``select`` refuses.
    """

    description: str

    def __init__(self, ladder: Ladder) -> None:
        self.ladder = ladder
        # (index, level) pairs made once, so that select() stores one of them as it is.
        self._selectable = tuple(enumerate(ladder.levels))
        self._num_levels = len(self._selectable)
        self._selected = self._selectable[ladder.whole_device_index]
        self._closed = False

    @property
    def spatial(self) -> bool:
        return self.ladder.spatial

    @property
    def current(self) -> Level:
        return self._selected[1]

    @property
    def current_index(self) -> int:
        return self._selected[0]

    @property
    def closed(self) -> bool:
        return self._closed

    def select(self, index: int) -> Level:
        if self._closed:
            raise RuntimeError(f"{type(self).__name__} is closed: build a new one to select levels")
        if not 0 <= index < self._num_levels:
            raise IndexError(f"level index {index} out of range (0..{self._num_levels - 1})")
        selected = self._selectable[index]
        self._selected = selected
        return selected[1]

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        self._release()

    @abc.abstractmethod
    def _release(self) -> None:
        """Free the partitioner's streams and contexts (called once)."""

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.description})"


class WholeDevicePartitioner(BasePartitioner):
    """One level: no spatial partitioning, decode and trainer share the whole device.

    Used on CPU, and on a GPU where green contexts are unavailable (driver older than
    12.4, planning failed, ...). On a usable CUDA device decode and the trainer get two
    streams of their own, decode's at the highest priority so the GPU's block scheduler
    prefers it; elsewhere both streams are None.
    """

    def __init__(self, device: Any = "cpu", reason: str = "CPU device") -> None:
        device_type, device_index = _parse_device(device)
        # A CPU has no SMs; it counts as one unit so that shares (1.0 / 1.0) and the
        # ladder (harvest.ladder, total_sms > 0) stay well defined.
        total_sms, decode_stream, trainer_stream = CPU_UNITS, None, None
        if device_type == "cuda":
            import torch

            if torch.cuda.is_available():
                device_obj = torch.device("cuda", device_index)
                total_sms = torch.cuda.get_device_properties(device_obj).multi_processor_count
                # Out-of-range priorities clamp to the device's highest (torch.cuda.Stream).
                decode_stream = torch.cuda.Stream(device_obj, priority=-(2**10))
                trainer_stream = torch.cuda.Stream(device_obj)
        self.device = f"{device_type}:{device_index}" if device_type == "cuda" else device_type
        self.reason = reason
        self.description = f"no spatial partitioning on {self.device}: decode and trainer share the device ({reason})"
        super().__init__(Ladder.whole_device(total_sms, reason, decode_stream, trainer_stream))

    def _release(self) -> None:
        level = self.ladder.levels[0]
        for stream in (level.decode_stream, level.trainer_stream):
            if stream is not None:
                stream.synchronize()


def _parse_device(device: Any) -> tuple[str, int]:
    """("cpu", 0) / ("cuda", N) from "cpu", "cuda", "cuda:1", torch.device or an int."""
    if isinstance(device, int) and not isinstance(device, bool):
        if device < 0:
            raise ValueError(f"device={device}: a CUDA device index must be >= 0")
        return "cuda", device
    text = str(device)
    kind, _, index = text.partition(":")
    if kind == "cpu" and not index:
        return "cpu", 0
    if kind == "cuda" and (not index or index.isdigit()):
        return "cuda", int(index or 0)
    raise ValueError(f"device={device!r}: give 'cpu', 'cuda', 'cuda:N' or a CUDA device index")
