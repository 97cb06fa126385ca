"""How long a lend and a reclaim of one KV chunk take through the unified allocator while
the device is busy with decode-like work (`harvest profile` writes the result as the
profile's ``memory`` section; :mod:`harvest.memory.lend_costs` reads it).

A small pool of the served geometry (layers, KV heads per rank, head dim, KV dtype; the
page size the server uses: the driver's granularity on CUDA, 64 KiB host pages on a
CPU). Its first ``KEPT_CHUNKS`` chunks stay with "decode": a thread runs decode-like
passes over them (a reduction over every layer's K and V slice of those chunks and a
matrix product standing for the weights; on CUDA on a stream of its own, each pass ended
by a synchronisation, as a decode step ends) while the calling thread lends and reclaims
the other chunks one at a time, as harvest's lending controller does (``lend(wait=False)``
completed by ``finish_lends``, then ``reclaim``). Figures: medians over the rounds, per
chunk and per page. The allocator's fence stream is an idle stream of its own, so a
figure is the driver's work under load, not a wait for queued decode work (the auto
reserve counts that as the trainer's acknowledgement, one step). The host backend runs
the same code path; only a GPU's figures say what a GPU server pays.
"""

from __future__ import annotations

import dataclasses
import statistics
import threading
import time
from typing import Any

KEPT_CHUNKS = 2  # read by the decode-like load, never lent
TIMED_CHUNKS = 4  # lent and reclaimed in turn
DEFAULT_ROUNDS = 24
FINISH_TIMEOUT_S = 30.0


class LendTimingError(RuntimeError):
    """The measurement could not be made; the message says why."""


