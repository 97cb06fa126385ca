"""Torch tensors over allocator memory, with no copy.

Host backend: a CPU tensor over the mapped address (``torch.frombuffer`` on a ctypes
array placed at that address). CUDA backend: a device tensor through
``__cuda_array_interface__``. Both start from a uint8 view and reinterpret it, so every
torch dtype works (bfloat16 has no array-interface type string).

Lifetime: the buffer object the tensor keeps alive holds a reference to its owner (the
allocator), so the allocator cannot be garbage-collected under a live view, and the
allocator counts live views to refuse an explicit close() while any exists.
"""

from __future__ import annotations

import ctypes
import math
from typing import Any, Sequence

import torch


class _CudaBuffer:
    """The minimal object torch.as_tensor accepts for device memory it does not own."""

    def __init__(self, address: int, num_bytes: int, owner: Any):
        self.owner = owner
        self.__cuda_array_interface__ = {
            "shape": (num_bytes,),
            "typestr": "|u1",
            "data": (address, False),
            "version": 3,
            "strides": None,
            "stream": None,  # allocator memory carries no pending work of its own
        }


def _resolve_shape(num_bytes: int, dtype: torch.dtype, shape: Sequence[int] | None) -> tuple[int, ...]:
    itemsize = torch.empty((), dtype=dtype).element_size()
    if shape is None:
        if num_bytes % itemsize:
            raise ValueError(f"{num_bytes} bytes is not a whole number of {dtype} elements")
        return (num_bytes // itemsize,)
    shape = tuple(int(d) for d in shape)
    if any(d < 0 for d in shape):
        raise ValueError(f"shape {shape} has a negative dimension")
    if math.prod(shape) * itemsize > num_bytes:
        raise ValueError(
            f"shape {shape} of {dtype} needs {math.prod(shape) * itemsize} bytes but the memory has {num_bytes}"
        )
    return shape


def make_buffer(address: int, num_bytes: int, backend: str, device: int, owner: Any) -> Any:
    """The object a tensor view keeps alive (and the allocator tracks with a weakref)."""
    if backend == "cuda":
        return _CudaBuffer(address, num_bytes, owner)
    buffer = (ctypes.c_ubyte * num_bytes).from_address(address)
    buffer.owner = owner  # ctypes arrays take attributes; keeps the allocator alive
    return buffer


def tensor_from_buffer(
    buffer: Any, num_bytes: int, dtype: torch.dtype, shape: Sequence[int] | None, backend: str, device: int
) -> torch.Tensor:
    shape = _resolve_shape(num_bytes, dtype, shape)
    if backend == "cuda":
        raw = torch.as_tensor(buffer, device=f"cuda:{device}")
    else:
        raw = torch.frombuffer(buffer, dtype=torch.uint8, count=num_bytes)
    itemsize = torch.empty((), dtype=dtype).element_size()
    used = math.prod(shape) * itemsize
    return raw[:used].view(dtype).view(shape)
