"""Planning the SM ladder: which (decode SMs, trainer SMs) levels to build. Pure Python.

The functions here return the shared types of :mod:`harvest.ladder`. Invariants: at most
``MAX_LEVELS`` levels (decode may keep one CUDA graph set per level); every level is
realisable by the driver (decode counts on its granularity, the remainder leaving the
trainer at least ``min_trainer_sms``); the whole-device level is always present. On a GPU
the driver's dry-run split has the final word (``green_partitioner.preview_ladder``).
Standard library only (policy imports no torch).

Rules: docs/design.md §4, 'Planning the ladder (harvest/compute/ladder_planning.py)'.
"""

from __future__ import annotations

from collections.abc import Sequence

from harvest.ladder import GREEN_CONTEXTS, Ladder, LadderError, Level, PartitionConstraints

MAX_LEVELS = 8  # same bound as HGC_MAX_LEVELS in csrc/greenctx/hgc.h
DEFAULT_NUM_LEVELS = 6
MIN_GREEN_CONTEXT_DRIVER = 12040  # cuGreenCtxCreate and the split API: driver 12.4

# Compute capability major -> (minimum partition SMs, step SMs) when the driver does not
# report them. 7.x-9.x as docs/design.md §4 and the CUDA 13 cuda.h green-context notes give
# them (9.0+ covers Blackwell too). 6.x is 1/1 as SGLang's pdmux_context uses it; the
# CUDA 13 header says 2/2 for 6.x, but CUDA 13 no longer targets Pascal and any driver
# that can build the ladder reports its own numbers on 13.0+.
_ARCH_RULES: dict[int, tuple[int, int]] = {6: (1, 1), 7: (2, 2), 8: (4, 2)}
_HOPPER_AND_NEWER = (8, 8)


def parse_levels(text: str) -> int | tuple[int, ...]:
    """A command line's ``--levels``: a number of levels (2..MAX_LEVELS, the whole device
    included) or the ladder's decode SM counts, comma-separated (harvest.yaml's ``ladder``;
    the whole device's count may be left out). ValueError says what is wrong."""
    parts = [part.strip() for part in text.split(",")]
    try:
        numbers = [int(part) for part in parts]
    except ValueError:
        raise ValueError(f"{text!r}: a number of levels, or decode SM counts such as 24,40,56") from None
    if len(numbers) == 1:
        if not 2 <= numbers[0] <= MAX_LEVELS:
            raise ValueError(f"{text!r}: ask for 2 to {MAX_LEVELS} levels (one is always the whole device)")
        return numbers[0]
    if min(numbers) < 1 or len(set(numbers)) != len(numbers):
        raise ValueError(f"{text!r}: decode SM counts are distinct integers >= 1")
    if len(numbers) > MAX_LEVELS:
        raise ValueError(f"{text!r}: at most {MAX_LEVELS} levels, the whole device's included")
    return tuple(sorted(numbers, reverse=True))