@dataclasses.dataclass(frozen=True)
class KvShape:
    """One rank's KV cache layout: what sizes a chunk."""

    num_layers: int
    kv_heads: int  # on one tensor-parallel rank
    head_dim: int
    dtype_bytes: int

    def __post_init__(self) -> None:
        for field in dataclasses.fields(self):
            value = getattr(self, field.name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise LendTimingError(f"KvShape.{field.name}={value!r}: must be an integer >= 1")

    @classmethod
    def of_model(cls, config: dict, dtype_bytes: int, tp_size: int = 1) -> "KvShape":
        """From a decoder's ``config.json`` (as SGLang's MHA pool lays it out: KV heads
        split over the ranks, at least one per rank); LendTimingError when the config lacks
        a field or uses latent attention (harvest backs MHA pools only)."""
        if config.get("kv_lora_rank"):
            raise LendTimingError("latent attention (kv_lora_rank): harvest backs MHA KV pools only")
        try:
            heads = config["num_attention_heads"]
            kv_heads = config.get("num_key_value_heads") or heads
            head_dim = config.get("head_dim") or config["hidden_size"] // heads
            return cls(config["num_hidden_layers"], max(1, kv_heads // tp_size), head_dim, dtype_bytes)
        except (KeyError, TypeError, ZeroDivisionError) as exc:
            raise LendTimingError(f"config.json lacks the KV layout ({type(exc).__name__}: {exc})") from None


@dataclasses.dataclass(frozen=True)
class LendTiming:
    """One measurement (module doc); ``busy_fraction``: the share of the timed calls that
    began and ended with the load running; ``load_passes``: decode-like passes done."""

    backend: str
    chunk_bytes: int
    page_bytes: int
    pages_per_chunk: int
    tokens_per_chunk: int
    rounds: int
    lend_ms_per_chunk: float
    reclaim_ms_per_chunk: float
    busy_fraction: float
    load_passes: int

    @property
    def lend_ms_per_page(self) -> float:
        return self.lend_ms_per_chunk / self.pages_per_chunk

    @property
    def reclaim_ms_per_page(self) -> float:
        return self.reclaim_ms_per_chunk / self.pages_per_chunk

    def section_fields(self) -> dict[str, Any]:
        """The profile's ``memory`` section (harvest.predict.schema.MemorySection)."""
        return {"chunk_bytes": self.chunk_bytes, "lend_ms_per_chunk": self.lend_ms_per_chunk,
                "reclaim_ms_per_chunk": self.reclaim_ms_per_chunk, "pages_per_chunk": self.pages_per_chunk}

    def describe(self) -> str:
        return (f"a lend {self.lend_ms_per_chunk:.3g} ms, a reclaim {self.reclaim_ms_per_chunk:.3g} ms per chunk of "
                f"{self.chunk_bytes / 2**20:.4g} MiB ({self.pages_per_chunk} pages of {self.page_bytes // 1024} KiB: "
                f"{self.lend_ms_per_page * 1e3:.3g} / {self.reclaim_ms_per_page * 1e3:.3g} us per page), "
                f"{self.backend} backend, median of {self.rounds}, {self.busy_fraction:.0%} of the calls under load")


def measure(shape: KvShape, *, backend: str = "host", device: int = 0, page_bytes: int = 0,
            rounds: int = DEFAULT_ROUNDS, load: bool = True) -> LendTiming:
    """Time ``rounds`` lends and reclaims of single chunks of ``shape``'s geometry (module
    doc); ``load``: False times them on an idle device (tests, comparisons)."""
    from harvest.memory import UnifiedAllocator

    if rounds < 1:
        raise LendTimingError(f"rounds={rounds}: must be >= 1")
    geometry_args = dict(num_layers=shape.num_layers, kv_heads=shape.kv_heads, head_dim=shape.head_dim,
                         dtype_bytes=shape.dtype_bytes, backend=backend, page_bytes=page_bytes, device=device)
    with UnifiedAllocator(max_tokens=1, **geometry_args) as probe:  # learns the chunk's tokens (the driver's page)
        tokens_per_chunk = probe.geometry.tokens_per_chunk
    alloc = UnifiedAllocator(max_tokens=(KEPT_CHUNKS + TIMED_CHUNKS) * tokens_per_chunk, **geometry_args)
    try:
        g = alloc.geometry
        decode = _DecodeLike(alloc, backend == "cuda") if load else None
        try:
            if backend == "cuda":
                import torch

                alloc.set_fence_streams([torch.cuda.Stream(torch.device("cuda", device))])  # idle: passes at once
            if decode is not None:
                decode.start()
            timed = list(range(KEPT_CHUNKS, KEPT_CHUNKS + TIMED_CHUNKS))
            _rounds(alloc, timed, len(timed), lambda: True)  # untimed: first touches
            lend_ms, reclaim_ms, loaded = _rounds(alloc, timed, rounds, decode.busy if decode else lambda: False)
        finally:
            passes = decode.stop() if decode is not None else 0
        alloc.check_integrity()
    finally:
        alloc.close()
    return LendTiming(backend=backend, chunk_bytes=g.chunk_bytes, page_bytes=g.page_bytes,
                      pages_per_chunk=g.pages_per_chunk, tokens_per_chunk=g.tokens_per_chunk, rounds=rounds,
                      lend_ms_per_chunk=statistics.median(lend_ms), reclaim_ms_per_chunk=statistics.median(reclaim_ms),
                      busy_fraction=sum(loaded) / len(loaded), load_passes=passes)


def _rounds(alloc, chunks: list[int], rounds: int, busy) -> tuple[list[float], list[float], list[bool]]:
    """Lend and reclaim one chunk at a time, ``rounds`` times: (lend ms, reclaim ms, whether
    each round began and ended under load)."""
    lend_ms, reclaim_ms, loaded = [], [], []
    for index in range(rounds):
        chunk = chunks[index % len(chunks)]
        was_busy = busy()
        started = time.perf_counter()
        done = alloc.lend([chunk], wait=False)
        while not done:  # its fences pending: finished by a later call, as the lending controller does
            done = chunk in alloc.finish_lends()
            if not done and time.perf_counter() - started > FINISH_TIMEOUT_S:
                alloc.cancel_lends([chunk])
                raise LendTimingError(f"the lend of chunk {chunk} did not finish within {FINISH_TIMEOUT_S:g} s")
            time.sleep(0)
        lent = time.perf_counter()
        alloc.reclaim([chunk])
        reclaimed = time.perf_counter()
        lend_ms.append((lent - started) * 1e3)
        reclaim_ms.append((reclaimed - lent) * 1e3)
        loaded.append(was_busy and busy())
    return lend_ms, reclaim_ms, loaded


class _DecodeLike:
    """Decode-like passes over the kept chunks, on a thread of its own (module doc)."""

    def __init__(self, alloc, on_cuda: bool):
        import torch

        g = alloc.geometry
        elements = KEPT_CHUNKS * g.page_bytes // 4  # float32 elements of the kept chunks in one K or V range
        self._slices = [alloc.kv_tensor(layer, kind, torch.float32)[:elements]
                        for layer in range(g.num_layers) for kind in ("k", "v")]
        for view in self._slices:
            view.fill_(1.0)
        device = self._slices[0].device
        size = 2048 if on_cuda else 128  # the weights' stand-in: a few ms of GEMM per pass on a GPU
        self._weights = torch.full((size, size), 1e-3, device=device)
        self._stream = torch.cuda.Stream(device) if on_cuda else None
        if on_cuda:
            torch.cuda.synchronize(device)
        self._stop, self._started = threading.Event(), threading.Event()
        self._thread = threading.Thread(target=self._run, name="harvest-lend-timing-load", daemon=True)
        self.passes = 0
        self.error: BaseException | None = None

    def _run(self) -> None:
        from harvest.compute.device import on_stream

        try:
            with on_stream(self._stream):
                while not self._stop.is_set():
                    total = sum(view.sum() for view in self._slices)
                    product = self._weights @ self._weights
                    if self._stream is not None:
                        self._stream.synchronize()  # a decode step ends in a sync (its sampled tokens)
                    del total, product
                    self.passes += 1
                    self._started.set()
        except BaseException as exc:  # noqa: BLE001 - reported by stop()
            self.error = exc
            self._started.set()

    def start(self) -> None:
        self._thread.start()
        self._started.wait(60)

    def busy(self) -> bool:
        return self._thread.is_alive() and self.passes > 0 and self.error is None

    def stop(self) -> int:
        """Stop the load and drop its views (the allocator closes only without them);
        LendTimingError if the load failed."""
        self._stop.set()
        self._thread.join()
        if self._stream is not None:
            self._stream.synchronize()
        self._slices.clear()
        if self.error is not None:
            raise LendTimingError(f"the decode-like load failed: {type(self.error).__name__}: {self.error}")
        return self.passes
