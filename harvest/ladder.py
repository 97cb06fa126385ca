"""The SM ladder: how decode and the finetune trainer may split the GPU's SMs. Pure data.

A *level* gives decode ``decode_sms`` and the trainer ``trainer_sms`` of the device's SMs; a
*ladder* is the fixed list of levels built at start-up (harvest.compute), measured by the
profiler, predicted by harvest.predict and chosen from by harvest.schedule, so a level index
means the same level everywhere. Invariants (checked on construction, errors name the
field): levels are in the partitioner's order and the last gives decode the whole device
(``whole_device_index``); ``WHOLE_DEVICE`` ladders have one level where both use every SM,
``GREEN_CONTEXTS`` ones disjoint SM sets (trainer 0: paused). Equality and ``to_dict`` use
the split only (total SMs, realisation, each level's SM counts), never ``constraints``,
``note`` or stream handles, so the partitioner's ladder equals a profile's. Standard
library only.
"""

from __future__ import annotations

import dataclasses
from typing import Any

WHOLE_DEVICE = "whole-device"
"""Realisation without spatial partitioning (CPU, old driver): one shared level."""
GREEN_CONTEXTS = "green-context"
"""Realisation by CUDA green contexts: one SM split per level (csrc/greenctx)."""


class LadderError(ValueError):
    """A ladder (or a request for one) that cannot be met; the message names the
    constraint and a fix."""


