"""harvest.engines.transformers.captured_graphs with a fake graph/stream backend (no
CUDA): the level's own graph is the one replayed, on the level's stream; captures run on
the level's stream into one shared pool; a missing (level, batch size) runs eagerly
there; memory is accounted per capture and per level."""

from __future__ import annotations

import contextlib
import itertools

import pytest

from harvest.engines.transformers.captured_graphs import CapturedLevelGraphs
from harvest.ladder import Level


class FakeGraph:
    def __init__(self, serial):
        self.serial, self.stream, self.pool, self.ops = serial, None, None, []


class FakeBackend:
    """Records where work runs: ``current`` is the stream a ``run`` would launch on."""

    def __init__(self, unavailable=None, growth=(1000, 4096)):
        self.unavailable = unavailable
        self.current = "default"
        self.log: list[tuple] = []
        self.pools: list[str] = []
        self.capturing: FakeGraph | None = None
        self.serial = itertools.count()
        self.allocated = self.reserved = 0
        self.growth = growth

    def new_pool(self):
        self.pools.append(f"pool{len(self.pools)}")
        return self.pools[-1]

    def new_graph(self):
        return FakeGraph(next(self.serial))

    @contextlib.contextmanager
    def capture(self, graph, stream, pool):
        saved, self.current, self.capturing = self.current, stream, graph
        graph.stream, graph.pool = stream, pool
        self.log.append(("capture", graph.serial, stream, pool))
        try:
            yield
        finally:
            self.current, self.capturing = saved, None
            self.allocated += self.growth[0]
            self.reserved += self.growth[1]

    @contextlib.contextmanager
    def on_stream(self, stream):
        saved, self.current = self.current, ("default" if stream is None else stream)
        try:
            yield
        finally:
            self.current = saved

    def wait(self, stream, other):
        self.log.append(("wait", stream, other))

    def synchronize(self, stream):
        pass

    def replay(self, graph):
        self.log.append(("replay", graph.serial, self.current, graph.stream))

    def memory(self):
        return self.allocated, self.reserved

    def step(self, name):
        """A decode step: recorded into the graph being captured, else run now."""
        def run():
            if self.capturing is not None:
                self.capturing.ops.append(name)
            else:
                self.log.append(("eager", name, self.current))
        return run


LEVELS = (Level(24, 108, "s24", "t24"), Level(80, 52, "s80", "t80"), Level(132, 0, "s132", None))


def test_capture_runs_on_the_levels_stream_into_one_shared_pool():
    backend = FakeBackend()
    graphs = CapturedLevelGraphs(LEVELS, backend, warmup=2)
    for level in range(3):
        for bs in (8, 32):
            record = graphs.capture(level, bs, backend.step(f"L{level}b{bs}"))
            assert (record.level, record.batch_size) == (level, bs) and graphs.has(level, bs)
    assert backend.pools == ["pool0"]  # one pool for every level and batch size
    captures = [entry for entry in backend.log if entry[0] == "capture"]
    assert [(c[2], c[3]) for c in captures] == [(s, "pool0") for s in ("s24", "s24", "s80", "s80", "s132", "s132")]
    # the warm-up ran eagerly on the same stream, twice per capture
    warmups = [entry for entry in backend.log if entry[0] == "eager"]
    assert warmups[:2] == [("eager", "L0b8", "s24")] * 2 and len(warmups) == 12
    assert {("eager", f"L{lv}b{bs}", LEVELS[lv].decode_stream) for lv in range(3) for bs in (8, 32)} == set(warmups)


def test_replay_runs_the_levels_own_graph_on_its_stream():
    backend = FakeBackend()
    graphs = CapturedLevelGraphs(LEVELS, backend, warmup=0)
    made = {(level, 16): graphs.capture(level, 16, backend.step(f"L{level}")) for level in range(3)}
    assert all(made.values())
    backend.log.clear()
    for level in (2, 0, 1, 1):
        assert graphs.replay(level, 16, eager=backend.step("never")) is True
    replays = [entry for entry in backend.log if entry[0] == "replay"]
    # graph serials 0, 1, 2 were captured for levels 0, 1, 2
    assert [(serial, current, captured_on) for _, serial, current, captured_on in replays] == [
        (2, "s132", "s132"), (0, "s24", "s24"), (1, "s80", "s80"), (1, "s80", "s80")]
    assert not [entry for entry in backend.log if entry[0] == "eager"]


