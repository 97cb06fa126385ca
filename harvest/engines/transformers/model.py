"""The Hugging Face causal LM every transformers decode path loads, and the helpers its
batches share: a cache's (keys, values) per layer, work placed on a stream.

torch and transformers are imported by the functions, not by this module.
"""

from __future__ import annotations

import contextlib

DTYPES = frozenset({"float32", "bfloat16", "float16"})


def load_causal_lm(model_path: str, device: str, dtype: str, random_weights: bool):
    """A HF causal LM on ``device`` in eval mode; from config alone with ``random_weights``
    (a step's latency does not depend on weight values). ``dtype``: one of :data:`DTYPES`
    (ValueError otherwise)."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    if dtype not in DTYPES:
        raise ValueError(f"--dtype={dtype!r}: one of {', '.join(sorted(DTYPES))}")
    torch_dtype = getattr(torch, dtype)
    if random_weights:
        config = AutoConfig.from_pretrained(model_path)
        with torch.device(device):
            model = AutoModelForCausalLM.from_config(config, dtype=torch_dtype)
    else:
        model = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch_dtype).to(device)
    return model.eval()


def cache_layers(cache) -> list[tuple]:
    """(keys, values) of every layer of a transformers cache."""
    return [(keys, values) for keys, values, *_ in cache]


def on_stream(stream):
    """Work on ``stream`` (a torch.cuda.Stream); None: the current stream, unchanged."""
    if stream is None:
        return contextlib.nullcontext()
    import torch

    return torch.cuda.stream(stream)