def _check_count(where: str, value: Any, minimum: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise LadderError(f"{where}={value!r}: must be an integer >= {minimum}")


@dataclasses.dataclass(frozen=True)
class PartitionConstraints:
    """What makes a split realisable on one device.

    ``min_decode_sms``: smallest group the split can make; ``step_sms``: group sizes are
    multiples of it; ``min_trainer_sms``: smallest remainder harvest accepts for the
    trainer; ``source``: where the numbers came from (for error messages and doctor).
    """

    min_decode_sms: int
    step_sms: int
    min_trainer_sms: int
    source: str

    def __post_init__(self) -> None:
        for field in ("min_decode_sms", "step_sms", "min_trainer_sms"):
            _check_count(f"PartitionConstraints.{field}", getattr(self, field), 1)

    @property
    def smallest_decode_sms(self) -> int:
        """The smallest decode count a split can realise exactly."""
        return -(-self.min_decode_sms // self.step_sms) * self.step_sms


@dataclasses.dataclass(frozen=True)
class Level:
    """One level: SMs for decode and for the trainer (they overlap only on a
    ``WHOLE_DEVICE`` ladder, where both are the whole device).

    A built level (``partitioner.ladder``) carries the streams decode and the trainer
    launch on there: opaque handles (a torch stream, a raw CUstream integer, or None for
    "the thread's current stream"); ``trainer_stream`` is None where the trainer has no SMs.
    """

    decode_sms: int
    trainer_sms: int
    decode_stream: Any = dataclasses.field(default=None, compare=False, repr=False)
    trainer_stream: Any = dataclasses.field(default=None, compare=False, repr=False)

    def __post_init__(self) -> None:
        _check_count("Level.decode_sms", self.decode_sms, 1)  # decode always needs SMs
        _check_count("Level.trainer_sms", self.trainer_sms, 0)

    @property
    def runs_trainer(self) -> bool:
        """Whether the trainer has SMs here (else it must stay paused on this level)."""
        return self.trainer_sms > 0


@dataclasses.dataclass(frozen=True)
class Ladder:
    """The ladder of one device: ``levels[i]`` is level ``i``, the whole-device level last.

    ``constraints`` (None without spatial partitioning) and ``note`` (why there is none:
    CPU, driver too old, ...) record how the ladder was planned. ``decode_sms``,
    ``trainer_sms`` and ``trainer_levels`` are derived once here because the scheduler
    reads them on every decode step.
    """

    total_sms: int
    levels: tuple[Level, ...]
    realisation: str = WHOLE_DEVICE
    constraints: PartitionConstraints | None = dataclasses.field(default=None, compare=False)
    note: str = dataclasses.field(default="", compare=False)
    decode_sms: tuple[int, ...] = dataclasses.field(init=False, compare=False, repr=False)
    trainer_sms: tuple[int, ...] = dataclasses.field(init=False, compare=False, repr=False)
    trainer_levels: tuple[int, ...] = dataclasses.field(init=False, compare=False, repr=False)
    """Indices of the levels that give the trainer SMs, ascending."""

    def __post_init__(self) -> None:
        _check_count("Ladder.total_sms", self.total_sms, 1)
        levels = tuple(self.levels)
        if not levels:
            raise LadderError("Ladder.levels is empty: a ladder has at least its whole-device level")
        if not isinstance(self.realisation, str) or not self.realisation:
            raise LadderError(f"Ladder.realisation={self.realisation!r}: expected a non-empty string")
        for index, level in enumerate(levels):
            if not isinstance(level, Level):
                raise LadderError(f"Ladder.levels[{index}]={level!r}: must be a Level")
            if level.decode_sms > self.total_sms or level.trainer_sms > self.total_sms:
                raise LadderError(f"Ladder.levels[{index}]={level}: more SMs than the device's {self.total_sms}")
        last = levels[-1]
        if last.decode_sms != self.total_sms:
            raise LadderError(
                f"Ladder.levels[-1]={last}: the last level must give decode the whole device "
                f"({self.total_sms} SMs); add it"
            )
        if self.realisation == WHOLE_DEVICE and (len(levels) != 1 or last.trainer_sms != self.total_sms):
            raise LadderError(
                f"Ladder: a {WHOLE_DEVICE!r} ladder is one level where decode and trainer share all "
                f"{self.total_sms} SMs, got {[(lv.decode_sms, lv.trainer_sms) for lv in levels]}"
            )
        object.__setattr__(self, "levels", levels)
        object.__setattr__(self, "decode_sms", tuple(level.decode_sms for level in levels))
        object.__setattr__(self, "trainer_sms", tuple(level.trainer_sms for level in levels))
        object.__setattr__(self, "trainer_levels", tuple(i for i, level in enumerate(levels) if level.trainer_sms > 0))

    @classmethod
    def whole_device(cls, total_sms: int, note: str = "", decode_stream: Any = None, trainer_stream: Any = None) -> "Ladder":
        """One level: decode and trainer share all ``total_sms`` (no spatial partitioning);
        ``note`` says why."""
        _check_count("total_sms", total_sms, 1)
        level = Level(total_sms, total_sms, decode_stream, trainer_stream)
        return cls(total_sms, (level,), WHOLE_DEVICE, note=note)

    @property
    def num_levels(self) -> int:
        return len(self.levels)

    @property
    def whole_device_index(self) -> int:
        """The level where decode has every SM (the trainer shares them or is paused)."""
        return len(self.levels) - 1

    @property
    def spatial(self) -> bool:
        """Whether decode and trainer run on disjoint SM sets."""
        return self.realisation != WHOLE_DEVICE

    def decode_fraction(self, level_index: int) -> float:
        """Share of the device's SMs decode may use at ``level_index`` (stage 2's SM_infer)."""
        return self.levels[level_index].decode_sms / self.total_sms

    def trainer_fraction(self, level_index: int) -> float:
        """Share of the device's SMs the trainer may use at ``level_index`` (stage 2's SM_ft)."""
        return self.levels[level_index].trainer_sms / self.total_sms

    def describe(self) -> str:
        if not self.spatial:
            why = f" ({self.note})" if self.note else ""
            return (
                f"{self.realisation} ladder of {self.total_sms} SMs, 1 level, no spatial partitioning: "
                f"decode and trainer share the device{why}"
            )
        body = ", ".join(f"{lv.decode_sms}/{lv.trainer_sms}" for lv in self.levels)
        return f"{self.realisation} ladder of {self.total_sms} SMs, levels (decode/trainer) [{body}]"

    def to_dict(self) -> dict:
        """The profile's ``ladder`` object (profiles/README.md). Its key for the
        realisation is ``partitioner``, as profiles have always written it."""
        return {
            "total_sms": self.total_sms,
            "partitioner": self.realisation,
            "levels": [{"decode_sms": lv.decode_sms, "trainer_sms": lv.trainer_sms} for lv in self.levels],
        }

    @classmethod
    def from_dict(cls, data: dict) -> "Ladder":
        """Inverse of :meth:`to_dict`; raises LadderError (a ValueError) naming the bad field."""
        if not isinstance(data, dict):
            raise LadderError(f"ladder: expected an object, got {type(data).__name__}")
        levels = data.get("levels")
        if not isinstance(levels, list):
            raise LadderError("ladder.levels: expected a list of {decode_sms, trainer_sms}")
        parsed = []
        for index, level in enumerate(levels):
            if not isinstance(level, dict) or set(level) != {"decode_sms", "trainer_sms"}:
                raise LadderError(f"ladder.levels[{index}]={level!r}: expected exactly decode_sms and trainer_sms")
            parsed.append(Level(level["decode_sms"], level["trainer_sms"]))
        realisation = data.get("partitioner", WHOLE_DEVICE)
        if not isinstance(realisation, str) or not realisation:
            raise LadderError(f"ladder.partitioner={realisation!r}: expected a non-empty string")
        return cls(data.get("total_sms"), tuple(parsed), realisation)
