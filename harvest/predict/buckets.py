"""Batch-size buckets: the batch size a decode step actually runs at.

SGLang replays a decode step through the CUDA graph captured for the smallest capture
size >= the batch size, padding the rest (``cuda_graph_runner.capture_bs``); batches
larger than the largest capture size run eagerly, unpadded. Padding is why Harli sees
batch sizes 1..4 cost the same (§5.1), so both fitting and prediction use the padded
size. An empty bucket list means no padding (CPU, ``--disable-cuda-graph``, the
transformers engine).
"""

from __future__ import annotations

from typing import Sequence


class BatchSizeBuckets:
    """Maps a batch size to its padded size in O(1) through a precomputed table."""

    __slots__ = ("capture_sizes", "_table", "_limit")

    def __init__(self, capture_sizes: Sequence[int] = ()):
        sizes = tuple(capture_sizes)
        for size in sizes:
            if isinstance(size, bool) or not isinstance(size, int) or size <= 0:
                raise ValueError(f"batch size bucket {size!r}: must be an integer > 0")
        if list(sizes) != sorted(set(sizes)):
            raise ValueError(f"batch size buckets {list(sizes)}: must be strictly increasing")
        self.capture_sizes = sizes
        largest = sizes[-1] if sizes else 0
        table = [0] * (largest + 1)
        bucket = 0
        for batch_size in range(largest, 0, -1):
            if batch_size in sizes:
                bucket = batch_size
            table[batch_size] = bucket
        self._table = table
        self._limit = largest + 1

    def padded(self, batch_size: int) -> int:
        """The batch size the engine runs ``batch_size`` at."""
        if batch_size < self._limit:
            return self._table[batch_size]
        return batch_size

    @property
    def table(self) -> list[int]:
        """``table[bs]`` for ``bs < limit`` (shared with the predictor's hot path; do not mutate)."""
        return self._table

    @property
    def limit(self) -> int:
        return self._limit

    def __eq__(self, other: object) -> bool:
        return isinstance(other, BatchSizeBuckets) and other.capture_sizes == self.capture_sizes

    def __hash__(self) -> int:
        return hash(self.capture_sizes)

    def __repr__(self) -> str:
        return f"BatchSizeBuckets({list(self.capture_sizes)})"
