"""Decode batches whose step is a CUDA graph: every tensor a step reads or writes keeps
its address and a step reads nothing back to the host, so one capture per (ladder level,
batch size) replays on that level's decode stream (:mod:`.captured_graphs`).

Used where harvest decodes through transformers instead of SGLang: the profiler's
transformers engine (decode steps timed as graph replays, as SGLang serves them) and
the GPU co-location experiment (scripts/colocate_gpu.py). torch and transformers are
imported by the classes, not by this module.
"""

from __future__ import annotations

from harvest.engines.transformers.model import cache_layers, on_stream


class SlotRows:
    """What every slot batch shares (:class:`SlotDecodeBatch`, the paged batch): active
    slots ``[0, num_requests)``, the step on the smallest bucket holding them, the eager
    step. A subclass sets ``buckets``, ``request_ids``, ``lengths`` and defines
    ``check_room``, ``decode_step`` and ``after_step``."""

    @property
    def num_requests(self) -> int:
        return len(self.request_ids)

    @property
    def bucket(self) -> int:
        """The rows the next step computes: the smallest bucket holding the active slots."""
        return next(b for b in self.buckets if b >= self.num_requests)

    @property
    def computed_rows(self) -> int:
        return self.bucket

    def sum_context(self) -> int:
        return sum(self.lengths) + self.num_requests

    def step(self) -> None:
        """One token for every request, eager (on the caller's current stream)."""
        self.check_room()
        self.decode_step(self.bucket)
        self.after_step()


