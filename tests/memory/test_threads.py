"""Lend/reclaim on one thread while another allocates and frees: the locks hold up.

ctypes releases the GIL in every call, so the two threads really run inside the
library at the same time."""

from __future__ import annotations

import random
import threading
import time

import pytest

from .conftest import PAGE_BYTES


@pytest.mark.timeout(60)
def test_concurrent_lend_reclaim_and_allocation(make_allocator):
    alloc = make_allocator()
    stop = threading.Event()
    errors: list[BaseException] = []
    moves = {"lend": 0, "reclaim": 0, "alloc": 0}

    def controller():
        rng = random.Random(1)
        try:
            while not stop.is_set():
                chunk = rng.randrange(alloc.geometry.num_chunks)
                if alloc.can_lend(chunk):
                    alloc.lend(chunk)
                    moves["lend"] += 1
                elif alloc.can_reclaim(chunk):
                    try:
                        alloc.reclaim(chunk)
                        moves["reclaim"] += 1
                    except ValueError as exc:  # the trainer took a page between query and reclaim
                        assert "still used by the trainer" in str(exc)
        except BaseException as exc:  # noqa: BLE001 - reported by the main thread
            errors.append(exc)

    def trainer():
        rng = random.Random(2)
        live = []
        try:
            while not stop.is_set():
                if live and rng.random() < 0.5:
                    live.pop(rng.randrange(len(live))).free()
                else:
                    size = rng.choice((100, 5000, PAGE_BYTES, 3 * PAGE_BYTES))
                    block = alloc.allocate(size)
                    if block is not None:
                        live.append(block)
                        moves["alloc"] += 1
            for block in live:
                block.free()
        except BaseException as exc:  # noqa: BLE001
            errors.append(exc)

    def checker():
        try:
            while not stop.is_set():
                alloc.check_integrity()
                alloc.stats()
        except BaseException as exc:  # noqa: BLE001
            errors.append(exc)

    threads = [threading.Thread(target=fn) for fn in (controller, trainer, checker)]
    for thread in threads:
        thread.start()
    # Two seconds at least, then until every kind of move happened often enough: how much
    # a starved thread gets done in a fixed time is the machine's business, not the test's.
    started, deadline = time.monotonic(), time.monotonic() + 120
    while time.monotonic() < deadline and not errors and (
            time.monotonic() - started < 2.0 or moves["lend"] <= 10 or moves["reclaim"] <= 10 or moves["alloc"] <= 100):
        time.sleep(0.05)
    stop.set()
    for thread in threads:
        thread.join(timeout=20)
        assert not thread.is_alive(), "a thread hung (lock-order problem?)"
    assert not errors, errors
    assert moves["lend"] > 10 and moves["reclaim"] > 10 and moves["alloc"] > 100, moves
    alloc.check_integrity()
    if alloc.reclaimable_chunks():
        alloc.reclaim(alloc.reclaimable_chunks())
    assert alloc.stats().arena_allocations == alloc.stats().small_allocations == 0
