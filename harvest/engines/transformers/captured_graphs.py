"""Decode CUDA graphs per SM ladder level: one graph per (level, batch size), captured on
that level's decode stream, every graph's memory in one shared pool.

Per level because a replayed graph keeps the SMs of the stream it was captured on.
Invariants: a level's graph is only replayed on its own level's stream, falling back to
``eager()`` there when it has none (or without CUDA); a capture or replay on another
stream than the previous one first waits for that stream's work (the graphs share the pool
and the caller's static buffers, which the caller owns). torch is imported by
:class:`TorchGraphBackend` only; tests give a fake backend.

Rules: docs/design.md §4, 'Decode graphs per level in the transformers engine'.
"""

from __future__ import annotations

import contextlib
import dataclasses
import time
from collections.abc import Callable, Sequence
from typing import Any

_NO_STREAM = object()  # nothing ran yet


@dataclasses.dataclass(frozen=True)
class Capture:
    """One captured graph and the device memory its capture added."""

    level: int
    batch_size: int
    allocated_bytes: int  # memory held by tensors after the capture minus before (the graph's outputs)
    reserved_bytes: int  # memory the allocator reserved after minus before: the shared pool's growth
    seconds: float  # warm-up and capture


class TorchGraphBackend:
    """torch.cuda's graphs, streams and memory counters."""

    def __init__(self) -> None:
        import torch

        self._torch = torch

    @property
    def unavailable(self) -> str | None:
        """Why graphs cannot be captured here, or None."""
        if not self._torch.cuda.is_available():
            return "CUDA graphs need a CUDA device (torch.cuda.is_available() is False)"
        return None

    def new_pool(self) -> Any:
        return self._torch.cuda.graph_pool_handle()

    def new_graph(self) -> Any:
        return self._torch.cuda.CUDAGraph()

    def capture(self, graph, stream, pool):
        # thread_local: a trainer thread's CUDA calls during the capture are not an error
        # (global mode would invalidate the capture for any thread's unsafe call).
        return self._torch.cuda.graph(graph, pool=pool, stream=stream, capture_error_mode="thread_local")

    def on_stream(self, stream):
        return contextlib.nullcontext() if stream is None else self._torch.cuda.stream(stream)

    def wait(self, stream, other) -> None:
        if stream is not None and other is not None:
            stream.wait_stream(other)

    def synchronize(self, stream) -> None:
        if stream is None:
            self._torch.cuda.synchronize()
        else:
            stream.synchronize()

    def replay(self, graph) -> None:
        graph.replay()

    def memory(self) -> tuple[int, int]:
        """(allocated, reserved) bytes, cached free blocks released first so that the
        reserved figure counts live tensors and graph pools only."""
        self._torch.cuda.synchronize()
        self._torch.cuda.empty_cache()
        return self._torch.cuda.memory_allocated(), self._torch.cuda.memory_reserved()


class CapturedLevelGraphs:
    """The decode graphs harvest captures itself (torch.cuda graphs through ``backend``)
    for one ladder (``levels``: harvest.ladder Levels with their decode streams), keyed by
    (level index, batch size)."""

    def __init__(self, levels: Sequence[Any], backend: Any = None, *, warmup: int = 2) -> None:
        self.levels = tuple(levels)
        self.backend = TorchGraphBackend() if backend is None else backend
        self.warmup = warmup
        self.captures: dict[tuple[int, int], Capture] = {}
        self._graphs: dict[tuple[int, int], Any] = {}
        self._pool = None
        self._last_stream: Any = _NO_STREAM

    @property
    def unavailable(self) -> str | None:
        """Why no graph can be captured here (every replay is eager), or None."""
        return self.backend.unavailable

    def has(self, level: int, batch_size: int) -> bool:
        return (level, batch_size) in self._graphs

    def capture(self, level: int, batch_size: int, run: Callable[[], Any]) -> Capture | None:
        """Warm ``run`` up and capture it on level ``level``'s decode stream for
        ``batch_size``; None (nothing captured) where graphs are unavailable."""
        if self.unavailable is not None:
            return None
        backend, stream = self.backend, self._stream(level)
        started = time.perf_counter()
        self._order(stream)
        with backend.on_stream(stream):
            for _ in range(self.warmup):
                run()
        backend.synchronize(stream)
        allocated, reserved = backend.memory()
        if self._pool is None:
            self._pool = backend.new_pool()
        graph = backend.new_graph()
        with backend.capture(graph, stream, self._pool):
            run()
        backend.synchronize(stream)
        allocated_after, reserved_after = backend.memory()
        self._graphs[(level, batch_size)] = graph
        record = Capture(level, batch_size, allocated_after - allocated, reserved_after - reserved,
                         time.perf_counter() - started)
        self.captures[(level, batch_size)] = record
        return record

    def replay(self, level: int, batch_size: int, eager: Callable[[], Any] | None = None) -> bool:
        """The graph of (``level``, ``batch_size``) on the level's decode stream; without
        one, ``eager()`` on that stream (KeyError when there is neither). Returns whether
        a graph ran."""
        stream = self._stream(level)
        graph = self._graphs.get((level, batch_size))
        if graph is None and eager is None:
            raise KeyError(f"no decode graph for level {level}, batch size {batch_size}, and no eager step")
        self._order(stream)
        with self.backend.on_stream(stream):
            if graph is None:
                eager()
                return False
            self.backend.replay(graph)
        return True

    def memory_by_level(self) -> dict[int, dict[str, int]]:
        """Per level: graphs captured and the memory their captures added (the first
        capture creates the shared pool; later ones add only what does not fit in it)."""
        report: dict[int, dict[str, int]] = {}
        for (level, _), record in sorted(self.captures.items()):
            entry = report.setdefault(level, {"graphs": 0, "allocated_bytes": 0, "reserved_bytes": 0})
            entry["graphs"] += 1
            entry["allocated_bytes"] += record.allocated_bytes
            entry["reserved_bytes"] += record.reserved_bytes
        return report

    def close(self) -> None:
        """Drop every graph and the pool (the caller synchronises its streams first)."""
        self._graphs.clear()
        self._pool = None
        self._last_stream = _NO_STREAM

    def _stream(self, level: int):
        if not 0 <= level < len(self.levels):
            raise IndexError(f"level index {level} out of range (0..{len(self.levels) - 1})")
        return self.levels[level].decode_stream

    def _order(self, stream) -> None:
        """Work on ``stream`` waits for what the previous stream was given (shared pool)."""
        last = self._last_stream
        if last is not _NO_STREAM and last is not stream:
            self.backend.wait(stream, last)
        self._last_stream = stream
