"""The Partitioner interface: a fixed ladder of SM levels, one selected at a time.

Decode and the trainer run in one process on two threads. PyTorch keeps the current CUDA
stream per thread, so each thread launches its work on its side's stream of the selected
level (``with torch.cuda.stream(level.decode_stream): ...``). A stream of ``None`` means
"the thread's current stream" (CPU, where ``torch.cuda.stream(None)`` is a no-op).

Two implementations: ``GreenContextPartitioner`` (harvest.compute.green_partitioner)
and ``WholeDevicePartitioner`` here. torch is imported only where a CUDA stream is made,
so this module, like the rest of harvest.compute, imports without torch.
"""

from __future__ import annotations

import abc
import dataclasses
from typing import Any

from harvest.compute.ladder import LadderPlan, whole_device_plan

CPU_UNITS = 1


@dataclasses.dataclass(frozen=True)
class Level:
    """One built level. ``spatial``: decode and trainer run on disjoint SM sets of the
    given sizes; otherwise both share the whole device. ``trainer_stream`` is None when
    the trainer has no SMs at this level (it must stay paused)."""

    index: int
    decode_sms: int
    trainer_sms: int
    total_sms: int
    spatial: bool
    decode_stream: Any = None  # torch.cuda.Stream / ExternalStream, or None
    trainer_stream: Any = None

    @property
    def decode_fraction(self) -> float:
        """Share of the device's SMs decode may use (1.0 when shared or whole device)."""
        return 1.0 if not self.spatial else self.decode_sms / self.total_sms

    @property
    def trainer_fraction(self) -> float:
        if not self.spatial:
            return 1.0
        return self.trainer_sms / self.total_sms


class BasePartitioner(abc.ABC):
    """A ladder of levels built once, and the level selected now.

    Contract:
    - ``levels`` is fixed at construction, in ascending decode SMs; the last level
      (``whole_device_index``) gives decode the whole device. ``plan`` is the same ladder
      as pure data (what the scheduler reasons about).
    - ``select(index)`` is O(1) and allocates nothing: it stores a pre-built Level. It is
      one attribute store, so another thread reading ``current`` sees the old or the new
      level, never a torn one. A selection applies to work launched after it.
    - ``close()`` synchronises and releases everything the partitioner created; it is
      idempotent. Streams of a closed partitioner must not be used; ``select`` refuses.
    """

    spatial: bool
    description: str

    def __init__(self, plan: LadderPlan, levels: tuple[Level, ...]) -> None:
        if not levels:
            raise ValueError("a partitioner needs at least one level")
        self.plan = plan
        self.levels = levels
        self._num_levels = len(levels)
        self._current = levels[-1]
        self._closed = False

    @property
    def whole_device_index(self) -> int:
        return self._num_levels - 1

    @property
    def current(self) -> Level:
        return self._current

    @property
    def closed(self) -> bool:
        return self._closed

    def select(self, index: int) -> Level:
        if self._closed:
            raise RuntimeError(f"{type(self).__name__} is closed: build a new one to select levels")
        if not 0 <= index < self._num_levels:
            raise IndexError(f"level index {index} out of range (0..{self._num_levels - 1})")
        self._current = self.levels[index]
        return self._current

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

    spatial = False

    def __init__(self, device: Any = "cpu", reason: str = "CPU device") -> None:
        device_type, device_index = _parse_device(device)
        # A CPU has no SMs; it counts as one unit so that shares (1.0 / 1.0) and the
        # predictor's ladder (harvest.predict.ladder, total_sms > 0) stay well defined.
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
        plan = whole_device_plan(total_sms, reason)
        level = Level(
            index=0,
            decode_sms=total_sms,
            trainer_sms=total_sms,
            total_sms=total_sms,
            spatial=False,
            decode_stream=decode_stream,
            trainer_stream=trainer_stream,
        )
        super().__init__(plan, (level,))

    def _release(self) -> None:
        for stream in (self.levels[0].decode_stream, self.levels[0].trainer_stream):
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
