"""The idle garbage collection: young generations are collected while the
scheduler is idle, only when a generation-0 collection happened since the last one."""

from __future__ import annotations

import gc
import types

import pytest

from harvest.colocate.colocation import Colocation


@pytest.fixture
def no_automatic_gc():
    enabled = gc.isenabled()
    gc.disable()  # only the collections this test makes
    yield
    if enabled:
        gc.enable()


def test_idle_collects_generation_one_only_after_a_generation_zero_collection(no_automatic_gc):
    runtime = types.SimpleNamespace(idle_gc_collections=0)
    gc.collect(1)
    assert gc.get_count()[1] == 0
    Colocation._collect_young_garbage(runtime)
    assert runtime.idle_gc_collections == 0  # nothing new since: nothing to do
    gc.collect(0)
    assert gc.get_count()[1] == 1
    cycle = []
    cycle.append(cycle)  # young cyclic garbage
    del cycle
    Colocation._collect_young_garbage(runtime)
    assert runtime.idle_gc_collections == 1 and gc.get_count()[:2] == (0, 0)
