"""GreenContextPartitioner: the SM ladder built with CUDA green contexts.

Start-up: query the device -> plan the ladder (harvest.compute.ladder) -> preview each
level with the driver's own split (no contexts yet) -> build it (csrc/greenctx) -> wrap
each level's streams as ``torch.cuda.ExternalStream``. Every step raises
GreenContextError or LadderError with the reason; ``create_partitioner`` turns those into
a fallback to WholeDevicePartitioner.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

from harvest.compute import greenctx_lib
from harvest.compute.greenctx_lib import GreenContextsUnavailable
from harvest.compute.ladder import (
    DEFAULT_NUM_LEVELS,
    LadderError,
    LadderPlan,
    LevelPlan,
    check_driver_version,
    device_constraints,
    plan_ladder,
)
from harvest.compute.partitioner import BasePartitioner, Level
from harvest.logs import get_logger

logger = get_logger(__name__)


@dataclasses.dataclass(frozen=True)
class PreviewedLadder:
    """A plan after the driver's dry-run split: ``realised`` holds the SM counts the driver
    will really give, ``requested[i]`` the decode count that yields ``realised.levels[i]``,
    and ``notes`` every level that differed from the plan or was dropped."""

    planned: LadderPlan
    realised: LadderPlan
    requested: tuple[int, ...]
    notes: tuple[str, ...]


def plan_for_device(
    props: greenctx_lib.DeviceProperties,
    levels: int | Sequence[int] = DEFAULT_NUM_LEVELS,
    min_trainer_sms: int | None = None,
) -> LadderPlan:
    """The ladder planned for a queried device, with the constraints its driver reports."""
    if not props.green_contexts_supported:
        check_driver_version(props.driver_version)  # names the version when it is the cause
        raise GreenContextsUnavailable(
            "green contexts", greenctx_lib.HGC_ERR_UNSUPPORTED, "the driver lacks the green-context entry points"
        )
    constraints = device_constraints(
        props.compute_capability, props.min_sm_partition_size, props.sm_coscheduled_alignment, min_trainer_sms
    )
    return plan_ladder(props.sm_count, props.compute_capability, levels, constraints)


def preview_ladder(ordinal: int, planned: LadderPlan) -> PreviewedLadder:
    """Replace planned counts with what the driver's split yields; drop levels that
    collapse onto another or leave the trainer under its minimum."""
    min_trainer = planned.constraints.min_trainer_sms
    chosen: list[LevelPlan] = []
    requested: list[int] = []
    notes: list[str] = []
    for level in planned.levels[:-1]:
        decode, trainer = greenctx_lib.split_preview(ordinal, level.decode_sms)
        if decode != level.decode_sms:
            notes.append(f"level {level.decode_sms}: the driver gives {decode}/{trainer}")
        if trainer < min_trainer:
            notes.append(f"level {level.decode_sms} dropped: leaves the trainer {trainer} SMs (< {min_trainer})")
            continue
        if chosen and chosen[-1].decode_sms >= decode:
            notes.append(f"level {level.decode_sms} dropped: same SMs as the level below")
            continue
        chosen.append(LevelPlan(decode_sms=decode, trainer_sms=trainer))
        requested.append(level.decode_sms)
    if not chosen:
        raise LadderError(f"no planned level is realisable on device {ordinal}: {'; '.join(notes)}")
    chosen.append(planned.levels[-1])
    requested.append(planned.total_sms)
    realised = dataclasses.replace(planned, levels=tuple(chosen))
    return PreviewedLadder(planned, realised, tuple(requested), tuple(notes))


class GreenContextPartitioner(BasePartitioner):
    """The ladder on CUDA device ``ordinal``: each partial level is a decode green
    context and a trainer green context from one split (disjoint SMs), each with its own
    stream; the last level is a plain stream with every SM for decode and no trainer."""

    spatial = True

    def __init__(
        self,
        ordinal: int,
        levels: int | Sequence[int] = DEFAULT_NUM_LEVELS,
        min_trainer_sms: int | None = None,
    ) -> None:
        import torch

        props = greenctx_lib.query_device(ordinal)
        previewed = preview_ladder(ordinal, plan_for_device(props, levels, min_trainer_sms))
        for note in previewed.notes:
            logger.warning("SM ladder on cuda:%d: %s", ordinal, note)
        native = greenctx_lib.NativeLadder(ordinal, previewed.requested)
        try:
            built = self._check_built(native, previewed.realised)
            device = torch.device("cuda", ordinal)

            def wrap(handle: int):
                return torch.cuda.ExternalStream(handle, device=device) if handle else None

            level_objects = tuple(
                Level(
                    index=index,
                    decode_sms=level.decode_sms,
                    trainer_sms=level.trainer_sms,
                    total_sms=native.total_sms,
                    spatial=True,
                    decode_stream=wrap(level.decode_stream),
                    trainer_stream=wrap(level.trainer_stream),
                )
                for index, level in enumerate(native.levels)
            )
        except BaseException:
            try:
                native.close()
            except greenctx_lib.GreenContextError as close_error:
                logger.warning("SM ladder teardown after a failed start-up: %s", close_error)
            raise
        self._native = native
        self.ordinal = ordinal
        self.device_name = props.name
        self.green_stream_api = native.green_stream_api
        self.description = f"green contexts on cuda:{ordinal} ({props.name}): {built.describe()}"
        super().__init__(built, level_objects)
        logger.info("SM ladder built: %s", self.description)

    @staticmethod
    def _check_built(native: greenctx_lib.NativeLadder, previewed: LadderPlan) -> LadderPlan:
        """The plan as provisioned; warn where it differs from the preview."""
        built = tuple(LevelPlan(level.decode_sms, level.trainer_sms) for level in native.levels)
        if built != previewed.levels:
            logger.warning("SM ladder: provisioned %s differs from the driver's preview %s", built, previewed.levels)
        if native.total_sms != previewed.total_sms:
            raise greenctx_lib.GreenContextError(
                "hgc_ladder_create",
                greenctx_lib.HGC_ERR_DRIVER,
                f"the SM resource has {native.total_sms} SMs but the device attribute says {previewed.total_sms}",
            )
        return dataclasses.replace(previewed, levels=built)

    def _release(self) -> None:
        self._native.close()
