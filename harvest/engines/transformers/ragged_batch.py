"""Requests of different lengths decoding together, eagerly, through one Hugging Face
model: the batch of the GPU experiment's serving modes with ``--graphs off``.

One forward per step for the whole batch (greedy token). Requests share a left-padded KV
cache (transformers' DynamicCache, attention mask over the padding), so a step costs what
a uniform batch of the longest request costs: the load is the padded sum of contexts,
n x (longest + 1), the quantity a transformers-engine profile measures. Shapes change as
requests join and leave, so the step cannot be a CUDA graph (the batches of
:mod:`.static_batch` can). torch and transformers are imported by the class, not by this
module.
"""

from __future__ import annotations

from harvest.engines.transformers.model import cache_layers


class RaggedDecodeBatch:
    """Requests of different lengths decoding together through one HF model: rows are
    right-aligned in a left-padded KV cache; each step appends one token per row."""

    def __init__(self, model, device, seed: int = 0):
        import torch

        self._torch = torch
        config = model.config
        self.model, self.config, self.device = model, config, torch.device(device)
        self.kv_heads = config.num_key_value_heads
        self.head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        self.generator = torch.Generator(device=self.device).manual_seed(seed)
        self.request_ids: list[int] = []
        self.lengths: list[int] = []  # tokens each row holds in the KV cache
        self.last_logits = None
        self._cache = self._mask = self._next_ids = None

    @property
    def num_requests(self) -> int:
        return len(self.request_ids)

    @property
    def padded_length(self) -> int:
        return self._mask.shape[1] if self._mask is not None else 0

    @property
    def computed_rows(self) -> int:
        return self.num_requests

    def padded_sum_context(self) -> int:
        return self.num_requests * (self.padded_length + 1)  # the token being decoded included

    def sum_context(self) -> int:
        return sum(self.lengths) + self.num_requests

    def join(self, request_ids, context_lengths, prompts=None) -> None:
        """Add requests holding ``context_lengths`` tokens of KV: random values, or (tests)
        the prefill of ``prompts`` (lists of token ids)."""
        torch, F = self._torch, self._torch.nn.functional
        new_length = max(self.padded_length, *context_lengths)
        rows, first_ids = [], []
        with torch.inference_mode():
            if prompts is None:
                shape = (len(request_ids), self.kv_heads, new_length, self.head_dim)
                rows = [(torch.randn(shape, generator=self.generator, device=self.device, dtype=self.model.dtype),
                         torch.randn(shape, generator=self.generator, device=self.device, dtype=self.model.dtype))
                        for _ in range(self.config.num_hidden_layers)]
                first_ids = torch.randint(0, self.config.vocab_size, (len(request_ids), 1), generator=self.generator,
                                          device=self.device)
            else:
                prefills = [self.model(input_ids=torch.tensor([p], device=self.device), use_cache=True) for p in prompts]
                per_request = [cache_layers(out.past_key_values) for out in prefills]
                for layer in range(self.config.num_hidden_layers):
                    rows.append(tuple(torch.cat([F.pad(kv[layer][i], (0, 0, new_length - kv[layer][i].shape[-2], 0))
                                                 for kv in per_request]) for i in (0, 1)))
                first_ids = torch.cat([out.logits[:, -1].argmax(-1, keepdim=True) for out in prefills])
            mask = torch.zeros((len(request_ids), new_length), dtype=torch.long, device=self.device)
            for row, length in enumerate(context_lengths):
                mask[row, new_length - length:] = 1
            if self.request_ids:
                pad = new_length - self.padded_length
                rows = [(torch.cat([F.pad(k, (0, 0, pad, 0)), new_k]), torch.cat([F.pad(v, (0, 0, pad, 0)), new_v]))
                        for (k, v), (new_k, new_v) in zip(cache_layers(self._cache), rows)]
                mask = torch.cat([F.pad(self._mask, (pad, 0)), mask])
                first_ids = torch.cat([self._next_ids, first_ids])
            self._set(rows, mask, first_ids)
        self.request_ids += list(request_ids)
        self.lengths += list(context_lengths)

    def leave(self, request_ids) -> None:
        torch = self._torch
        gone = set(request_ids)
        keep = [i for i, rid in enumerate(self.request_ids) if rid not in gone]
        if not keep:
            self.request_ids, self.lengths, self._cache, self._mask, self._next_ids = [], [], None, None, None
            return
        lengths = [self.lengths[i] for i in keep]
        trim = self.padded_length - max(lengths)  # columns that are padding in every kept row
        index = torch.tensor(keep, device=self.device)
        with torch.inference_mode():
            rows = [(k.index_select(0, index)[:, :, trim:], v.index_select(0, index)[:, :, trim:])
                    for k, v in cache_layers(self._cache)]
            self._set(rows, self._mask.index_select(0, index)[:, trim:], self._next_ids.index_select(0, index))
        self.request_ids = [self.request_ids[i] for i in keep]
        self.lengths = lengths

    def step(self) -> None:
        """One token for every request (on the caller's current stream)."""
        torch = self._torch
        with torch.inference_mode():
            positions = torch.tensor(self.lengths, device=self.device).unsqueeze(1)
            mask = torch.cat([self._mask, self._mask.new_ones((self.num_requests, 1))], dim=1)
            out = self.model(input_ids=self._next_ids, past_key_values=self._cache, attention_mask=mask,
                             position_ids=positions, use_cache=True, logits_to_keep=1)
            self.last_logits = out.logits[:, -1, :]
            self._next_ids = self.last_logits.argmax(dim=-1, keepdim=True)
        self._cache, self._mask = out.past_key_values, mask
        self.lengths = [length + 1 for length in self.lengths]

    def _set(self, rows, mask, next_ids) -> None:
        from transformers import DynamicCache

        self._cache = DynamicCache(ddp_cache_data=rows, config=self.config)
        self._mask, self._next_ids = mask, next_ids
