"""The frozen-weight window: W stages of frozen weights resident on the device.

A *stage* is the embedding, one decoder layer, or the final norm + LM head, its frozen
tensors in one contiguous buffer from a `BaseWindowAllocator`. Before every unit the
trainer names the stage that runs now and those next; the window keeps the next W distinct
stages resident, dropping the others (frozen: never copied back) and loading missing ones
(the current at once, the rest as prefetches on a copy stream ordered by events).
Parameters are swapped in place: an evicted stage's modules hold meta-device placeholders.
Invariant that makes eviction safe: a buffer's memory is handed to anyone else only when
no tensor of autograd's views it. Where eviction can reuse memory that autograd views
(`needs_saved_tensor_hooks`), `saved_tensor_hooks()` stores a handle for every saved
tensor in a window buffer and backward rebuilds it from whatever buffer holds that stage
then.
"""

from __future__ import annotations

import bisect
import contextlib
import dataclasses
import time
from typing import Iterable, Sequence

import torch
from torch import nn

from harvest.train.errors import WindowMemoryUnavailable
from harvest.train.weights import BaseWeightSource, FrozenWeightSpec
from harvest.train.window_memory import ALIGNMENT_BYTES, BaseWindowAllocator


@dataclasses.dataclass(frozen=True, eq=False)
class FrozenSlot:
    """One frozen tensor of a stage: the module attribute it fills and its place in the buffer."""

    name: str  # base-model state-dict name (the weight source's key)
    module: nn.Module
    attr: str
    shape: tuple[int, ...]
    dtype: torch.dtype
    offset_bytes: int

    @property
    def num_bytes(self) -> int:
        return _numel(self.shape) * _itemsize(self.dtype)


@dataclasses.dataclass(frozen=True, eq=False)
class StageLayout:
    index: int
    name: str  # "embed", "layer.3", "head"
    slots: tuple[FrozenSlot, ...]
    num_bytes: int  # buffer size, a multiple of ALIGNMENT_BYTES (0 when nothing is frozen)

    @classmethod
    def build(cls, index: int, name: str, frozen: Sequence[tuple[str, nn.Module, str, torch.Tensor]]):
        slots, offset = [], 0
        for weight_name, module, attr, tensor in frozen:
            slot = FrozenSlot(weight_name, module, attr, tuple(tensor.shape), tensor.dtype, offset)
            slots.append(slot)
            offset += _round_up(slot.num_bytes, ALIGNMENT_BYTES)
        return cls(index, name, tuple(slots), offset)

    def specs(self) -> list[FrozenWeightSpec]:
        return [FrozenWeightSpec(s.name, s.shape, s.dtype) for s in self.slots]


class _WeightHandle(tuple):
    """What autograd stores instead of a window tensor: (stage, byte offset, size, stride, dtype)."""

    __slots__ = ()


@dataclasses.dataclass
class _Resident:
    buffer: torch.Tensor | None  # None for a device-resident weight source
    ready_event: object = None  # CUDA event recorded after the load's copies
    streams: set = dataclasses.field(default_factory=set)  # compute streams that used it
    typed: dict = dataclasses.field(default_factory=dict)  # dtype -> the buffer viewed as it (unpack's)


