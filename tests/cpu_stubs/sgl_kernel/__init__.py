"""CPU stand-in for sgl-kernel (test/CPU-demo only; see tests/cpu_stubs/README.md)."""

from __future__ import annotations

import torch

__version__ = "0.0.0+harvest.cpu.stub"


def assign_req_to_token_pool_cpu(req_pool_indices, req_to_token, start_offset, end_offset, out_cache_loc, batch_size):
    """Write each request's new KV slots (``out_cache_loc``) into its ``req_to_token`` row.

    Same contract as sgl-kernel's CPU op: for request i, slots
    ``out_cache_loc[sum(len[:i]) : sum(len[:i+1])]`` go to
    ``req_to_token[req_pool_indices[i], start_offset[i]:end_offset[i]]``.
    """
    lengths = (end_offset[:batch_size] - start_offset[:batch_size]).tolist()
    starts = start_offset[:batch_size].tolist()
    rows = req_pool_indices[:batch_size].tolist()
    cursor = 0
    for row, start, length in zip(rows, starts, lengths):
        req_to_token[row, start : start + length] = out_cache_loc[cursor : cursor + length].to(req_to_token.dtype)
        cursor += length


def _unavailable(name: str):
    def fail(*args, **kwargs):
        raise NotImplementedError(
            f"sgl_kernel.{name} is not available in harvest's CPU stand-in "
            "(tests/cpu_stubs/sgl_kernel); this code path needs the real CUDA sgl-kernel"
        )

    fail.__name__ = name
    return fail


def __getattr__(name: str):
    if name.startswith("__"):
        raise AttributeError(name)
    return _unavailable(name)
