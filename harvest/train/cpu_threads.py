"""How many CPU threads the trainer's torch operations use, set on the trainer's own thread.

The trainer runs on a thread of the serving process. Left alone, its torch CPU operations
would use the process's intra-op thread count, so it would start an OpenMP team of its
own beside decode's. With more OpenMP threads than cores, GNU OpenMP stops spinning
between parallel regions and puts idle team threads to sleep, so every one of decode's
small operations pays a futex wake-up: measured on a 2-core CPU, decode steps ran 2.4x
slower with the trainer *paused* (bs 32: 15 ms against 6.3 ms; decode's second thread
busy 19 % of the time instead of 88 %). With the trainer's thread limited to one intra-op
thread, decode is back to its speed when the trainer is paused.

``torch.set_num_threads`` sets the calling thread's OpenMP (and MKL) thread count, and
also the process default that a thread takes when torch first initialises its threads
(lazily: at its first parallel operation or ``get_num_threads``; that would overwrite a
count set before it). :func:`limit_trainer_thread` has the trainer thread initialise
first, then sets its count; :func:`restore_process_default` puts the default back, so the
serving threads are left exactly as they were.
"""

from __future__ import annotations

DEFAULT_TRAINER_CPU_THREADS = 1


def limit_trainer_thread(num_threads: int) -> None:
    """On the trainer's thread, before its first torch operation."""
    import torch

    if num_threads < 1:
        raise ValueError(f"trainer CPU threads={num_threads}: must be >= 1")
    torch.get_num_threads()  # this thread's lazy thread initialisation, now, not after the next line
    torch.set_num_threads(num_threads)


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
