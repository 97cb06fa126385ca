"""The ladder levels to profile, from harvest's partitioner (harvest.compute).

Each level comes with the streams decode and the trainer run on there (None on a CPU).
A level where the trainer has no SMs (the spatial ladder's whole-device level: trainer
paused) gets solo samples only. Without harvest.compute (an installation that lacks it),
the device is one shared level, as ``WholeDevicePartitioner`` would report it.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from harvest.predict.ladder import WHOLE_DEVICE, LadderSpec, LevelSpec

GREEN_CONTEXTS = "green-context"


@dataclasses.dataclass(frozen=True)
class ProfilingLevel:
    index: int
    spec: LevelSpec
    decode_stream: Any = None
    trainer_stream: Any = None

    @property
    def trainer_runs(self) -> bool:
        return self.spec.trainer_sms > 0


@dataclasses.dataclass
class ProfilingLadder:
    ladder: LadderSpec
    levels: list[ProfilingLevel]
    description: str
    partitioner: Any = None  # closed by close(); None for the fallback

    def close(self) -> None:
        if self.partitioner is not None:
            self.partitioner.close()
            self.partitioner = None


def from_partitioner(partitioner) -> ProfilingLadder:
    """Adapt a ``harvest.compute.BasePartitioner``'s built levels."""
    built = list(partitioner.levels)
    ladder = LadderSpec(
        total_sms=built[0].total_sms,
        levels=tuple(LevelSpec(level.decode_sms, level.trainer_sms) for level in built),
        partitioner=GREEN_CONTEXTS if partitioner.spatial else WHOLE_DEVICE,
    )
    levels = [
        ProfilingLevel(i, ladder.levels[i], level.decode_stream, level.trainer_stream) for i, level in enumerate(built)
    ]
    return ProfilingLadder(ladder, levels, partitioner.description, partitioner)


def discover(device: str, num_levels: int | None = None) -> ProfilingLadder:
    """The ladder ``harvest.compute.create_partitioner`` builds for ``device``."""
    try:
        from harvest.compute import create_partitioner
    except ImportError:
        return _single_level(device)
    kwargs = {} if num_levels is None else {"levels": num_levels}
    return from_partitioner(create_partitioner(device, **kwargs))


def _single_level(device: str) -> ProfilingLadder:
    total = 1
    if device.startswith("cuda"):
        import torch

        total = torch.cuda.get_device_properties(torch.device(device)).multi_processor_count
    ladder = LadderSpec.whole_device(total)
    return ProfilingLadder(ladder, [ProfilingLevel(0, ladder.levels[0])], f"{device}: one shared level (harvest.compute unavailable)")
