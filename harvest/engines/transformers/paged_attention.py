"""Paged decode attention inside a transformers model, with what torch and transformers
provide: torch's FlexAttention over a pool of KV pages and a transformers attention
function and cache that route a decode step to it.

- The KV of every layer is one pool ``(1, kv_heads, pool_tokens, head_dim)``: pages of
  ``page_size`` tokens side by side (the layout of torch's
  ``torch.nn.attention.experimental._paged_attention``), shared by every row of a batch.
- A step's attention is ``flex_attention`` with a ``BlockMask`` whose KV blocks are pages:
  row b's ``kv_indices`` is its page table (physical pages, logical order) and
  ``kv_num_blocks`` the pages holding its tokens, so the fused kernel visits only those
  pages (torch's flex-decoding kernel splits each row's own blocks over its programs: the
  work grows with Σcontext). No block is marked full (torch's decode kernel then sizes its
  splits by the whole pool); the mask_mod runs on every visited page and also keeps the
  eager reference implementation (which evaluates it over the whole pool) exact: a key
  counts for row b when its page belongs to b and its logical position is below b's length.
- :func:`use_paged_attention` registers an attention function (``AttentionInterface``) and
  its mask function (``AttentionMaskInterface``) under ``harvest_paged+<base>`` and sets the
  model's attention implementation to it: a call that carries :data:`FLEX_KWARG` (the
  paged step) runs FlexAttention over the pool; any other call (a prefill, the trainer
  sharing the model's weights) runs the model's original implementation unchanged.
- :func:`paged_cache` is the transformers ``Cache`` of a paged step: a layer's ``update``
  writes the new token's key and value at the row's address in the pool (one
  ``index_copy_``) and hands the whole pool to the attention.

Everything a step reads keeps its address and nothing is read back to the host, so the
step is CUDA-graph capturable. ``flex_attention`` itself runs compiled (``torch.compile``,
one compilation per batch bucket: the fused Triton kernel on CUDA, the C++ template on
CPU) or eagerly (torch's reference implementation: exact, but it scores the whole pool;
the CPU default). torch and transformers are imported where used.
"""

from __future__ import annotations

import functools
import sys

FLEX_KWARG = "harvest_flex"  # the model call's keyword carrying the flex_attention to use
NAME_PREFIX = "harvest_paged+"
Q_BLOCK_SIZE = 128  # the block mask's query tile: a decode step's one query fits one tile
RECOMPILE_LIMIT = 64  # compiled flex: one compilation per (batch bucket, pool): more than dynamo's default 8


def use_paged_attention(model) -> str:
    """Route ``model``'s attention through the paged dispatcher (idempotent); returns the
    implementation's name. Calls without :data:`FLEX_KWARG` keep the original behaviour."""
    base = model.config._attn_implementation or "eager"
    if base.startswith(NAME_PREFIX):
        return base
    name = _register(base)
    model.set_attn_implementation(name)
    if model.config._attn_implementation != name:
        raise RuntimeError(f"{type(model).__name__} did not take the attention implementation {name!r} "
                           f"(it keeps {model.config._attn_implementation!r}): paged KV needs a model whose "
                           "attention goes through transformers' AttentionInterface")
    return name


@functools.lru_cache(maxsize=None)
def _register(base: str) -> str:
    from transformers import AttentionInterface
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, AttentionMaskInterface
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    name = NAME_PREFIX + base
    original = None if base == "eager" else ALL_ATTENTION_FUNCTIONS[base]

    def attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
        flex = kwargs.pop(FLEX_KWARG, None)
        if flex is None:
            forward = original or sys.modules[type(module).__module__].eager_attention_forward
            return forward(module, query, key, value, attention_mask, scaling=scaling, dropout=dropout, **kwargs)
        out = flex(query, key, value, block_mask=attention_mask, scale=scaling,
                   enable_gqa=query.shape[1] != key.shape[1])
        return out.transpose(1, 2).contiguous(), None

    AttentionInterface.register(name, attention)
    AttentionMaskInterface.register(name, ALL_MASK_ATTENTION_FUNCTIONS[base])
    return name


