"""Whether a profiling grid's largest point can be held, checked before any model loads:
against the decode instance's limits when given (``--max-batch-size``,
``--kv-capacity-tokens``), the model's positions, and the device's memory (the KV cache of
the largest point and the model's weights, both worked out from ``config.json``, against
the memory free on the device). A problem is one line naming the flags the grid came
from; the estimates are lower bounds, so a grid is never refused for memory it would not
need.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Sequence

DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}
SGLANG_POOL_PAD_TOKENS = 64  # the SGLang engine's pool holds every request's context + 64 (sglang_engine)
GIB = 2**30


def _size(num_bytes: float) -> str:
    return f"{num_bytes / GIB:.1f} GiB" if num_bytes >= GIB / 10 else f"{num_bytes / 2**20:.1f} MiB"


def read_config(model_path: str | Path) -> dict:
    """``config.json`` of ``model_path`` as a dict ({} when unreadable: the model's loading
    says why, and these checks have nothing to go on)."""
    try:
        data = json.loads((Path(model_path) / "config.json").read_text())
    except (OSError, ValueError):
        return {}
    return data if isinstance(data, dict) else {}


def _int(config: dict, key: str) -> int | None:
    value = config.get(key)
    return value if isinstance(value, int) and not isinstance(value, bool) and value > 0 else None


def _head_dim(config: dict) -> int | None:
    hidden, heads = _int(config, "hidden_size"), _int(config, "num_attention_heads")
    return _int(config, "head_dim") or (hidden // heads if hidden and heads else None)


def kv_bytes_per_token(config: dict, dtype: str) -> tuple[int, str] | None:
    """KV cache bytes of one token over all layers (K and V), and how it was worked out;
    None when ``config`` lacks the fields."""
    layers, size = _int(config, "num_hidden_layers"), DTYPE_BYTES.get(dtype)
    if layers is None or size is None:
        return None
    latent = _int(config, "kv_lora_rank")
    if latent is not None:  # multi-head latent attention: one compressed vector (+ its rope part) per layer
        rope = _int(config, "qk_rope_head_dim") or 0
        return layers * (latent + rope) * size, f"{layers} layers x ({latent} + {rope}) latent dims x {dtype}"
    heads, head_dim = _int(config, "num_attention_heads"), _head_dim(config)
    kv_heads = _int(config, "num_key_value_heads") or heads
    if kv_heads is None or head_dim is None:
        return None
    return 2 * layers * kv_heads * head_dim * size, f"K and V x {layers} layers x {kv_heads} KV heads x {head_dim} dims x {dtype}"


def weight_bytes(config: dict, dtype: str) -> int | None:
    """About the bytes of a decoder-only model's weights (embeddings, attention, gated MLP
    per layer, experts counted), None when ``config`` lacks the fields."""
    hidden, layers, inter = _int(config, "hidden_size"), _int(config, "num_hidden_layers"), _int(config, "intermediate_size")
    heads, vocab, head_dim = _int(config, "num_attention_heads"), _int(config, "vocab_size"), _head_dim(config)
    size = DTYPE_BYTES.get(dtype)
    if None in (hidden, layers, inter, heads, vocab, head_dim, size):
        return None
    kv_heads = _int(config, "num_key_value_heads") or heads
    attention = 2 * hidden * heads * head_dim + 2 * hidden * kv_heads * head_dim
    experts = _int(config, "num_local_experts") or _int(config, "num_experts") or 1
    mlp = 3 * hidden * inter * experts
    embeddings = vocab * hidden * (1 if config.get("tie_word_embeddings") else 2)
    return (embeddings + layers * (attention + mlp)) * size


def device_free_bytes(device: str) -> int | None:
    """Memory free now on ``device`` (a CPU: the kernel's MemAvailable), None if unknown."""
    if device.startswith("cuda"):
        import torch

        try:
            return int(torch.cuda.mem_get_info(torch.device(device))[0])
        except (RuntimeError, AssertionError):
            return None
    try:
        with open("/proc/meminfo") as meminfo:
            for line in meminfo:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        return None
    return None


def bounds_problem(batch_sizes: Sequence[int], context_lengths: Sequence[int], max_batch_size: int | None,
                   kv_capacity_tokens: int | None, what: str) -> str | None:
    """The grid against the decode instance's limits, when given: no batch larger than
    ``--max-batch-size``, no point holding more context than ``--kv-capacity-tokens``."""
    b, c = max(batch_sizes), max(context_lengths)
    if max_batch_size is not None and b > max_batch_size:
        return f"{what}: batch size {b} is over --max-batch-size {max_batch_size}, more requests than the decode instance batches"
    if kv_capacity_tokens is not None and b * c > kv_capacity_tokens:
        return (f"{what}: its largest point holds {b} x {c} = {b * c} context tokens, more than --kv-capacity-tokens "
                f"{kv_capacity_tokens} (the decode instance's KV cache)")
    return None


def positions_problem(config: dict, context_lengths: Sequence[int], steps_per_point: int, what: str) -> str | None:
    """The largest context and the steps a point decodes past it against the model's positions."""
    limit = _int(config, "max_position_embeddings")
    longest = max(context_lengths) + steps_per_point
    if limit is not None and longest > limit:
        return (f"{what}: {max(context_lengths)} tokens per request + the {steps_per_point} steps a point decodes exceed the "
                f"model's max_position_embeddings {limit} (config.json)")
    return None


def memory_problem(config: dict, dtype: str, engine: str, tp_size: int, batch_sizes: Sequence[int],
                   context_lengths: Sequence[int], steps_per_point: int, device: str, free_bytes: int | None,
                   what: str) -> str | None:
    """The largest point's KV cache (SGLang's engine: its pool, sized for it) and the
    weights, over ``tp_size`` ranks' devices when those are GPUs, against ``free_bytes``."""
    per_token = kv_bytes_per_token(config, dtype)
    if per_token is None or free_bytes is None:
        return None
    b, c = max(batch_sizes), max(context_lengths)
    tokens = b * (c + steps_per_point + (SGLANG_POOL_PAD_TOKENS if engine == "sglang" else 0))
    weights = weight_bytes(config, dtype) or 0
    share = tp_size if device.startswith("cuda") else 1  # GPUs: each rank its shard; a CPU's ranks share its memory
    kv = tokens * per_token[0] // share
    need = kv + weights // share
    if need <= free_bytes:
        return None
    ranks = f" per rank of {tp_size}" if share > 1 else ""
    return (f"{what}: its largest point, {b} requests x {c} tokens (+{steps_per_point} decode steps), needs "
            f"{_size(kv)} of KV cache{ranks} ({per_token[0]} B/token: {per_token[1]}, from config.json)"
            + (f" beside about {_size(weights // share)} of weights" if weights else "")
            + f", and {device} has {_size(free_bytes)} free; lower the largest batch size or context length")
