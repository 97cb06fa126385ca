"""Decode steps through a plain transformers model with a KV cache.

For environments without SGLang (and for a GPU profile of a model built from its config
with random weights: latency does not depend on weight values). A step is one token per
request through ``model(...)`` with the cache of the previous steps and greedy choice of
the next token. Its latencies describe transformers' kernels, not SGLang's: a profile
made with this engine says so in ``provenance.engine`` and predicts an SGLang server
only approximately.
"""

from __future__ import annotations

from harvest.predict.profiler.engines import BaseDecodeEngine, EngineConfig, EngineError, synthetic_token_ids

_DTYPES = {"float32", "bfloat16", "float16"}


def load_causal_lm(model_path: str, device: str, dtype: str, random_weights: bool):
    """A HF causal LM on ``device`` in eval mode; from config alone with ``random_weights``."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    if dtype not in _DTYPES:
        raise EngineError(f"--dtype={dtype!r}: one of {', '.join(sorted(_DTYPES))}")
    torch_dtype = getattr(torch, dtype)
    if random_weights:
        config = AutoConfig.from_pretrained(model_path)
        with torch.device(device):
            model = AutoModelForCausalLM.from_config(config, dtype=torch_dtype)
    else:
        model = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch_dtype).to(device)
    return model.eval()


class TransformersDecodeEngine(BaseDecodeEngine):
    name = "transformers"

    def __init__(self, config: EngineConfig):
        import torch

        if config.tp_size != 1:  # the command refuses --tp > 1 first, naming the flag
            raise EngineError(f"the transformers engine runs one process: tp_size={config.tp_size} needs --engine sglang")
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

    def prepare(self, batch_size: int, context_length: int) -> None:
        torch = self._torch
        self.release()
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

    def begin_step(self) -> float:
        if self._cache is None:
            raise EngineError("TransformersDecodeEngine.begin_step before prepare")
        # Σctx counts the token being decoded, as SGLang's seq_lens_sum does.
        return float(self._batch_size * (self._length + 1))

    def step(self) -> None:
        torch = self._torch
        with torch.inference_mode():
            positions = torch.full((self._batch_size, 1), self._length, device=self.config.device, dtype=torch.long)
            out = self.model(
                input_ids=self._next_ids, past_key_values=self._cache, position_ids=positions, use_cache=True, logits_to_keep=1
            )
            self._next_ids = out.logits[:, -1, :].argmax(dim=-1, keepdim=True)
        self._cache = out.past_key_values
        self._length += 1

    def release(self) -> None:
        self._cache = None
        self._next_ids = None