def flex_function(compiled: bool):
    """``flex_attention``: eager, or compiled once per process (one compilation per input
    shape; dynamo's recompile limit raised to :data:`RECOMPILE_LIMIT` for the buckets)."""
    from torch.nn.attention.flex_attention import flex_attention

    if compiled:
        return _compiled_flex()
    _quiet_eager_warning()
    return flex_attention


@functools.lru_cache(maxsize=1)
def _quiet_eager_warning() -> None:
    """torch warns that eager flex_attention is unfused: here it is chosen (CPU, tests)."""
    import warnings

    warnings.filterwarnings("ignore", message="flex_attention called without torch.compile", category=UserWarning)


@functools.lru_cache(maxsize=1)
def _compiled_flex():
    import torch
    import torch._dynamo.config
    from torch.nn.attention.flex_attention import flex_attention

    torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, RECOMPILE_LIMIT)
    return torch.compile(flex_attention, dynamic=False, fullgraph=True)


def page_mask_mod(page_owner, page_logical, kv_len, page_size: int):
    """Key ``kv_idx`` (a pool position) counts for row ``b`` when its page belongs to b and
    its logical position is below b's length (the new token included)."""

    def mask_mod(b, h, q_idx, kv_idx):
        page = kv_idx // page_size
        return (page_owner[page] == b) & (page_logical[page] * page_size + kv_idx % page_size < kv_len[b])

    return mask_mod


def paged_block_mask(kv_num_blocks, kv_indices, mask_mod, page_size: int, pool_tokens: int):
    """The decode step's BlockMask over the pool: ``kv_num_blocks`` (rows, 1, 1) pages per
    row, ``kv_indices`` (rows, 1, 1, pool pages) each row's pages first. Built once; the
    step updates both tensors in place."""
    from torch.nn.attention.flex_attention import BlockMask

    return BlockMask.from_kv_blocks(kv_num_blocks, kv_indices, BLOCK_SIZE=(Q_BLOCK_SIZE, page_size), mask_mod=mask_mod,
                                    seq_lengths=(1, pool_tokens), compute_q_blocks=False)


def paged_cache(pools, write_addr):
    """A transformers Cache over ``pools`` (per layer: keys, values of shape (1, kv_heads,
    pool_tokens, head_dim)) writing each row's new token at ``write_addr`` (rows,)."""
    return _cache_class()(pools, write_addr)


@functools.lru_cache(maxsize=1)
def _cache_class():
    from transformers.cache_utils import Cache, CacheLayerMixin

    class PagedLayer(CacheLayerMixin):
        is_compileable = True

        def __init__(self, keys, values, write_addr):
            super().__init__()
            self.keys, self.values, self.write_addr = keys, values, write_addr
            self.dtype, self.device = keys.dtype, keys.device
            self.is_initialized = True

        def lazy_initialization(self, key_states, value_states) -> None:
            pass

        def update(self, key_states, value_states, *args, **kwargs):
            if key_states.shape[-2] != 1:
                raise ValueError(f"a paged step decodes one token per row, not {key_states.shape[-2]}")
            # (rows, heads, 1, dim) -> (heads, rows, dim), into the pool's columns write_addr
            self.keys[0].index_copy_(1, self.write_addr, key_states[:, :, 0].transpose(0, 1))
            self.values[0].index_copy_(1, self.write_addr, value_states[:, :, 0].transpose(0, 1))
            return self.keys, self.values

        def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
            return self.keys.shape[-2], 0

        def get_seq_length(self) -> int:
            raise NotImplementedError("a paged cache has a length per row: pass position_ids")

        def get_max_length(self) -> int:
            return self.keys.shape[-2]

    class PagedKvCache(Cache):
        def __init__(self, pools, write_addr):
            super().__init__(layers=[PagedLayer(keys, values, write_addr) for keys, values in pools])

    return PagedKvCache
