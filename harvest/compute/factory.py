"""create_partitioner: green contexts where they work, WholeDevicePartitioner otherwise.

A machine that cannot partition SMs (CPU, no driver, driver < 12.4, a ladder request
the device cannot realise, a driver call failing at start-up) still serves: decode and
the trainer then share the device, and the warning says why. Programming errors are not
caught here; they surface as the exceptions they are.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

from harvest.compute.greenctx_lib import GreenContextError
from harvest.compute.ladder_planning import DEFAULT_NUM_LEVELS
from harvest.compute.partitioner import BasePartitioner, WholeDevicePartitioner, _parse_device
from harvest.ladder import Ladder, LadderError
from harvest.logs import get_logger

logger = get_logger(__name__)


def create_partitioner(
    device: Any = "cuda",
    levels: int | Sequence[int] = DEFAULT_NUM_LEVELS,
    min_trainer_sms: int | None = None,
) -> BasePartitioner:
    """The partitioner for ``device`` ("cpu", "cuda", "cuda:N", torch.device or an index).

    ``levels`` and ``min_trainer_sms`` are passed to the ladder planner
    (harvest.compute.ladder_planning.plan_ladder). Never raises for a machine that cannot
    partition SMs: it logs a warning naming the reason and returns a
    WholeDevicePartitioner whose ``reason`` holds the same text.
    """
    device_type, ordinal = _parse_device(device)
    if device_type == "cpu":
        return WholeDevicePartitioner("cpu", reason="CPU device")
    from harvest.compute.green_partitioner import GreenContextPartitioner

    try:
        return GreenContextPartitioner(ordinal, levels, min_trainer_sms)
    except (GreenContextError, LadderError) as exc:
        reason = str(exc)
    logger.warning(
        "SM partitioning unavailable on cuda:%d, using WholeDevicePartitioner "
        "(no spatial partitioning: decode and trainer share the device): %s",
        ordinal,
        reason,
    )
    return WholeDevicePartitioner(f"cuda:{ordinal}", reason=reason)


def ladder_report(device: Any = "cuda", levels: int | Sequence[int] = DEFAULT_NUM_LEVELS) -> dict:
    """The ladder ``create_partitioner(device, levels)`` would build, without building it
    (the driver's dry-run split gives the realised SM counts). For ``harvest doctor``."""
    from harvest.compute import greenctx_lib
    from harvest.compute.green_partitioner import plan_for_device, preview_ladder
    from harvest.compute.partitioner import CPU_UNITS

    device_type, ordinal = _parse_device(device)
    if device_type == "cpu":
        return _report("WholeDevicePartitioner", Ladder.whole_device(CPU_UNITS, "CPU device"))
    total_sms = CPU_UNITS  # until the device is known: no driver means nothing CUDA runs
    try:
        props = greenctx_lib.query_device(ordinal)
        total_sms = props.sm_count
        planned = plan_for_device(props, levels)
        realised, _, notes = preview_ladder(ordinal, planned)
    except (GreenContextError, LadderError) as exc:
        return _report("WholeDevicePartitioner", Ladder.whole_device(total_sms, str(exc)))
    return {
        **_report("GreenContextPartitioner", realised),
        "planned_decode_sms": [level.decode_sms for level in planned.levels],
        "preview_notes": list(notes),
    }


def _report(partitioner: str, ladder: Ladder) -> dict:
    """The doctor's JSON form of a ladder: the profile's fields and how it was planned."""
    constraints = None if ladder.constraints is None else dataclasses.asdict(ladder.constraints)
    return {
        "partitioner": partitioner,
        "spatial": ladder.spatial,
        "total_sms": ladder.total_sms,
        "constraints": constraints,
        "levels": ladder.to_dict()["levels"],
        "note": ladder.note,
    }