class SlotDecodeBatch(SlotRows):
    """Requests decoding together in ``max_batch_size`` fixed slots of one transformers
    ``StaticCache``, for CUDA graphs: every tensor a step reads or writes keeps its address
    and a step reads nothing back to the host, so :meth:`decode_step` can be captured once per
    (ladder level, bucket) and replayed (:mod:`.captured_graphs`). Invariants: each slot
    computes what it would decoding alone; a request stays at most ``max_steps`` steps; a step
    runs on the smallest bucket holding the active slots ``[0, num_requests)``; :meth:`join`
    and :meth:`leave` are host work outside the captured step.

    Layout and buckets: docs/design.md §4, 'Capturable decode batches'.
    """

    def __init__(self, model, device, max_batch_size: int, max_context: int, max_steps: int, *, buckets=None,
                 seed: int = 0):
        import torch

        self._torch = torch
        config = model.config
        self.model, self.config, self.device = model, config, torch.device(device)
        self.max_batch_size, self.max_context, self.max_steps = max_batch_size, max_context, max_steps
        self.max_length = max_context + max_steps
        self.kv_heads = config.num_key_value_heads
        self.head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        self.buckets = sorted({b for b in (buckets or ()) if 0 < b < max_batch_size} | {max_batch_size})
        self.generator = torch.Generator(device=self.device).manual_seed(seed)
        long = dict(dtype=torch.long, device=self.device)
        with torch.inference_mode():
            self.cache = self._new_cache(max_batch_size)
            self.ids = torch.zeros((max_batch_size, 1), **long)
            self.positions = torch.zeros((max_batch_size, 1), **long)
            self.write_position = torch.full((1,), max_context, **long)  # the shared write column
            self.mask = torch.zeros((max_batch_size, 1, 1, self.max_length), dtype=torch.bool, device=self.device)
            self.last_logits = torch.zeros((max_batch_size, config.vocab_size), dtype=model.dtype, device=self.device)
            self._views = {b: self._bucket_view(b) for b in self.buckets}
        self.request_ids: list[int] = []  # slot i holds request_ids[i]
        self.lengths: list[int] = []  # tokens each active slot holds in the KV cache
        self.steps_taken: list[int] = []  # ring columns each active slot has written

    def _new_cache(self, batch_size):
        from transformers import StaticCache

        torch = self._torch
        cache = StaticCache(config=self.config, max_cache_len=self.max_length)
        probe = torch.zeros((batch_size, self.kv_heads, 1, self.head_dim), dtype=self.model.dtype, device=self.device)
        for layer in cache.layers:
            layer.lazy_initialization(probe, probe)
        return cache

    def _bucket_view(self, bucket: int):
        """(cache, ids, positions, mask, logits) of slots ``[0, bucket)``: views of the
        full batch's tensors (the cache's layers share its keys, values and write column)."""
        if bucket == self.max_batch_size:
            cache = self.cache
        else:
            cache = self._new_cache(1)
            for layer, full in zip(cache.layers, self.cache.layers):
                layer.keys, layer.values = full.keys[:bucket], full.values[:bucket]
                layer.batch_size, layer.cumulative_length = bucket, full.cumulative_length
        return cache, self.ids[:bucket], self.positions[:bucket], self.mask[:bucket], self.last_logits[:bucket]

    def padded_sum_context(self) -> int:
        """The step's attention work: every computed row over every column of the cache."""
        return self.bucket * self.max_length

    def join(self, request_ids, context_lengths, prompts=None) -> None:
        """Requests holding ``context_lengths`` tokens of KV into the next free slots:
        random values, or (tests) the prefill of ``prompts`` (lists of token ids), each
        alone through the model (eager, on the caller's stream)."""
        torch = self._torch
        request_ids, context_lengths = list(request_ids), list(context_lengths)
        if self.num_requests + len(request_ids) > self.max_batch_size:
            raise ValueError(f"{len(request_ids)} requests join {self.num_requests} in {self.max_batch_size} slots")
        if max(context_lengths, default=0) > self.max_context:
            raise ValueError(f"a context of {max(context_lengths)} tokens exceeds max_context {self.max_context}")
        with torch.inference_mode():
            for i, length in enumerate(context_lengths):
                slot = self.num_requests + i
                if prompts is None:
                    for layer in self.cache.layers:
                        layer.keys[slot, :, :length].normal_(generator=self.generator)
                        layer.values[slot, :, :length].normal_(generator=self.generator)
                    self.ids[slot].random_(0, self.config.vocab_size, generator=self.generator)
                else:
                    if len(prompts[i]) != length:
                        raise ValueError(f"prompt {i}: {len(prompts[i])} tokens, context length {length}")
                    out = self.model(input_ids=torch.tensor([prompts[i]], device=self.device), use_cache=True)
                    for layer, (keys, values) in zip(self.cache.layers, cache_layers(out.past_key_values)):
                        layer.keys[slot, :, :length].copy_(keys[0])
                        layer.values[slot, :, :length].copy_(values[0])
                    self.ids[slot].copy_(out.logits[0, -1].argmax(-1, keepdim=True))
                self.mask[slot].fill_(False)
                self.mask[slot, ..., :length] = True
                self.positions[slot].fill_(length)
        self.request_ids += request_ids
        self.lengths += context_lengths
        self.steps_taken += [0] * len(request_ids)

    def leave(self, request_ids) -> None:
        """Free the slots of ``request_ids``: the last active slots move into the holes
        (rows of the cache, token ids, positions, mask), so the active ones stay first."""
        torch = self._torch
        gone = set(request_ids)
        keep = [slot for slot, rid in enumerate(self.request_ids) if rid not in gone]
        count = len(keep)
        holes = [slot for slot in range(count) if self.request_ids[slot] in gone]
        movers = [slot for slot in keep if slot >= count]
        if holes:
            dst, src = (torch.tensor(s, device=self.device) for s in (holes, movers))
            with torch.inference_mode():
                for layer in self.cache.layers:
                    layer.keys.index_copy_(0, dst, layer.keys.index_select(0, src))
                    layer.values.index_copy_(0, dst, layer.values.index_select(0, src))
                for tensor in (self.ids, self.positions, self.mask, self.last_logits):
                    tensor.index_copy_(0, dst, tensor.index_select(0, src))
        order = list(range(self.num_requests))
        for hole, mover in zip(holes, movers):
            order[hole] = mover
        order = order[:count]
        self.request_ids = [self.request_ids[s] for s in order]
        self.lengths = [self.lengths[s] for s in order]
        self.steps_taken = [self.steps_taken[s] for s in order]

    def decode_step(self, bucket: int | None = None) -> None:
        """One token for slots ``[0, bucket)`` (all by default), on the current stream;
        capturable (no host read, fixed addresses)."""
        torch = self._torch
        cache, ids, positions, mask, logits_out = self._views[self.max_batch_size if bucket is None else bucket]
        with torch.inference_mode():
            for layer in self.cache.layers:  # each layer's write column (it advances it itself)
                layer.cumulative_length.copy_(self.write_position[0])
            mask.index_fill_(-1, self.write_position, True)  # the new token sees itself
            out = self.model(input_ids=ids, past_key_values=cache, attention_mask=mask, position_ids=positions,
                             use_cache=True, logits_to_keep=1)
            logits = out.logits[:, -1, :]
            logits_out.copy_(logits)
            ids.copy_(logits.argmax(dim=-1, keepdim=True))
            positions.add_(1)
            self.write_position.sub_(self.max_context - 1).remainder_(self.max_steps).add_(self.max_context)

    def after_step(self) -> None:
        """Host bookkeeping of a step that ran (eager or a graph's replay)."""
        self.lengths = [length + 1 for length in self.lengths]
        self.steps_taken = [taken + 1 for taken in self.steps_taken]

    def check_room(self) -> None:
        if self.steps_taken and max(self.steps_taken) >= self.max_steps:
            raise RuntimeError(f"a request outstays the ring of {self.max_steps} decode steps (max_steps)")


