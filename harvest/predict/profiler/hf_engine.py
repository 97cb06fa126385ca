"""Decode steps through a plain transformers model with a KV cache.

For environments without SGLang, and for GPU profiles of a model built with random
weights. A step is one token per request with the previous steps' cache and greedy
choice; its latencies are transformers' kernels, not SGLang's, and the profile's
``provenance.engine`` says so. With ``graphs`` (on a GPU) a step is a captured
:class:`~harvest.engines.transformers.static_batch.StaticDecodeBatch` graph replayed on the
grid point's stream, as a server runs it. With ``kv="paged"`` (``--kv paged``) the grid
points run on one :class:`~harvest.engines.transformers.paged_batch.PagedDecodeBatch`
(its step's attention reads only each request's pages), eager or (``graphs``) captured per
grid point. This module adapts the transformers engine (harvest.engines.transformers) to
the profiler's engine interface.

Rules: profiles/README.md, 'The transformers engine (harvest/predict/profiler/hf_engine.py)'.
"""

from __future__ import annotations

from harvest.engines.transformers.model import DTYPES, load_causal_lm
from harvest.predict.profiler.engines import BaseDecodeEngine, EngineConfig, EngineError, synthetic_token_ids

class TransformersDecodeEngine(BaseDecodeEngine):
    name = "transformers"
    CAPTURE_WARMUP = 2  # eager steps before a capture (lazy allocations, library handles)
    PAGED_STEPS = 64  # --kv paged: steps a grid point may take when the config does not say (steps_per_point 0)

    def __init__(self, config: EngineConfig):
        import torch

        if config.tp_size != 1:  # the command refuses --tp > 1 first, naming the flag
            raise EngineError(f"the transformers engine runs one process: tp_size={config.tp_size} needs --engine sglang")
        if config.dtype not in DTYPES:
            raise EngineError(f"--dtype={config.dtype!r}: one of {', '.join(sorted(DTYPES))}")
        self._torch = torch
        self.config = config
        self.model = load_causal_lm(config.model_path, config.device, config.dtype, config.random_weights)
        max_positions = getattr(self.model.config, "max_position_embeddings", None)
        if max_positions is not None and config.max_context_tokens > max_positions:
            raise EngineError(
                f"context lengths up to {config.max_context_tokens} tokens (grid + steps) exceed the model's "
                f"max_position_embeddings {max_positions}; lower --context-lengths"
            )
        self.vocab_size = self.model.config.vocab_size
        self.model_dtype = self.config.dtype
        self._cache = None
        self._next_ids = None
        self._length = 0
        self._batch_size = 0
        self._serial = 0
        self._static = None  # graphs: the grid point's StaticDecodeBatch and its graph
        self._graph = None
        self._paged = None  # kv="paged": the batch every grid point joins (built at the first one)
        self._paged_rows = 0  # the grid point's rows, and whether its last step's bookkeeping is owed
        self._paged_owed = False
        if config.kv not in ("static", "paged"):
            raise EngineError(f"--kv {config.kv!r}: static or paged")
        if config.graphs and not str(config.device).startswith("cuda"):
            raise EngineError(f"decode CUDA graphs need a CUDA device, not {config.device!r} (--graphs on); use --graphs off or auto")
        if config.graphs and config.steps_per_point < 1:
            raise EngineError("decode CUDA graphs need EngineConfig.steps_per_point (the steps a grid point takes)")

    def prepare(self, batch_size: int, context_length: int) -> None:
        torch = self._torch
        self.release()
        if self.config.kv == "paged":
            self._prepare_paged(batch_size, context_length)
            return
        if self.config.graphs:
            self._prepare_graph(batch_size, context_length)
            return
        rows = []
        for _ in range(batch_size):
            self._serial += 1
            rows.append(synthetic_token_ids(context_length, self.vocab_size, self._serial))
        input_ids = torch.tensor(rows, device=self.config.device)
        with torch.inference_mode():
            out = self.model(input_ids=input_ids, use_cache=True, logits_to_keep=1)
        self._cache = out.past_key_values
        self._next_ids = out.logits[:, -1, :].argmax(dim=-1, keepdim=True)
        self._length = context_length
        self._batch_size = batch_size

    def _prepare_graph(self, batch_size: int, context_length: int) -> None:
        """A static batch of random KV (a step's cost does not depend on its values), its
        step warmed up and captured on the current stream, then put back to the context."""
        from harvest.engines.transformers.captured_graphs import TorchGraphBackend
        from harvest.engines.transformers.static_batch import StaticDecodeBatch

        torch = self._torch
        # Room for the steps this point takes and no more: the attention of a step reads
        # every column of the static cache, so a larger cache would inflate small contexts.
        steps = max(self.config.steps_per_point, self.CAPTURE_WARMUP)
        self._serial += 1
        batch = StaticDecodeBatch(self.model, self.config.device, batch_size, context_length, max_steps=steps,
                                  seed=self.config.seed + self._serial)
        stream = torch.cuda.current_stream()
        for _ in range(self.CAPTURE_WARMUP):
            batch.decode_step()
        stream.synchronize()
        backend = TorchGraphBackend()
        graph = backend.new_graph()
        # thread_local: the co-run trainer's CUDA calls on its own thread do not spoil the capture.
        with backend.capture(graph, stream, pool=None):
            batch.decode_step()
        batch.reset()
        stream.synchronize()
        self._static, self._graph = batch, graph
        self._length, self._batch_size = context_length, batch_size

    def _prepare_paged(self, batch_size: int, context_length: int) -> None:
        """``batch_size`` requests of random KV join the paged batch, with pages for every
        step the point takes; with graphs their step is warmed up and captured on the
        current stream, then rewound to the context."""
        from harvest.engines.transformers.paged_batch import PagedDecodeBatch

        torch = self._torch
        # Pages for the steps this point takes (the capture's included): none is allocated mid-point.
        steps = max(self.config.steps_per_point or self.PAGED_STEPS, self.CAPTURE_WARMUP + 1)
        if self._paged is None:
            self._paged = PagedDecodeBatch(self.model, self.config.device, self.config.max_batch_size,
                                           self.config.max_context_tokens, steps, seed=self.config.seed,
                                           page_size=self.config.page_size)
        batch = self._paged
        batch.add_bucket(batch_size)
        batch.join(range(batch_size), [context_length] * batch_size)
        batch.reserve_ahead(steps)
        self._paged_rows, self._paged_owed = batch_size, False
        if self.config.graphs:
            stream = torch.cuda.current_stream()
            for _ in range(self.CAPTURE_WARMUP):
                batch.decode_step(batch_size)
            stream.synchronize()
            from harvest.engines.transformers.captured_graphs import TorchGraphBackend

            backend = TorchGraphBackend()
            graph = backend.new_graph()
            with backend.capture(graph, stream, pool=None):
                batch.decode_step(batch_size)
            batch.rewind()
            stream.synchronize()
            self._graph = graph
        self._length, self._batch_size = context_length, batch_size

    def begin_step(self) -> float:
        if self._paged_rows:
            batch = self._paged
            if self._paged_owed:  # the previous step's host bookkeeping, out of the timed step
                batch.after_step()
                self._paged_owed = False
            if max(batch.steps_taken) >= batch.max_steps:
                raise EngineError(f"a grid point took more than the {batch.max_steps} steps it has pages for")
            return float(batch.padded_sum_context())  # the pages each request's attention reads
        if self._static is not None:
            if self._static.steps_left <= 0:
                raise EngineError(f"a grid point took more than the {self._static.max_steps} steps its cache holds")
            # The graph's attention reads every column of the static cache, whatever the step.
            return float(self._static.padded_sum_context())
        if self._cache is None:
            raise EngineError("TransformersDecodeEngine.begin_step before prepare")
        # Σctx counts the token being decoded, as SGLang's seq_lens_sum does.
        return float(self._batch_size * (self._length + 1))

    def step(self) -> None:
        torch = self._torch
        if self._paged_rows:
            if self._graph is not None:
                self._graph.replay()
            else:
                self._paged.decode_step(self._paged_rows)
            self._paged_owed = True
            self._length += 1
            return
        if self._graph is not None:
            self._graph.replay()
            self._static.length += 1
            self._length += 1
            return
        with torch.inference_mode():
            positions = torch.full((self._batch_size, 1), self._length, device=self.config.device, dtype=torch.long)
            out = self.model(
                input_ids=self._next_ids, past_key_values=self._cache, position_ids=positions, use_cache=True, logits_to_keep=1
            )
            self._next_ids = out.logits[:, -1, :].argmax(dim=-1, keepdim=True)
        self._cache = out.past_key_values
        self._length += 1

    def release(self) -> None:
        if self._graph is not None:
            self._torch.cuda.current_stream().synchronize()  # no replay in flight when its memory goes
        self._cache = None
        self._next_ids = None
        self._static = None
        self._graph = None
        if self._paged_rows:
            self._paged.leave(list(self._paged.request_ids))  # its pages back to the pool
            self._paged_rows, self._paged_owed = 0, False

    def close(self) -> None:
        self.release()
        self._paged = None
