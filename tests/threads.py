"""Running one piece of test work on several threads at once."""

from __future__ import annotations

import threading
from typing import Any, Callable


def on_threads(work: Callable[[int], Any], count: int, timeout_s: float) -> tuple[list, list[BaseException]]:
    """``work(i)`` for i in range(count), a thread each, started together; returns the
    results by i (None where it raised or had not returned after ``timeout_s``) and the
    exceptions raised."""
    results: list = [None] * count
    errors: list[BaseException] = []

    def run(index: int) -> None:
        try:
            results[index] = work(index)
        except BaseException as exc:  # noqa: BLE001 - returned to the test, which asserts on it
            errors.append(exc)

    threads = [threading.Thread(target=run, args=(i,)) for i in range(count)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout_s)
    return results, errors
