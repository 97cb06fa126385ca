"""SGLang's decode CUDA graphs, captured once per SM level (Harli: one graph per (level, batch size)).

A graph replayed on a green-context stream keeps the SMs of the context it was captured
in, so harvest has SGLang's decode graph runner capture one set per ladder level, on the
level's decode stream (SGLang's PD-multiplexing machinery, switched on for that runner
alone), and the Colocation selects the step plan's set before its forward. Invariants:
the sets share SGLang's graph memory pool and never run concurrently; every SGLang
attribute used is in :data:`SGLANG_ATTRIBUTES`, resolved by the plugin at load.

Rules: docs/sglang-integration.md, 'Decode graphs per SM level (harvest/sglang/level_graphs.py)'.
"""

from __future__ import annotations

import dataclasses
import importlib
import time

from harvest.logs import get_logger

logger = get_logger(__name__)

PDMUX_CONTEXT = "sglang.srt.multiplex.pdmux_context"
ATTENTION_SETUP = "sglang.srt.model_executor.model_runner_components.attention_backend_setup"
DECODE_RUNNER = "sglang.srt.model_executor.runner.decode_cuda_graph_runner.DecodeCudaGraphRunner"

SGLANG_ATTRIBUTES = [
    f"{PDMUX_CONTEXT}.set_current_stream_idx",
    f"{PDMUX_CONTEXT}.get_current_stream_idx",
    f"{PDMUX_CONTEXT}.get_stream_groups",
    f"{ATTENTION_SETUP}._build_resolved_backend",
    f"{ATTENTION_SETUP}.ResolvedAttentionBackendStr",
    f"{DECODE_RUNNER}.maybe_init_pdmux",
    f"{DECODE_RUNNER}.capture",
    f"{DECODE_RUNNER}._replay_attn_backend",
]


@dataclasses.dataclass(frozen=True)
class LevelCapture:
    level: int
    decode_sms: int
    extra_bytes: int  # device memory this level's graphs and attention metadata took


class SglangLevelGraphs:
    """SGLang's decode graphs, one set per ladder level; :meth:`select` picks the set the
    next decode forward replays."""

    def __init__(self, set_current_stream_idx, num_levels: int, captures: tuple[LevelCapture, ...],
                 capture_seconds: float):
        self._set_current = set_current_stream_idx
        self.num_levels = num_levels
        self.captures = captures
        self.capture_seconds = capture_seconds
        self.selected: int | None = None

    def select(self, index: int) -> None:
        if index != self.selected:
            self._set_current(index)  # SGLang checks the range
            self.selected = index

    @property
    def extra_bytes(self) -> int:
        return sum(capture.extra_bytes for capture in self.captures)

    def describe(self) -> str:
        per_level = ", ".join(f"level {c.level} ({c.decode_sms} SMs) {c.extra_bytes / 2**20:.0f} MiB"
                              for c in self.captures)
        return (f"decode CUDA graphs captured per SM level in {self.capture_seconds:.1f} s; "
                f"memory beyond SGLang's one set: {per_level}")


def capture_level_graphs(model_runner, ladder, *, memory_in_use=None,
                         sglang=importlib.import_module) -> SglangLevelGraphs | None:
    """Recapture ``model_runner``'s decode CUDA graphs once per level of ``ladder``, each
    on the level's decode stream. None when there is nothing to recapture: no decode
    graphs (``--disable-cuda-graph``, a CPU device: eager decode already launches on the
    level's stream) or a one-level ladder (SGLang's graphs, replayed on that level's
    stream, already have every SM). Raises at start-up if SGLang's runner is in a state
    harvest cannot take over.

    ``memory_in_use()``: bytes of device memory in use (default: the CUDA driver's view);
    ``sglang``: the module importer (tests pass fakes)."""
    runner = getattr(model_runner, "decode_cuda_graph_runner", None)
    if runner is None or runner is getattr(model_runner, "eager_runner", None):
        return None
    if str(getattr(model_runner, "device", "cuda")) != "cuda" or len(ladder.levels) < 2:
        return None
    if getattr(runner, "enable_pdmux", False):
        raise RuntimeError("harvest cannot run beside SGLang's PD multiplexing (--enable-pdmux): both partition the "
                           "SMs of the decode graphs")
    if memory_in_use is None:
        memory_in_use = _device_memory_in_use
    pdmux = sglang(PDMUX_CONTEXT)
    setup = sglang(ATTENTION_SETUP)
    streams = [level.decode_stream for level in ladder.levels]
    if any(stream is None for stream in streams):
        raise RuntimeError("harvest: a ladder level has no decode stream; per-level decode graphs need one per level")

    began = time.perf_counter()
    resolved = setup.ResolvedAttentionBackendStr(prefill=model_runner.prefill_attention_backend_str,
                                                 decode=model_runner.decode_attention_backend_str)
    before = memory_in_use()
    backends = []
    for _ in ladder.levels:
        backend = setup._build_resolved_backend(model_runner=model_runner, resolved=resolved, init_new_workspace=False)
        backend.prefill_attention_backend_str = resolved.prefill
        backend.decode_attention_backend_str = resolved.decode
        backends.append(backend)
    # SGLang's stream groups are (prefill stream, decode stream); the decode runner uses
    # the decode one. The module global is what get_stream_groups() hands the runner.
    pdmux.STREAM_GROUPS = [(stream, stream) for stream in streams]
    pdmux.set_current_stream_idx(ladder.whole_device_index)
    model_runner.decode_attn_backend_group = backends
    runner.enable_pdmux = True
    runner.maybe_init_pdmux()  # the runner's stream groups; each backend's graph metadata buffers
    runner.capture()  # one set per stream group, keyed by stream index, in the global graph pool
    total_extra = max(0, memory_in_use() - before)
    seconds = time.perf_counter() - began
    # Capture is one call for all levels; the extra memory is shared out evenly (the
    # level sets are the same shapes, and the pool is shared).
    share = total_extra // len(ladder.levels)
    captures = tuple(LevelCapture(i, level.decode_sms, share) for i, level in enumerate(ladder.levels))
    graphs = SglangLevelGraphs(pdmux.set_current_stream_idx, len(ladder.levels), captures, seconds)
    graphs.selected = ladder.whole_device_index
    logger.info("%s", graphs.describe())
    return graphs


def _device_memory_in_use() -> int:
    import torch

    free, total = torch.cuda.mem_get_info()
    return total - free
