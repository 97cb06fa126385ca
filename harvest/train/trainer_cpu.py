"""The trainer thread's share of the CPU: its torch intra-op threads and its priority;
and, on a CPU device, decode's share: the cores the trainer leaves.

Invariants: the trainer's thread count (``cpu_threads``) and nice increment are set on that
thread only (:func:`claim_trainer_thread`), and the process default thread count is put
back (:func:`restore_process_default`), so the serving threads are left as they were; on a
CPU device decode runs on the cores the trainer does not use
(:func:`decode_threads_beside_trainer`).

Rules: docs/design.md, 'The trainer's CPU share (harvest/train/trainer_cpu.py)'; figures:
docs/measurements.md, 'The trainer's share of a CPU'.
"""

from __future__ import annotations

import dataclasses
import os
import sys
import threading

from harvest.settings import Integer, Number, Switch, setting, validate

DEFAULT_TRAINER_CPU_THREADS = 1
DEFAULT_TRAINER_NICE = 2
MAX_NICE = 19
# A unit in flight keeps its partition's SMs until it ends, so a level change waits for it:
# a quarter of the step bounds that wait, and leaves a unit long enough to carry its tokens.
DEFAULT_UNIT_STEP_FRACTION = 0.25


@dataclasses.dataclass(frozen=True)
class TrainerConfig:
    """harvest.yaml's ``trainer`` section (``harvest profile`` takes cpu_threads and nice as flags too)."""

    cpu_threads: int = setting(DEFAULT_TRAINER_CPU_THREADS, "torch CPU threads of the trainer's thread "
                               "(on a CPU device, decode keeps the other cores)", Integer(minimum=1, maximum=1024))
    nice: int = setting(DEFAULT_TRAINER_NICE, "nice increment of the trainer's thread: decode wins a contended core",
                        Integer(minimum=0, maximum=MAX_NICE))
    compile: str = setting("auto", "decoder layers' units compiled with torch.compile (fewer host operators per "
                           "unit); auto: on CUDA devices, not on a CPU", Switch())
    unit_step_fraction: float = setting(
        DEFAULT_UNIT_STEP_FRACTION, "jobs' unit_target_ms auto: a unit lasts this fraction of the decode step "
        "(qos.target_tpot_ms) on the trainer's smallest partition",
        Number(minimum=0.0, maximum=1.0, exclusive_minimum=True))

    def __post_init__(self) -> None:
        validate(self)


def limit_trainer_thread(num_threads: int) -> None:
    """On the trainer's thread, before its first torch operation."""
    import torch

    if num_threads < 1:
        raise ValueError(f"trainer CPU threads={num_threads}: must be >= 1")
    torch.get_num_threads()  # this thread's lazy thread initialisation, now, not after the next line
    torch.set_num_threads(num_threads)


def usable_cores() -> int:
    """CPU cores this process may run on (its affinity mask, where the OS has one)."""
    if hasattr(os, "sched_getaffinity"):
        return len(os.sched_getaffinity(0))
    return os.cpu_count() or 1


def decode_threads_beside_trainer(trainer_threads: int, decode_threads: int, cores: int | None = None) -> int:
    """Decode's torch intra-op threads on a CPU it shares with a trainer on
    ``trainer_threads``: the cores the trainer leaves (at least one), never more than
    ``decode_threads``, what decode has now."""
    if trainer_threads < 1 or decode_threads < 1:
        raise ValueError(f"trainer_threads={trainer_threads}, decode_threads={decode_threads}: both must be >= 1")
    cores = usable_cores() if cores is None else cores
    return max(1, min(decode_threads, cores - trainer_threads))


def oversubscription(trainer_threads: int, decode_threads: int, cores: int) -> str | None:
    """What to tell the operator when decode's and the trainer's threads exceed the cores
    (co-located steps will stall); None when they fit."""
    if decode_threads + trainer_threads <= cores:
        return None
    advice = f"; set trainer.cpu_threads to at most {cores - 1}" if cores >= 2 else ""
    return (f"the trainer's {trainer_threads} and decode's {decode_threads} torch thread(s) exceed this CPU's {cores} "
            f"core(s): co-located decode steps will stall{advice}")


def leave_cores_to_trainer(trainer_threads: int) -> tuple[int, int]:
    """On the decode (serving) thread of a CPU device, before the trainer starts: limit
    its intra-op threads to what :func:`decode_threads_beside_trainer` leaves it (this
    also becomes the process default torch gives threads initialised later). Returns
    (threads before, threads now)."""
    import torch

    before = torch.get_num_threads()
    after = decode_threads_beside_trainer(trainer_threads, before)
    if after != before:
        torch.set_num_threads(after)
    return before, after


def claim_trainer_thread(num_threads: int, nice_increment: int) -> None:
    """On the trainer's (or the profiler's co-run) thread, first thing: its CPU threads
    and its priority, as harvest.yaml's ``trainer`` section sets them."""
    limit_trainer_thread(num_threads)
    lower_this_thread_priority(nice_increment)


def process_default() -> int:
    """The calling (serving) thread's intra-op thread count, to restore later."""
    import torch

    return torch.get_num_threads()


def restore_process_default(num_threads: int) -> None:
    """On a serving thread, after :func:`limit_trainer_thread` ran on the trainer's
    thread: the serving thread's own count is unchanged (it was ``num_threads``); the
    process default for threads started later is ``num_threads`` again."""
    import torch

    torch.set_num_threads(num_threads)


def lower_this_thread_priority(increment: int) -> int | None:
    """Add ``increment`` to the calling thread's nice value (capped at 19); returns the new
    value, or None where threads cannot be prioritised one by one (not Linux) or for
    ``increment`` 0. Raising nice needs no privilege."""
    if increment < 0:
        raise ValueError(f"trainer nice increment={increment}: must be >= 0 (harvest only lowers the trainer's priority)")
    if increment == 0 or not sys.platform.startswith("linux"):
        return None
    thread_id = threading.get_native_id()
    nice = min(MAX_NICE, os.getpriority(os.PRIO_PROCESS, thread_id) + increment)
    os.setpriority(os.PRIO_PROCESS, thread_id, nice)  # Linux: PRIO_PROCESS with a thread id is that thread
    return nice
