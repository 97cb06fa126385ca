"""The host bookkeeping of a paged KV cache: a pool of fixed-size pages, the pages each
row (a decode slot) holds in order, and who owns each page. Pure Python: the device
copies (the page table the attention reads, each page's owner and logical index) are made
from :meth:`PageTable.owners` and :meth:`PageTable.rows` by
:class:`~.paged_batch.PagedDecodeBatch`.

Invariants: a page belongs to at most one row; a row's pages hold its tokens in order
(token t of a row lives in its page ``t // page_size``, at offset ``t % page_size``); a
released row's pages return to the free list, lowest index first out; asking for more
pages than are free raises :class:`KvPoolExhausted` and changes nothing.
"""

from __future__ import annotations

import heapq

# The flex-decoding kernel tiles a page's tokens with power-of-two blocks of at least 16
# (torch/_inductor/kernel/flex/flex_decoding.py: SPARSE_KV_BLOCK_SIZE % BLOCK_N == 0).
MIN_CUDA_PAGE_SIZE = 16


class KvPoolExhausted(RuntimeError):
    """More KV pages were asked for than the pool has free."""


def check_page_size(page_size: int, device_type: str = "cpu") -> None:
    """Refuse a page size the paged step cannot use (ValueError naming the value)."""
    if not isinstance(page_size, int) or isinstance(page_size, bool) or page_size < 1:
        raise ValueError(f"page_size={page_size!r}: a positive number of tokens per KV page")
    if page_size & (page_size - 1):
        raise ValueError(f"page_size={page_size}: a power of two (the attention kernel's tiles must divide a page)")
    if device_type == "cuda" and page_size < MIN_CUDA_PAGE_SIZE:
        raise ValueError(f"page_size={page_size}: at least {MIN_CUDA_PAGE_SIZE} tokens on CUDA "
                         "(the flex-decoding kernel's smallest tile)")


def pages_for(tokens: int, page_size: int) -> int:
    return -(-tokens // page_size)


class PageTable:
    """``num_pages`` pages of ``page_size`` tokens shared by ``num_rows`` rows, each row
    holding at most ``pages_per_row`` pages."""

    def __init__(self, num_pages: int, page_size: int, num_rows: int, pages_per_row: int):
        check_page_size(page_size)
        for name, value in (("num_pages", num_pages), ("num_rows", num_rows), ("pages_per_row", pages_per_row)):
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"{name}={value!r}: a positive integer")
        self.num_pages, self.page_size = num_pages, page_size
        self.num_rows, self.pages_per_row = num_rows, pages_per_row
        self._free = list(range(num_pages))  # a min-heap: the lowest free page is taken first
        self._rows: list[list[int]] = [[] for _ in range(num_rows)]
        self._owner = [-1] * num_pages  # page -> row, -1 free
        self.version = 0  # bumped on every change (the device copy is refreshed when it moved)

    @property
    def free_pages(self) -> int:
        return len(self._free)

    @property
    def used_pages(self) -> int:
        return self.num_pages - len(self._free)

    def pages(self, row: int) -> list[int]:
        """Row ``row``'s pages, logical order."""
        return list(self._rows[row])

    def capacity(self, row: int) -> int:
        """Tokens row ``row`` can hold with the pages it has."""
        return len(self._rows[row]) * self.page_size

    def needed(self, row: int, tokens: int) -> int:
        """Pages row ``row`` lacks to hold ``tokens`` tokens."""
        return max(0, pages_for(tokens, self.page_size) - len(self._rows[row]))

    def reserve(self, row: int, tokens: int) -> list[int]:
        """Pages enough for row ``row`` to hold ``tokens`` tokens (the new ones returned)."""
        return self.reserve_many({row: tokens}).get(row, [])

    def reserve_many(self, tokens_by_row: dict[int, int]) -> dict[int, list[int]]:
        """:meth:`reserve` for several rows at once: all of them, or (KvPoolExhausted,
        ValueError) none."""
        wanted = {}
        for row, tokens in tokens_by_row.items():
            self._check_row(row)
            count = self.needed(row, tokens)
            if len(self._rows[row]) + count > self.pages_per_row:
                raise ValueError(f"row {row}: {tokens} tokens need {pages_for(tokens, self.page_size)} pages of "
                                 f"{self.page_size}, a row holds at most {self.pages_per_row}")
            if count:
                wanted[row] = count
        total = sum(wanted.values())
        if total > len(self._free):
            raise KvPoolExhausted(
                f"KV page pool exhausted: {total} more page(s) of {self.page_size} tokens wanted, "
                f"{len(self._free)} of {self.num_pages} free (give the batch more pages, or fewer or shorter requests)")
        given: dict[int, list[int]] = {}
        for row, count in wanted.items():
            pages = [heapq.heappop(self._free) for _ in range(count)]
            self._rows[row].extend(pages)
            for page in pages:
                self._owner[page] = row
            given[row] = pages
        if given:
            self.version += 1
        return given

    def release(self, row: int) -> list[int]:
        """Row ``row``'s pages back to the pool (returned)."""
        self._check_row(row)
        pages, self._rows[row] = self._rows[row], []
        for page in pages:
            self._owner[page] = -1
        for page in pages:
            heapq.heappush(self._free, page)
        if pages:
            self.version += 1
        return pages

    def move(self, src: int, dst: int) -> None:
        """Row ``src``'s pages become row ``dst``'s (which holds none): a slot moving,
        its KV staying where it is."""
        self._check_row(src)
        self._check_row(dst)
        if self._rows[dst]:
            raise ValueError(f"row {dst} still holds pages {self._rows[dst]}")
        self._rows[dst], self._rows[src] = self._rows[src], []
        for page in self._rows[dst]:
            self._owner[page] = dst
        self.version += 1

    def rows(self, fill: int) -> list[list[int]]:
        """Every row's page list padded to ``pages_per_row`` with ``fill``."""
        return [pages + [fill] * (self.pages_per_row - len(pages)) for pages in self._rows]

    def owners(self) -> tuple[list[int], list[int]]:
        """(owner row or -1, logical index within its row or 0) of every page."""
        logical = [0] * self.num_pages
        for pages in self._rows:
            for index, page in enumerate(pages):
                logical[page] = index
        return list(self._owner), logical

    def _check_row(self, row: int) -> None:
        if not 0 <= row < self.num_rows:
            raise IndexError(f"row {row} out of range (0..{self.num_rows - 1})")
