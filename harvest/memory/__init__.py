"""harvest.memory: the unified KV / trainer memory allocator (Harli (arXiv:2511.11729) §4).

Backed by libharvest_vmm (csrc/vmm_allocator): one pool of physical pages behind
SGLang's KV buffers, whole free KV chunks lent to the trainer's general arena and taken
back before decode runs short, plus a small-tensor buddy pool. Imports torch only where
tensors are made.
"""

from harvest.memory.allocator import Allocation, UnifiedAllocator
from harvest.memory.errors import (
    VmmDriverError,
    VmmError,
    VmmExhausted,
    VmmIntegrityError,
    VmmInvalidArgument,
    VmmNoDriver,
    VmmOsError,
)
from harvest.memory.geometry import KvGeometry
from harvest.memory.reserve import reserve_bytes, reserve_tokens
from harvest.memory.stats import AllocatorStats, BackendCounters, ChunkInfo, ChunkState

__all__ = [
    "Allocation",
    "AllocatorStats",
    "BackendCounters",
    "ChunkInfo",
    "ChunkState",
    "KvGeometry",
    "UnifiedAllocator",
    "VmmDriverError",
    "VmmError",
    "VmmExhausted",
    "VmmIntegrityError",
    "VmmInvalidArgument",
    "VmmNoDriver",
    "VmmOsError",
    "reserve_bytes",
    "reserve_tokens",
]