def levels_argument(text: str) -> int | tuple[int, ...]:
    """:func:`parse_levels` as an argparse ``type``: its message, named after the flag."""
    import argparse

    try:
        return parse_levels(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def _parse_compute_capability(compute_capability) -> tuple[int, int]:
    if isinstance(compute_capability, str):
        parts = compute_capability.split(".")
        if len(parts) == 2 and all(p.isdigit() for p in parts):
            return int(parts[0]), int(parts[1])
    elif (
        isinstance(compute_capability, Sequence)
        and len(compute_capability) == 2
        and all(isinstance(p, int) and not isinstance(p, bool) and p >= 0 for p in compute_capability)
    ):
        return compute_capability[0], compute_capability[1]
    raise LadderError(f"compute_capability={compute_capability!r}: give (major, minor) such as (9, 0) or '9.0'")


def arch_constraints(compute_capability, min_trainer_sms: int | None = None) -> PartitionConstraints:
    """The known split rules for an architecture, for drivers that do not report them."""
    major, minor = _parse_compute_capability(compute_capability)
    if major < 6:
        raise LadderError(
            f"compute capability {major}.{minor}: green contexts need compute capability 6.0 or newer"
        )
    min_sms, step = _ARCH_RULES.get(major, _HOPPER_AND_NEWER)
    return PartitionConstraints(
        min_decode_sms=min_sms,
        step_sms=step,
        min_trainer_sms=min_sms if min_trainer_sms is None else min_trainer_sms,
        source=f"arch rules for cc {major}.x (min {min_sms}, step {step})",
    )


def device_constraints(
    compute_capability,
    min_sm_partition_size: int = 0,
    sm_coscheduled_alignment: int = 0,
    min_trainer_sms: int | None = None,
) -> PartitionConstraints:
    """Constraints from what the driver reports (0 = not reported: arch rule used instead)."""
    rules = arch_constraints(compute_capability)
    if min_sm_partition_size <= 0 and sm_coscheduled_alignment <= 0:
        return arch_constraints(compute_capability, min_trainer_sms)
    min_sms = min_sm_partition_size if min_sm_partition_size > 0 else rules.min_decode_sms
    step = sm_coscheduled_alignment if sm_coscheduled_alignment > 0 else rules.step_sms
    return PartitionConstraints(
        min_decode_sms=min_sms,
        step_sms=step,
        min_trainer_sms=min_sms if min_trainer_sms is None else min_trainer_sms,
        source=f"driver (min partition {min_sms}, alignment {step})",
    )


def check_driver_version(driver_version: int | None) -> None:
    """Raise LadderError unless the driver is new enough for green contexts (12.4)."""
    if driver_version is None:
        raise LadderError("no CUDA driver: green contexts need a CUDA driver >= 12.4")
    if driver_version < MIN_GREEN_CONTEXT_DRIVER:
        found = f"{driver_version // 1000}.{(driver_version % 1000) // 10}"
        raise LadderError(f"CUDA driver {found} is too old: green contexts need a CUDA driver >= 12.4")


def _check_decode_request(decode_sms, total_sms: int, c: PartitionConstraints) -> None:
    if isinstance(decode_sms, bool) or not isinstance(decode_sms, int):
        raise LadderError(f"level {decode_sms!r}: decode SM counts must be integers")
    if decode_sms > total_sms:
        raise LadderError(f"level {decode_sms}: asks for more SMs than the device's {total_sms}")
    if decode_sms == total_sms:
        return
    if decode_sms < c.min_decode_sms:
        raise LadderError(
            f"level {decode_sms}: fewer decode SMs than the minimum partition of {c.min_decode_sms} ({c.source})"
        )
    if decode_sms % c.step_sms:
        lower = decode_sms - decode_sms % c.step_sms
        realisable = realisable_decode_counts(total_sms, c)
        nearest = " or ".join(str(n) for n in (lower, lower + c.step_sms) if n in realisable)
        raise LadderError(
            f"level {decode_sms}: decode SMs must be a multiple of {c.step_sms} ({c.source}); "
            f"nearest realisable: {nearest or 'none'}"
        )
    if total_sms - decode_sms < c.min_trainer_sms:
        realisable = realisable_decode_counts(total_sms, c)
        largest = realisable[-1] if realisable else "none"
        raise LadderError(
            f"level {decode_sms}: leaves the trainer {total_sms - decode_sms} SMs, under its minimum of "
            f"{c.min_trainer_sms}; the largest realisable decode count is {largest}"
        )


def realisable_decode_counts(total_sms: int, constraints: PartitionConstraints) -> list[int]:
    """Every decode count a partial level can have on this device, ascending."""
    largest = total_sms - constraints.min_trainer_sms
    return list(range(constraints.smallest_decode_sms, largest + 1, constraints.step_sms))


def _nearest_to_fractions(candidates: list[int], total_sms: int, num_levels: int) -> list[int]:
    """For i = 1..num_levels-1, the candidate nearest to i/num_levels of the device (ties
    go to the larger decode share: QoS first), without repeats."""
    chosen: list[int] = []
    for i in range(1, num_levels):
        target = total_sms * i / num_levels
        best = min(candidates, key=lambda d: (abs(d - target), -d))
        if best not in chosen:
            chosen.append(best)
    return sorted(chosen)


def plan_ladder(
    total_sms: int,
    compute_capability,
    levels: int | Sequence[int] = DEFAULT_NUM_LEVELS,
    constraints: PartitionConstraints | None = None,
) -> Ladder:
    """Choose the ladder's levels.

    ``levels``: an int N (2..MAX_LEVELS) asks for N levels: decode gets the realisable
    count nearest to i/N of the device for i = 1..N-1 (fewer levels when two fractions
    round to the same count), plus the whole device; a sequence gives the
    decode SM counts explicitly (each must be realisable; the whole-device level is added
    if absent). ``constraints`` default to the architecture rules of
    ``compute_capability``. Raises LadderError naming the broken constraint.
    """
    if isinstance(total_sms, bool) or not isinstance(total_sms, int) or total_sms < 1:
        raise LadderError(f"total_sms={total_sms!r}: must be a positive integer (the device's SM count)")
    c = arch_constraints(compute_capability) if constraints is None else constraints

    if isinstance(levels, int) and not isinstance(levels, bool):
        if not 2 <= levels <= MAX_LEVELS:
            raise LadderError(
                f"levels={levels}: ask for 2 to {MAX_LEVELS} levels (one is always the whole device)"
            )
        candidates = realisable_decode_counts(total_sms, c)
        if not candidates:
            raise LadderError(
                f"no partial level fits {total_sms} SMs: decode needs >= {c.smallest_decode_sms} "
                f"and the trainer >= {c.min_trainer_sms} ({c.source})"
            )
        partial = _nearest_to_fractions(candidates, total_sms, levels)
    elif isinstance(levels, Sequence) and not isinstance(levels, str):
        if len(levels) == 0:
            raise LadderError("levels is empty: give decode SM counts, e.g. [32, 64, 96], or a number of levels")
        for decode_sms in levels:
            _check_decode_request(decode_sms, total_sms, c)
        duplicates = sorted({d for d in levels if list(levels).count(d) > 1})
        if duplicates:
            raise LadderError(f"levels lists {duplicates} more than once: each decode SM count once")
        partial = sorted(d for d in levels if d != total_sms)
        if not partial:
            raise LadderError(
                f"levels={list(levels)} has no partial level: the trainer would never get SMs; "
                f"add decode counts below {total_sms}"
            )
        if len(partial) + 1 > MAX_LEVELS:
            raise LadderError(
                f"levels gives {len(partial)} partial levels: at most {MAX_LEVELS - 1} "
                f"(plus the whole-device level, {MAX_LEVELS} in all)"
            )
    else:
        raise LadderError(f"levels={levels!r}: give a number of levels or a list of decode SM counts")

    levels = [Level(decode_sms=d, trainer_sms=total_sms - d) for d in partial]
    levels.append(Level(decode_sms=total_sms, trainer_sms=0))
    return Ladder(total_sms, tuple(levels), GREEN_CONTEXTS, constraints=c)
