"""Where `harvest profile --tp N` runs its N tensor-parallel ranks, checked before any
model loads.

On GPUs rank ``r`` takes GPU ``r``. On a CPU SGLang reads rank ``r``'s cores from
``SGLANG_CPU_OMP_THREADS_BIND`` (the r-th ``|``-separated group), else gives each rank a
NUMA node; so when the operator has not set it, the profiler splits the cores this process
may use into N contiguous groups and sets it. Ranks 1..N-1 are pinned to their group;
rank 0 shares the profiling process with the co-run trainer and decodes on its group's
core count less the trainer's. Nothing here imports torch.
Rules: profiles/README.md, 'Tensor parallelism'.
"""

from __future__ import annotations

import os
from typing import Iterable

THREADS_BIND_VAR = "SGLANG_CPU_OMP_THREADS_BIND"  # SGLang's (sglang.srt.utils.numa_utils)


class TensorParallelError(ValueError):
    """``--tp`` cannot run with this engine or on this machine; the message names the flag."""


def check_engine(tp_size: int, engine_name: str) -> None:
    if tp_size < 1:
        raise TensorParallelError(f"--tp={tp_size}: must be >= 1 (tensor-parallel ranks)")
    if tp_size > 1 and engine_name != "sglang":
        raise TensorParallelError(
            f"--tp {tp_size}: the {engine_name} engine decodes in one process and cannot shard the model; "
            "use --engine sglang (SGLang runs one process per TP rank)"
        )


def check_gpus(tp_size: int, device: str, visible_gpus: int) -> None:
    """Rank r decodes on GPU r, as SGLang places ranks (its --base-gpu-id 0)."""
    if tp_size == 1:
        return
    ordinal = device.partition(":")[2]
    if ordinal not in ("", "0"):
        raise TensorParallelError(
            f"--tp {tp_size} with --device {device}: the ranks take GPUs 0..{tp_size - 1}; "
            "choose other GPUs with CUDA_VISIBLE_DEVICES instead"
        )
    if visible_gpus < tp_size:
        raise TensorParallelError(f"--tp {tp_size}: needs {tp_size} GPUs, {visible_gpus} visible (CUDA_VISIBLE_DEVICES)")


def usable_cpus() -> list[int]:
    """The CPU ids this process may run on (its affinity mask, where the OS has one)."""
    if hasattr(os, "sched_getaffinity"):
        return sorted(os.sched_getaffinity(0))
    return list(range(os.cpu_count() or 1))


def split_cores(cores: Iterable[int], tp_size: int) -> tuple[tuple[int, ...], ...]:
    """``cores`` in ``tp_size`` contiguous groups, sizes differing by at most one (the
    first groups the larger), or TensorParallelError when there are fewer cores than ranks."""
    cores = sorted(cores)
    if len(cores) < tp_size:
        raise TensorParallelError(
            f"--tp {tp_size}: needs at least {tp_size} CPU cores (one per rank), this process may use "
            f"{len(cores)} ({format_cores(cores)}, os.sched_getaffinity)"
        )
    size, extra = divmod(len(cores), tp_size)
    groups, start = [], 0
    for rank in range(tp_size):
        end = start + size + (1 if rank < extra else 0)
        groups.append(tuple(cores[start:end]))
        start = end
    return tuple(groups)


def format_cores(cores: Iterable[int]) -> str:
    """``0-3,8,10-11``: runs of consecutive ids as ranges (the form taskset and SGLang read)."""
    cores = sorted(cores)
    runs: list[str] = []
    index = 0
    while index < len(cores):
        end = index
        while end + 1 < len(cores) and cores[end + 1] == cores[end] + 1:
            end += 1
        runs.append(str(cores[index]) if end == index else f"{cores[index]}-{cores[end]}")
        index = end + 1
    return ",".join(runs)


def format_threads_bind(groups: tuple[tuple[int, ...], ...]) -> str:
    return "|".join(format_cores(group) for group in groups)


def parse_threads_bind(text: str, tp_size: int, usable: Iterable[int]) -> tuple[tuple[int, ...], ...]:
    """Rank r's cores from an operator's SGLANG_CPU_OMP_THREADS_BIND, checked: one group
    per rank, each a list of ids and ranges that this process may run on."""
    usable = set(usable)
    groups_text = text.split("|")
    if len(groups_text) != tp_size:
        raise TensorParallelError(
            f"--tp {tp_size} with {THREADS_BIND_VAR}={text!r}: {len(groups_text)} '|'-separated core group(s), "
            f"need one per rank ({tp_size}); unset it to let harvest split the cores"
        )
    groups = []
    for rank, group_text in enumerate(groups_text):
        cores: set[int] = set()
        try:
            for part in group_text.split(","):
                first, _, last = part.strip().partition("-")
                cores.update(range(int(first), int(last or first) + 1))
        except ValueError:
            raise TensorParallelError(
                f"{THREADS_BIND_VAR}={text!r}: rank {rank}'s group {group_text!r} is not a list of core ids and ranges "
                "(e.g. 0-3,8)"
            ) from None
        outside = sorted(cores - usable)
        if not cores or outside:
            raise TensorParallelError(
                f"{THREADS_BIND_VAR}={text!r}: rank {rank}'s cores {format_cores(outside) or '(none)'} are not usable by "
                f"this process (it may use {format_cores(usable)})"
            )
        groups.append(tuple(sorted(cores)))
    return tuple(groups)


def cpu_core_groups(tp_size: int, environ: dict | None = None, usable: Iterable[int] | None = None) -> tuple[tuple[int, ...], ...]:
    """Each rank's cores: the operator's SGLANG_CPU_OMP_THREADS_BIND when set, else the
    usable cores split evenly (and the variable set to say so, for SGLang's processes).
    One rank: every usable core, the variable untouched."""
    environ = os.environ if environ is None else environ
    usable = usable_cpus() if usable is None else sorted(usable)
    if tp_size == 1:
        return (tuple(usable),)
    given = environ.get(THREADS_BIND_VAR)
    if given:
        return parse_threads_bind(given, tp_size, usable)
    groups = split_cores(usable, tp_size)
    environ[THREADS_BIND_VAR] = format_threads_bind(groups)
    return groups
