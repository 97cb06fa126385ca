"""Harli's reserve: free KV memory kept mapped so decode never waits for a reclaim.

Harli (arXiv:2511.11729) §4.4: reclaiming memory from the trainer takes as long as swapping one trainer
layer's frozen weights out (T_swap). Decode must be able to run that long on memory it
already has, so the allocator keeps

    reserved_bytes = (T_swap / QoS) * max_bs * kv_bytes_per_token

mapped and free at all times: T_swap / QoS decode steps (each at most the TPOT target
long) of max_bs new tokens each. Harli writes QoS = 50 ms; here it is a parameter.
The formula assumes steps run at the QoS target; a server whose steps are much shorter
than its target should pass its step time instead (more steps fit in T_swap).
"""

from __future__ import annotations

import math


def reserve_bytes(t_swap: float, qos: float, max_bs: int, kv_bytes_per_token: int) -> int:
    """Bytes of free, mapped KV cache to keep (rounded up to a whole byte).

    t_swap: seconds to swap out one trainer layer (>= 0).
    qos: the per-token latency target in seconds (> 0), the length of one decode step.
    max_bs: the largest decode batch the server admits (> 0).
    kv_bytes_per_token: KV bytes of one token over all layers, K and V
        (KvGeometry.kv_bytes_per_token).
    """
    for name, value in (("t_swap", t_swap), ("qos", qos)):
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
            raise ValueError(f"{name}={value!r} must be a finite number of seconds")
    if t_swap < 0:
        raise ValueError(f"t_swap={t_swap!r} must not be negative (seconds to swap out one layer)")
    if qos <= 0:
        raise ValueError(f"qos={qos!r} must be positive (the TPOT target in seconds, e.g. 0.05)")
    for name, value in (("max_bs", max_bs), ("kv_bytes_per_token", kv_bytes_per_token)):
        if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
            raise ValueError(f"{name}={value!r} must be a positive int")
    return math.ceil(t_swap / qos * max_bs * kv_bytes_per_token)


def reserve_tokens(t_swap: float, qos: float, max_bs: int, kv_bytes_per_token: int) -> int:
    """The same reserve counted in token slots."""
    return math.ceil(reserve_bytes(t_swap, qos, max_bs, kv_bytes_per_token) / kv_bytes_per_token)
