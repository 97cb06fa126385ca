"""SGLang's KV cache on harvest's unified allocator (hook on MHATokenToKVPool).

``MHATokenToKVPool._create_buffers_normal`` allocates one zeroed tensor per layer holding K
and V as two halves (``fused[0]``, ``fused[1]``) so that paged kernels can reach V from
K's base. With harvest enabled, the same shapes are views over the KV arena of a
:class:`~harvest.memory.UnifiedAllocator`: its ranges are laid out ``L0.K, L0.V, L1.K,
...`` with equal sizes, so a view over a layer's two ranges *is* the fused layout, and
whole chunks of token slots can later be lent to the trainer (their pages mapped a second
time, into its arena).

Supported: the plain NHD layout of an unquantized MHA pool with equal K/V head dims (every
Llama/Qwen2-style model). Anything else refuses at start-up, naming what it found.
"""

from __future__ import annotations

from harvest import config_env
from harvest.logs import get_logger

logger = get_logger(__name__)

ALLOCATOR_ATTR = "_harvest_allocator"

# Host pages: small enough that the tiny CPU models get tens of chunks, a multiple of the
# OS page. CUDA uses the driver's minimum granularity (2 MiB on current GPUs).
HOST_PAGE_BYTES = 64 * 1024


class UnsupportedKvLayout(RuntimeError):
    pass


def unsupported_reason(pool) -> str | None:
    if getattr(pool, "is_quantized_kv_cache", False):
        return "quantized KV cache"
    if getattr(pool, "post_capture_active", False):
        return "post-capture KV backing (SGLang's own VMM) is active"
    layout = getattr(pool, "kv_cache_layout", "nhd")
    if layout != "nhd" or getattr(pool, "use_hnd", False):
        return f"KV layout {layout!r} (harvest supports 'nhd')"
    if pool.head_dim != pool.v_head_dim:
        return f"K head dim {pool.head_dim} != V head dim {pool.v_head_dim}"
    return None


def create_allocator(pool):
    from harvest.memory import UnifiedAllocator

    on_cuda = str(pool.device).startswith("cuda")
    device_index = 0
    if on_cuda:
        import torch

        device_index = torch.device(pool.device).index or 0
    return UnifiedAllocator(
        num_layers=pool.layer_num,
        kv_heads=pool.head_num,
        head_dim=pool.head_dim,
        dtype_bytes=pool.store_dtype.itemsize,
        max_tokens=pool.size + pool.page_size,
        backend="cuda" if on_cuda else "host",
        page_bytes=0 if on_cuda else HOST_PAGE_BYTES,
        device=device_index,
    )


def _create_buffers_normal(original, pool):
    if not config_env.harvest_enabled():
        return original(pool)
    reason = unsupported_reason(pool)
    if reason is not None:
        raise UnsupportedKvLayout(f"harvest cannot back this KV cache: {reason}; run without --enable-harvest")
    allocator = create_allocator(pool)
    g = allocator.geometry
    rows = pool.size + pool.page_size
    k_buffer, v_buffer = [], []
    for layer in range(pool.layer_num):
        fused = allocator.tensor_view(
            g.kv_range_address(layer, "k"), 2 * g.kv_range_bytes, pool.store_dtype,
            (2, g.token_capacity, pool.head_num, pool.head_dim),
        )
        fused.zero_()  # SGLang's buffers start zeroed; CUDA VMM pages do not
        k_buffer.append(fused[0, :rows])
        v_buffer.append(fused[1, :rows])
    pool.k_buffer, pool.v_buffer = k_buffer, v_buffer
    setattr(pool, ALLOCATOR_ATTR, allocator)
    logger.info(
        "KV cache on harvest's allocator (%s): %d layers, %d chunks of %d tokens, %.1f MiB",
        g.backend, pool.layer_num, g.num_chunks, g.tokens_per_chunk, g.num_chunks * g.chunk_bytes / 2**20,
    )


def allocator_of(pool):
    return getattr(pool, ALLOCATOR_ATTR, None)
