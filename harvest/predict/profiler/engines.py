"""The decode engines the profiler times, behind one small interface.

``sglang``: SGLang's own ModelRunner in this process — the kernels, attention backend,
KV pool and CUDA graphs of a served decode step (:mod:`.sglang_engine`).
``transformers``: a plain Hugging Face decode loop with a KV cache, for machines without
SGLang (:mod:`.hf_engine`); its latencies are the model's, not SGLang's.
"""

from __future__ import annotations

import abc
import dataclasses


class EngineError(RuntimeError):
    """The engine cannot run the requested model or grid point."""


@dataclasses.dataclass(frozen=True)
class EngineConfig:
    model_path: str
    device: str  # "cpu" or "cuda"
    dtype: str  # "float32", "bfloat16", "float16"
    random_weights: bool  # build from config.json with random weights (latency does not depend on values)
    max_batch_size: int
    max_context_tokens: int  # per request: largest context length + warm-up + timed steps
    seed: int = 0
    tp_size: int = 1  # tensor-parallel ranks (sglang only; rank 0 in this process, harvest.predict.profiler.sglang_ranks)
    rank_cores: tuple[tuple[int, ...], ...] = ()  # CPU: each rank's cores (tp_layout); (): not pinned
    graphs: bool = False  # transformers engine: each step a CUDA graph replay (sglang: its own graphs)
    steps_per_point: int = 0  # decode steps one grid point takes (warm-up + timed + 1); graphs size their cache by it
    kv: str = "static"  # transformers engine: "static" (a StaticCache / DynamicCache) or "paged" (PagedDecodeBatch)
    page_size: int = 16  # kv="paged": tokens per KV page


class BaseDecodeEngine(abc.ABC):
    """Contract: :meth:`prepare` builds a batch of ``batch_size`` requests each holding
    ``context_length`` tokens of KV cache (prefill, not timed). A decode step is
    :meth:`begin_step` (host-side bookkeeping the serving loop does before ``run_batch``,
    not timed; returns the batch's Σctx as the step sees it — SGLang's ``seq_lens_sum``,
    the token being decoded included) then :meth:`step` (timed: every request gains one
    token). Everything runs on the calling thread's current device stream."""

    name: str
    batch_size_buckets: tuple[int, ...] = ()  # CUDA-graph capture sizes the engine pads to
    model_dtype: str = ""

    @abc.abstractmethod
    def prepare(self, batch_size: int, context_length: int) -> None: ...

    @abc.abstractmethod
    def begin_step(self) -> float: ...

    @abc.abstractmethod
    def step(self) -> None: ...

    @abc.abstractmethod
    def release(self) -> None:
        """Free the current batch's KV cache."""

    def close(self) -> None:
        self.release()


def synthetic_token_ids(num_tokens: int, vocab_size: int, salt: int) -> list[int]:
    """Deterministic in-vocabulary token ids (values do not change a step's cost)."""
    usable = max(vocab_size - 16, 1)
    return [(7 * salt + 13 * j) % usable + 8 for j in range(num_tokens)]