class WeightWindow:
    def __init__(self, stages: Sequence[StageLayout], source: BaseWeightSource,
                 allocator: BaseWindowAllocator, capacity: int | None = None, record_copy_timing: bool = False):
        self.stages = list(stages)
        self.source = source
        self.allocator = allocator
        self.device = allocator.device
        self._capacity = len(self.stages) if capacity is None else self._check_capacity(capacity)
        self._resident: dict[int, _Resident] = {}
        self._range_starts: list[int] = []  # sorted buffer start addresses, for the pack hook
        self._range_entries: list[tuple[int, int, int]] = []  # (start, end, stage) in the same order
        self._next: tuple[int, Iterable[int]] | None = None  # the last prepare's (stage, upcoming)
        self._keep: list[int] | None = None  # the stages to keep, from _next, made when first needed
        self._copy_stream = None
        if self.device.type == "cuda" and not source.device_resident:
            self._copy_stream = torch.cuda.Stream(device=self.device)
        self.record_copy_timing = record_copy_timing
        self.copy_events: list[tuple[object, object, int]] = []  # (start, end, bytes) when timing
        self.num_loads = 0
        self.num_evictions = 0
        self.bytes_copied = 0
        for layout in self.stages:
            source.validate(layout.specs(), self.device)
            self._install_placeholders(layout)
        if source.device_resident:
            for layout in self.stages:  # used in place: resident for good, nothing held
                self._install(layout, [source.tensor(slot.name) for slot in layout.slots])
                self._resident[layout.index] = _Resident(None)

    # -- sizes -------------------------------------------------------------------------
    @property
    def capacity(self) -> int:
        """W: how many stages may be resident at once."""
        return self._capacity

    @property
    def held_bytes(self) -> int:
        return sum(self.stages[s].num_bytes for s, r in self._resident.items() if r.buffer is not None)

    def stage_bytes(self) -> list[int]:
        """Bytes each stage takes when resident (0 for all with a device-resident source)."""
        return [0 if self.source.device_resident else layout.num_bytes for layout in self.stages]

    def capacity_for_bytes(self, num_bytes: int) -> int:
        """The largest W whose worst case (the W largest stages) fits in `num_bytes` (>= 0)."""
        return stages_fitting(self.stage_bytes(), num_bytes) if not self.source.device_resident else len(self.stages)

    def resident_stages(self) -> list[int]:
        return sorted(self._resident)

    def set_capacity(self, capacity: int) -> None:
        """Change W. Shrinking evicts at once (keeping the stages needed soonest); growing
        takes effect at the next `prepare`. The caller holds the trainer's unit lock."""
        self._capacity = self._check_capacity(capacity)
        if self.source.device_resident:
            return
        keep = set(self._keep_order())
        for stage in [s for s in self._resident if s not in keep]:
            self._evict(stage)

    def evict_all(self) -> None:
        """Drop every resident stage (W is unchanged: the next units load what they need).
        For a full reclaim of lent memory; the caller holds the trainer's unit lock."""
        if self.source.device_resident:
            return
        for stage in list(self._resident):
            self._evict(stage)

    # -- per unit ----------------------------------------------------------------------
    def prepare(self, stage: int, upcoming: Iterable[int], stream=None) -> float:
        """Make `stage` resident for a unit about to run on `stream`, evicting the stages
        not among the next W distinct ones (`stage` first, then `upcoming`) and
        prefetching the rest. Returns the host seconds spent loading `stage` itself.
        Raises `WindowMemoryUnavailable` (transient) if `stage` cannot be made resident."""
        if self.source.device_resident:
            return 0.0
        self._next, self._keep = (stage, upcoming), None
        keep: list[int] = []
        if len(self._resident) < len(self.stages) or self._capacity < len(self.stages):
            # Otherwise every stage is resident and stays so: nothing to evict or load, and
            # the order is worked out only if the window shrinks before the next unit.
            keep = self._keep_order()
            keep_set = set(keep)
            for resident in [s for s in self._resident if s not in keep_set]:
                self._evict(resident)
        waited = 0.0
        if stage not in self._resident:
            started = time.perf_counter()
            if not self._load(stage):
                for other in [s for s in self._resident if s != stage]:
                    self._evict(other)
                if not self._load(stage):
                    raise WindowMemoryUnavailable(
                        f"no window memory for stage {self.stages[stage].name} "
                        f"({self.stages[stage].num_bytes} bytes)")
            waited = time.perf_counter() - started
        entry = self._resident[stage]
        if entry.ready_event is not None and stream is not None:
            stream.wait_event(entry.ready_event)  # device-side wait; the host goes on
            entry.streams.add(stream)
        for prefetch in keep[1:]:
            if prefetch not in self._resident and not self._load(prefetch):
                break  # transient shortage: try again at the next unit
        return waited

    def is_ready(self, stage: int) -> bool:
        """True if `stage` is resident and its copy has completed (the trainer is not starved)."""
        entry = self._resident.get(stage)
        if entry is None:
            return False
        return entry.ready_event is None or entry.ready_event.query()

    def needs_saved_tensor_hooks(self) -> bool:
        """Whether a forward unit run now must save handles instead of window tensors:

        - the allocator reuses memory that tensors still view (lent KV memory): always, as
          the lender may take a chunk back at any unit boundary, whatever W is;
        - W is below the number of stages: evictions are part of every step, and W bounds
          the window's memory only if autograd keeps no evicted buffer alive.

        Not otherwise: weights used in place (a device-resident source) are no window
        memory, and with every stage resident in memory PyTorch counts references, nothing
        is evicted in the normal course. If W shrinks there between a forward unit and its
        backward (`set_capacity`, `evict_all`), the evicted buffer lives on, unchanged, as
        long as that unit's saved tensors view it: the backward is still exact, and the
        memory is freed once this pass's backward units have run rather than at the
        shrink (`held_bytes` counts it as released at once, so an allocator's
        ``limit_bytes`` can be exceeded by it meanwhile). The hooks would cost a Python
        call per saved tensor (~46 per layer unit) for nothing."""
        if self.source.device_resident:
            return False
        return self.allocator.reuses_viewed_memory or self._capacity < len(self.stages)

    def saved_tensor_hooks(self, weights_change_between_units: bool = False):
        """A context for a unit's forward: autograd saves handles, not window tensors, where
        that is needed (`needs_saved_tensor_hooks`, decided as the unit starts).
        ``weights_change_between_units``: another thread may write the trainable weights in
        place between this forward and its backward (a fleet round's weights applied between
        two units): the hooks are installed so autograd hands the backward the weights as
        they are then instead of refusing them (its version check covers only tensors saved
        without hooks)."""
        if not weights_change_between_units and not self.needs_saved_tensor_hooks():
            return contextlib.nullcontext()
        return torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack)

    def close(self) -> None:
        """Release all window memory (the trainer is done or disabled)."""
        for stage in list(self._resident):
            if self._resident[stage].buffer is not None:
                self._evict(stage)

    # -- internals ---------------------------------------------------------------------
    def _keep_order(self) -> list[int]:
        """The next W distinct stages: the last prepared one first, then its upcoming ones."""
        if self._keep is None:
            if self._next is None:
                return []
            stage, upcoming = self._next
            keep, seen = [stage], {stage}
            for upcoming_stage in upcoming:
                if len(keep) >= self._capacity:
                    break
                if upcoming_stage not in seen:
                    keep.append(upcoming_stage)
                    seen.add(upcoming_stage)
            self._keep = keep
        return self._keep[: self._capacity]

    def _check_capacity(self, capacity: int) -> int:
        if not isinstance(capacity, int) or capacity < 1:
            raise ValueError(f"window capacity must be an integer >= 1 stage, got {capacity!r}")
        return min(capacity, len(self.stages))

    def _load(self, stage: int) -> bool:
        layout = self.stages[stage]
        if layout.num_bytes == 0:
            self._resident[stage] = _Resident(None)
            return True
        stream_context = contextlib.nullcontext()
        if self._copy_stream is not None:
            # Allocate and copy on the copy stream: the caching allocator ties the block to
            # it, and compute streams that use it are recorded at eviction.
            stream_context = torch.cuda.stream(self._copy_stream)
        with stream_context:
            buffer = self.allocator.allocate(layout.num_bytes)
            if buffer is None:
                return False
            views = [_slot_view(buffer, slot) for slot in layout.slots]
            timing = self._copy_stream is not None and self.record_copy_timing
            if timing:
                start_event = torch.cuda.Event(enable_timing=True)
                start_event.record(self._copy_stream)
            for view, slot in zip(views, layout.slots):
                view.copy_(self.source.tensor(slot.name), non_blocking=self._copy_stream is not None)
            ready_event = None
            if self._copy_stream is not None:
                ready_event = torch.cuda.Event(enable_timing=timing)
                ready_event.record(self._copy_stream)
                if timing:
                    self.copy_events.append((start_event, ready_event, layout.num_bytes))
        self._install(layout, views)
        self._resident[stage] = _Resident(buffer, ready_event)
        index = bisect.bisect_left(self._range_starts, buffer.data_ptr())
        self._range_starts.insert(index, buffer.data_ptr())
        self._range_entries.insert(index, (buffer.data_ptr(), buffer.data_ptr() + layout.num_bytes, stage))
        self.num_loads += 1
        self.bytes_copied += layout.num_bytes
        return True

    def _evict(self, stage: int) -> None:
        entry = self._resident.pop(stage)
        layout = self.stages[stage]
        self._install_placeholders(layout)
        if entry.buffer is None:
            return
        index = self._range_starts.index(entry.buffer.data_ptr())
        del self._range_starts[index], self._range_entries[index]
        streams = set(entry.streams)
        if self._copy_stream is not None:
            streams.add(self._copy_stream)  # a prefetch may still be copying into it
        buffer, entry.buffer = entry.buffer, None
        entry.typed.clear()  # no view of it outlives the release
        self.allocator.release(buffer, streams)
        self.num_evictions += 1

    @staticmethod
    def _install(layout: StageLayout, tensors: Sequence[torch.Tensor]) -> None:
        for slot, tensor in zip(layout.slots, tensors):
            slot.module._parameters[slot.attr] = nn.Parameter(tensor, requires_grad=False)

    @staticmethod
    def _install_placeholders(layout: StageLayout) -> None:
        for slot in layout.slots:
            placeholder = torch.empty(slot.shape, dtype=slot.dtype, device="meta")
            slot.module._parameters[slot.attr] = nn.Parameter(placeholder, requires_grad=False)

    def _pack(self, tensor: torch.Tensor):
        # Only the address is checked: host and device allocations never overlap (CUDA's
        # unified virtual addressing), so any tensor inside a window buffer is window memory.
        if not self._range_starts:
            return tensor
        address = tensor.data_ptr()
        index = bisect.bisect_right(self._range_starts, address) - 1
        if index < 0:
            return tensor
        start, end, stage = self._range_entries[index]
        if address >= end:
            return tensor
        return _WeightHandle((stage, address - start, tuple(tensor.shape), tensor.stride(), tensor.dtype))

    def _unpack(self, saved):
        if not isinstance(saved, _WeightHandle):
            return saved
        stage, byte_offset, shape, stride, dtype = saved
        entry = self._resident.get(stage)
        if entry is None or entry.buffer is None:
            raise RuntimeError(f"backward needs stage {self.stages[stage].name}'s frozen weights but it is not "
                               "resident (the trainer must prepare a stage before its backward unit)")
        typed = entry.typed.get(dtype)
        if typed is None:  # one view per stage and dtype, not one per saved weight and backward
            typed = entry.typed[dtype] = entry.buffer.view(dtype)
        return torch.as_strided(typed, shape, stride, typed.storage_offset() + byte_offset // _itemsize(dtype))


def stages_fitting(stage_bytes: Sequence[int], num_bytes: int) -> int:
    """How many stages fit in `num_bytes` whichever are resident (largest first)."""
    fitting, total = 0, 0
    for size in sorted(stage_bytes, reverse=True):
        if total + size > num_bytes:
            break
        fitting, total = fitting + 1, total + size
    return fitting


def _slot_view(buffer: torch.Tensor, slot: FrozenSlot) -> torch.Tensor:
    return buffer[slot.offset_bytes: slot.offset_bytes + slot.num_bytes].view(slot.dtype).view(slot.shape)


def _numel(shape: Sequence[int]) -> int:
    count = 1
    for size in shape:
        count *= size
    return count


def _itemsize(dtype: torch.dtype) -> int:
    return dtype.itemsize


def _round_up(value: int, multiple: int) -> int:
    return (value + multiple - 1) // multiple * multiple
