"""KvGeometry: the allocator's fixed shape, and the maps between its index spaces.

Three index spaces meet here (hvmm.h explains the vocabulary):
  token slot  -- SGLang's KV index; chunk = slot // tokens_per_chunk.
  chunk       -- 2 * num_layers pages; lent and reclaimed as a unit.
  KV range    -- range r = 2 * layer + (0 for K, 1 for V), one per layer buffer.
Pure arithmetic on stored integers: no torch, no library call.
"""

from __future__ import annotations

import dataclasses
import operator

KV_KINDS = ("k", "v")


@dataclasses.dataclass(frozen=True)
class KvGeometry:
    backend: str
    device: int
    page_bytes: int
    num_layers: int
    bytes_per_token: int  # one layer, K or V
    tokens_per_chunk: int
    pages_per_chunk: int  # 2 * num_layers
    num_chunks: int
    token_capacity: int
    chunk_bytes: int
    kv_range_bytes: int
    kv_base: int
    arena_base: int
    arena_bytes: int
    small_base: int
    small_bytes: int
    small_pages: int
    total_pages: int

    @property
    def kv_bytes_per_token(self) -> int:
        """KV bytes of one token over every layer, K and V (Harli's Mem_kv)."""
        return self.bytes_per_token * self.pages_per_chunk

    def check_chunk(self, chunk: int) -> int:
        if isinstance(chunk, bool):
            raise TypeError("chunk id must be an int, got bool")
        chunk = operator.index(chunk)  # numpy integers too; TypeError for anything else
        if not 0 <= chunk < self.num_chunks:
            raise ValueError(f"chunk {chunk} is out of range [0, {self.num_chunks})")
        return chunk

    def chunk_slots(self, chunk: int) -> range:
        """The token slots of one chunk."""
        self.check_chunk(chunk)
        first = chunk * self.tokens_per_chunk
        return range(first, first + self.tokens_per_chunk)

    def slot_to_chunk(self, slot: int) -> int:
        if not 0 <= slot < self.token_capacity:
            raise ValueError(f"slot {slot} is out of range [0, {self.token_capacity})")
        return slot // self.tokens_per_chunk

    def kv_range_index(self, layer: int, kind: str) -> int:
        if not 0 <= layer < self.num_layers:
            raise ValueError(f"layer {layer} is out of range [0, {self.num_layers})")
        if kind not in KV_KINDS:
            raise ValueError(f"kind {kind!r} must be 'k' or 'v'")
        return 2 * layer + KV_KINDS.index(kind)

    def kv_range_address(self, layer: int, kind: str) -> int:
        """Virtual address of the first byte of a layer's K or V buffer."""
        return self.kv_base + self.kv_range_index(layer, kind) * self.kv_range_bytes

    def kv_slice_address(self, chunk: int, layer: int, kind: str) -> int:
        """Address of a chunk's one-page slice of a layer's K or V buffer."""
        return self.kv_range_address(layer, kind) + self.check_chunk(chunk) * self.page_bytes

    def arena_page_address(self, chunk: int, range_index: int) -> int:
        """Where a lent chunk's page of KV range `range_index` appears in the general arena."""
        if not 0 <= range_index < self.pages_per_chunk:
            raise ValueError(f"range index {range_index} is out of range [0, {self.pages_per_chunk})")
        return self.arena_base + self.check_chunk(chunk) * self.chunk_bytes + range_index * self.page_bytes

    def arena_address_to_page(self, address: int) -> tuple[int, int]:
        """(chunk, KV range index) of the page that backs a general-arena address."""
        offset = address - self.arena_base
        if not 0 <= offset < self.arena_bytes:
            raise ValueError(f"address {address:#x} is not in the general arena")
        page = offset // self.page_bytes
        return page // self.pages_per_chunk, page % self.pages_per_chunk
