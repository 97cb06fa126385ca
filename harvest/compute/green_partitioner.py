"""GreenContextPartitioner: the SM ladder built with CUDA green contexts.

Start-up: query the device -> plan the ladder (harvest.compute.ladder_planning) -> preview each
level with the driver's own split (no contexts yet) -> build it (csrc/greenctx) -> wrap
each level's streams as ``torch.cuda.ExternalStream`` on the partitioner's
harvest.ladder.Ladder. Every step raises
GreenContextError or LadderError with the reason; ``create_partitioner`` turns those into
a fallback to WholeDevicePartitioner.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

from harvest.compute import device as device_env
from harvest.compute import greenctx_lib
from harvest.compute.greenctx_lib import GreenContextsUnavailable
from harvest.compute.ladder_planning import DEFAULT_NUM_LEVELS, check_driver_version, device_constraints, plan_ladder
from harvest.compute.partitioner import BasePartitioner
from harvest.ladder import Ladder, LadderError, Level
from harvest.logs import get_logger

logger = get_logger(__name__)


def plan_for_device(
    props: greenctx_lib.DeviceProperties,
    levels: int | Sequence[int] = DEFAULT_NUM_LEVELS,
    min_trainer_sms: int | None = None,
) -> Ladder:
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


def preview_ladder(ordinal: int, planned: Ladder) -> tuple[Ladder, tuple[int, ...], tuple[str, ...]]:
    """The driver's dry-run split of ``planned``: ``(realised, requested, notes)``.

    ``realised`` holds the SM counts the driver will really give, ``requested[i]`` the
    decode count that yields ``realised.levels[i]``, and ``notes`` every level that
    differed from the plan or was dropped (collapsed onto another, or leaving the trainer
    under its minimum).
    """
    min_trainer = planned.constraints.min_trainer_sms
    chosen: list[Level] = []
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
        chosen.append(Level(decode_sms=decode, trainer_sms=trainer))
        requested.append(level.decode_sms)
    if not chosen:
        raise LadderError(f"no planned level is realisable on device {ordinal}: {'; '.join(notes)}")
    chosen.append(planned.levels[-1])
    requested.append(planned.total_sms)
    realised = dataclasses.replace(planned, levels=tuple(chosen))
    return realised, tuple(requested), tuple(notes)


def warn_if_too_few_connections(ladder: Ladder, environ=None) -> str | None:
    """Log (and return) a warning when CUDA_DEVICE_MAX_CONNECTIONS gives the ladder's
    streams, and the ones beside them, fewer hardware queues than streams."""
    streams = sum(s is not None for level in ladder.levels for s in (level.decode_stream, level.trainer_stream))
    problem = device_env.connections_problem(streams + device_env.EXTRA_STREAMS, environ)
    if problem is not None:
        logger.warning("SM ladder: %s", problem)
    return problem


class GreenContextPartitioner(BasePartitioner):
    """The ladder on CUDA device ``ordinal``: each partial level is a decode green
    context and a trainer green context from one split (disjoint SMs), each with its own
    stream; the last level is a plain stream with every SM for decode and no trainer."""

    def __init__(
        self,
        ordinal: int,
        levels: int | Sequence[int] = DEFAULT_NUM_LEVELS,
        min_trainer_sms: int | None = None,
    ) -> None:
        import torch

        props = greenctx_lib.query_device(ordinal)
        previewed, requested, notes = preview_ladder(ordinal, plan_for_device(props, levels, min_trainer_sms))
        for note in notes:
            logger.warning("SM ladder on cuda:%d: %s", ordinal, note)
        native = greenctx_lib.LadderHandle(ordinal, requested)
        try:
            built = self._check_built(native.ladder, previewed)
            device = torch.device("cuda", ordinal)

            def wrap(handle: int | None):
                return torch.cuda.ExternalStream(handle, device=device) if handle else None

            streamed = tuple(
                dataclasses.replace(level, decode_stream=wrap(level.decode_stream), trainer_stream=wrap(level.trainer_stream))
                for level in built.levels
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
        super().__init__(dataclasses.replace(built, levels=streamed))
        logger.info("SM ladder built: %s", self.description)
        warn_if_too_few_connections(self.ladder)

    @staticmethod
    def _check_built(provisioned: Ladder, previewed: Ladder) -> Ladder:
        """The previewed ladder (its constraints) with the levels as provisioned (their
        raw streams); warn where they differ from the preview."""
        if provisioned.levels != previewed.levels:
            logger.warning("SM ladder: provisioned %s differs from the driver's preview %s", provisioned.levels, previewed.levels)
        if provisioned.total_sms != previewed.total_sms:
            raise greenctx_lib.GreenContextError(
                "hgc_ladder_create",
                greenctx_lib.HGC_ERR_DRIVER,
                f"the SM resource has {provisioned.total_sms} SMs but the device attribute says {previewed.total_sms}",
            )
        return dataclasses.replace(previewed, levels=provisioned.levels)

    def _release(self) -> None:
        self._native.close()
