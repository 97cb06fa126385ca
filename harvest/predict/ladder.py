"""The SM ladder as the predictor sees it: a list of (decode SMs, trainer SMs) levels.

The partitioner (``harvest.compute``) builds the ladder on the device; the predictor
only needs each level's SM counts to form stage 2's features ``SM_infer`` and ``SM_ft``
(fractions of the device's SMs, Harli eq. 3). Keeping this small description here
lets profiles, the predictor and the scheduler exchange ladders without importing the
partitioner (which needs torch and the green-context library).

On a CPU, or a GPU without green contexts, the ladder has one level in which decode and
the trainer share the whole device: ``decode_sms == trainer_sms == total_sms``. Stage 2
then sees a single (SM_infer, SM_ft) point and reduces to one slowdown factor.
"""

from __future__ import annotations

import dataclasses

WHOLE_DEVICE = "whole-device"


@dataclasses.dataclass(frozen=True)
class LevelSpec:
    """One ladder level: SMs given to decode and to the trainer (they may overlap only
    when the partitioner shares the whole device)."""

    decode_sms: int
    trainer_sms: int

    def __post_init__(self) -> None:
        for name in ("decode_sms", "trainer_sms"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise ValueError(f"LevelSpec.{name}={value!r}: must be an integer >= 0")
        if self.decode_sms == 0:
            raise ValueError("LevelSpec.decode_sms=0: decode needs at least one SM")


@dataclasses.dataclass(frozen=True)
class LadderSpec:
    """The ladder of a device: ``levels[i]`` is level ``i``; ``partitioner`` names how the
    levels are realised (``whole-device`` or the partitioner's own name)."""

    total_sms: int
    levels: tuple[LevelSpec, ...]
    partitioner: str = WHOLE_DEVICE

    def __post_init__(self) -> None:
        if isinstance(self.total_sms, bool) or not isinstance(self.total_sms, int) or self.total_sms <= 0:
            raise ValueError(f"LadderSpec.total_sms={self.total_sms!r}: must be an integer > 0")
        object.__setattr__(self, "levels", tuple(self.levels))
        if not self.levels:
            raise ValueError("LadderSpec.levels is empty: a ladder has at least one level")
        for index, level in enumerate(self.levels):
            if not isinstance(level, LevelSpec):
                raise ValueError(f"LadderSpec.levels[{index}]={level!r}: must be a LevelSpec")
            if level.decode_sms > self.total_sms or level.trainer_sms > self.total_sms:
                raise ValueError(
                    f"LadderSpec.levels[{index}]={level}: more SMs than the device's {self.total_sms}"
                )

    @classmethod
    def whole_device(cls, total_sms: int) -> "LadderSpec":
        """One level: decode and trainer share all ``total_sms`` (no spatial partitioning)."""
        return cls(total_sms, (LevelSpec(total_sms, total_sms),), WHOLE_DEVICE)

    @property
    def num_levels(self) -> int:
        return len(self.levels)

    def decode_fraction(self, level_index: int) -> float:
        return self.levels[level_index].decode_sms / self.total_sms

    def trainer_fraction(self, level_index: int) -> float:
        return self.levels[level_index].trainer_sms / self.total_sms

    def to_dict(self) -> dict:
        return {
            "total_sms": self.total_sms,
            "partitioner": self.partitioner,
            "levels": [{"decode_sms": lv.decode_sms, "trainer_sms": lv.trainer_sms} for lv in self.levels],
        }

    @classmethod
    def from_dict(cls, data: dict) -> "LadderSpec":
        """Inverse of :meth:`to_dict`; raises ValueError naming the bad field."""
        if not isinstance(data, dict):
            raise ValueError(f"ladder: expected an object, got {type(data).__name__}")
        levels = data.get("levels")
        if not isinstance(levels, list):
            raise ValueError("ladder.levels: expected a list of {decode_sms, trainer_sms}")
        parsed = []
        for index, level in enumerate(levels):
            if not isinstance(level, dict) or set(level) != {"decode_sms", "trainer_sms"}:
                raise ValueError(f"ladder.levels[{index}]={level!r}: expected exactly decode_sms and trainer_sms")
            parsed.append(LevelSpec(level["decode_sms"], level["trainer_sms"]))
        partitioner = data.get("partitioner", WHOLE_DEVICE)
        if not isinstance(partitioner, str) or not partitioner:
            raise ValueError(f"ladder.partitioner={partitioner!r}: expected a non-empty string")
        return cls(data.get("total_sms"), tuple(parsed), partitioner)

    def describe(self) -> str:
        body = ", ".join(f"{lv.decode_sms}/{lv.trainer_sms}" for lv in self.levels)
        return f"{self.partitioner} ladder of {self.total_sms} SMs, levels (decode/trainer) [{body}]"