class StaticDecodeBatch(SlotDecodeBatch):
    """``batch_size`` requests of ``context_length`` tokens filling every slot, with room for
    ``max_steps`` more tokens (level-graphs): :meth:`decode_step` computes the whole batch.
    The context is random KV or, in tests, the prefill of equal-length ``prompts``.

    Host bookkeeping stays outside the captured step: :meth:`run` counts the tokens and
    calls :meth:`reset` (write column back to the context) when the ring is used up."""

    def __init__(self, model, device, batch_size: int, context_length: int, max_steps: int, *, prompts=None,
                 seed: int = 0):
        super().__init__(model, device, batch_size, context_length, max_steps, seed=seed)
        if prompts is not None and [len(p) for p in prompts] != [context_length] * batch_size:
            raise ValueError(f"prompts: {batch_size} lists of {context_length} token ids expected")
        self.batch_size, self.context_length = batch_size, context_length
        self.join(range(batch_size), [context_length] * batch_size, prompts=prompts)
        with self._torch.inference_mode():
            self.first_ids = self.ids.clone()
        self.length = context_length  # tokens in the cache (host count; the device's is write_position)

    @property
    def steps_left(self) -> int:
        return self.max_length - self.length

    def reset(self) -> None:
        """Back to the state after the context (the tokens decoded since are dropped, the
        next tokens are the first ones again), on the current stream: the steps after a
        reset compute what the steps after the previous one did."""
        with self._torch.inference_mode():
            self.ids.copy_(self.first_ids)
            self.write_position.fill_(self.context_length)
            self.positions.fill_(self.context_length)
            self.mask[..., self.context_length:] = False
        self.length = self.context_length

    def run(self, graphs, level_index: int, stream, graph: bool = True) -> bool:
        """One step on level ``level_index``: its graph for this batch size (eager where
        there is none, or with ``graph=False``) on ``stream``, the level's decode stream.
        Returns whether a graph ran."""
        if self.steps_left <= 0:
            with on_stream(stream):
                self.reset()
        if graph:
            replayed = graphs.replay(level_index, self.batch_size, eager=self.decode_step)
        else:
            with on_stream(stream):
                self.decode_step()
            replayed = False
        self.length += 1
        return replayed