def test_a_missing_level_or_batch_size_runs_eagerly_on_the_levels_stream():
    backend = FakeBackend()
    graphs = CapturedLevelGraphs(LEVELS, backend, warmup=0)
    graphs.capture(1, 32, backend.step("captured"))
    backend.log.clear()
    assert graphs.replay(1, 8, eager=backend.step("eager-b8")) is False  # batch size not captured
    assert graphs.replay(0, 32, eager=backend.step("eager-L0")) is False  # level not captured
    assert graphs.replay(1, 32, eager=backend.step("unused")) is True
    assert [e for e in backend.log if e[0] in ("eager", "replay")] == [
        ("eager", "eager-b8", "s80"), ("eager", "eager-L0", "s24"), ("replay", 0, "s80", "s80")]
    with pytest.raises(KeyError, match="no decode graph for level 0, batch size 32"):
        graphs.replay(0, 32)
    with pytest.raises(IndexError, match="level index 3 out of range"):
        graphs.replay(3, 32, eager=backend.step("x"))


def test_a_switch_of_stream_waits_for_the_previous_one():
    backend = FakeBackend()
    graphs = CapturedLevelGraphs(LEVELS, backend, warmup=0)
    for level in range(3):
        graphs.capture(level, 4, backend.step(f"L{level}"))
    backend.log.clear()
    for level in (0, 0, 2, 1):
        graphs.replay(level, 4)
    assert [e for e in backend.log if e[0] == "wait"] == [("wait", "s24", "s132"), ("wait", "s132", "s24"),
                                                          ("wait", "s80", "s132")]


def test_memory_is_accounted_per_capture_and_per_level():
    backend = FakeBackend(growth=(100, 2 << 20))
    graphs = CapturedLevelGraphs(LEVELS, backend, warmup=0)
    graphs.capture(0, 8, backend.step("a"))
    graphs.capture(0, 32, backend.step("b"))
    backend.growth = (100, 0)  # the shared pool already holds what level 1 needs
    graphs.capture(1, 32, backend.step("c"))
    assert graphs.captures[(0, 8)].reserved_bytes == 2 << 20 and graphs.captures[(0, 8)].allocated_bytes == 100
    assert graphs.memory_by_level() == {0: {"graphs": 2, "allocated_bytes": 200, "reserved_bytes": 4 << 20},
                                        1: {"graphs": 1, "allocated_bytes": 100, "reserved_bytes": 0}}


def test_without_cuda_nothing_is_captured_and_every_step_is_eager():
    backend = FakeBackend(unavailable="CUDA graphs need a CUDA device")
    graphs = CapturedLevelGraphs((Level(1, 1),), backend)
    assert graphs.capture(0, 4, backend.step("x")) is None and graphs.unavailable == "CUDA graphs need a CUDA device"
    assert not graphs.has(0, 4) and backend.pools == []
    assert graphs.replay(0, 4, eager=backend.step("eager")) is False
    assert backend.log == [("eager", "eager", "default")]


def test_close_drops_the_graphs():
    backend = FakeBackend()
    graphs = CapturedLevelGraphs(LEVELS, backend, warmup=0)
    graphs.capture(0, 4, backend.step("x"))
    graphs.close()
    assert not graphs.has(0, 4)
    graphs.capture(0, 4, backend.step("y"))
    assert backend.pools == ["pool0", "pool1"]


def test_the_torch_backend_imports_lazily_and_says_why_it_cannot_capture_on_cpu():
    import torch

    from harvest.engines.transformers.captured_graphs import TorchGraphBackend

    backend = TorchGraphBackend()
    if torch.cuda.is_available():
        assert backend.unavailable is None
    else:
        assert "CUDA graphs need a CUDA device" in backend.unavailable
        graphs = CapturedLevelGraphs((Level(1, 1),))
        ran = []
        assert graphs.replay(0, 1, eager=lambda: ran.append(1)) is False and ran == [1]
