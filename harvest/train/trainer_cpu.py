"""The trainer thread's share of the CPU: its torch intra-op threads and its priority;
and, on a CPU device, decode's share: the cores the trainer leaves.

The trainer runs on a thread of the serving process; its threads and priority are set on
that thread only, decode's threads on the decode (scheduler) thread. The measurements
behind each choice are in docs/measurements.md ("The trainer's share of a CPU").

Threads. Left alone, the trainer's torch CPU operations would use the process's intra-op
thread count and start an OpenMP team of their own beside decode's; with more OpenMP
threads than cores, idle team threads sleep and every one of decode's small operations
pays a wake-up. So the trainer's thread gets ``cpu_threads`` (default 1).

``torch.set_num_threads`` sets the calling thread's OpenMP (and MKL) thread count, and
also the process default that a thread takes when torch first initialises its threads
(lazily: at its first parallel operation or ``get_num_threads``; that would overwrite a
count set before it). :func:`limit_trainer_thread` has the trainer thread initialise
first, then sets its count; :func:`restore_process_default` puts the default back, so the
serving threads are left exactly as they were.

Decode's share. On a CPU with few cores, decode's own OpenMP team (one thread per core
by default) plus the trainer's thread is still one thread more than cores, and a team
needs all its threads running at once to pass its barriers: now and then a co-located
step waits out whole OS time slices. So on a CPU, decode keeps the cores the trainer
does not use (:func:`decode_threads_beside_trainer`; the runtime and ``harvest profile``
both apply it), trading a higher co-located median for a bounded worst case.

Priority. At equal priority the OS hands a contended core to the trainer for whole time
slices while a decode thread waits, and decode's team stalls at its next barrier. A small
nice increment on the trainer's thread (Linux schedules threads individually) lets a
waking decode thread take the core at once; larger ones starve the trainer.
"""

from __future__ import annotations

import dataclasses
import os
import sys
import threading

from harvest.settings import Integer, Switch, setting, validate

DEFAULT_TRAINER_CPU_THREADS = 1
DEFAULT_TRAINER_NICE = 2
MAX_NICE = 19


@dataclasses.dataclass(frozen=True)
class TrainerConfig:
    """harvest.yaml's ``trainer`` section (``harvest profile`` takes cpu_threads and nice as flags too)."""

    cpu_threads: int = setting(DEFAULT_TRAINER_CPU_THREADS, "torch CPU threads of the trainer's thread "
                               "(on a CPU device, decode keeps the other cores)", Integer(minimum=1, maximum=1024))
    nice: int = setting(DEFAULT_TRAINER_NICE, "nice increment of the trainer's thread: decode wins a contended core",
                        Integer(minimum=0, maximum=MAX_NICE))
    compile: str = setting("auto", "decoder layers' units compiled with torch.compile (fewer host operators per "
                           "unit); auto: on CUDA devices, not on a CPU", Switch())

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
