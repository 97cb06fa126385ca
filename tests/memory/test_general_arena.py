"""The general arena: whole pages of lent chunks, contiguous across adjacent chunks,
best fit, clean failure when no run of lent pages is long enough; a reclaimed chunk's
arena range shows the dummy page, so a view kept past its free never faults and never
reaches the KV data (issue 18, defect 3)."""

from __future__ import annotations

import json
import subprocess
import sys

import torch

from .conftest import PAGE_BYTES, snapshot


def test_allocations_take_whole_pages(alloc):
    alloc.lend(0)
    one = alloc.arena_allocate(1)
    exact = alloc.arena_allocate(PAGE_BYTES)
    two = alloc.arena_allocate(PAGE_BYTES + 1)
    assert alloc.stats().pages_lent_used == 4
    assert alloc.stats().arena_used_bytes == 4 * PAGE_BYTES
    addresses = sorted(b.address for b in (one, exact, two))
    assert all((a - alloc.geometry.arena_base) % PAGE_BYTES == 0 for a in addresses)
    for b in (one, exact, two):
        b.free()


def test_an_allocation_spans_adjacent_lent_chunks_but_not_a_gap(alloc):
    g = alloc.geometry
    alloc.lend([2, 3, 5])
    big = alloc.arena_allocate(2 * g.chunk_bytes)  # only chunks 2+3 are contiguous
    assert big.address == g.arena_base + 2 * g.chunk_bytes
    assert alloc.chunk_info(2).used_pages == alloc.chunk_info(3).used_pages == g.pages_per_chunk
    assert alloc.arena_allocate(2 * g.chunk_bytes) is None
    big.free()
    alloc.reclaim(3)
    assert alloc.arena_allocate(2 * g.chunk_bytes) is None  # 2 and 5 are not neighbours


def test_exhaustion_is_a_value_and_changes_nothing(alloc):
    g = alloc.geometry
    assert alloc.arena_allocate(1) is None  # nothing lent
    alloc.lend(1)
    held = alloc.arena_allocate(g.chunk_bytes - PAGE_BYTES)
    before = snapshot(alloc)
    assert alloc.arena_allocate(2 * PAGE_BYTES) is None
    assert alloc.allocate(2 * PAGE_BYTES) is None
    assert snapshot(alloc) == before
    last = alloc.arena_allocate(PAGE_BYTES)
    assert last is not None
    held.free()
    last.free()


def test_best_fit_keeps_long_runs_and_packs_used_chunks(alloc):
    g = alloc.geometry
    alloc.lend([0, 1, 2])  # one run of 12 pages
    a = alloc.arena_allocate(PAGE_BYTES)  # page 0
    b = alloc.arena_allocate(PAGE_BYTES)  # page 1
    a.free()  # free runs: [0, 1) and [2, 12)
    c = alloc.arena_allocate(PAGE_BYTES)
    assert c.address == g.arena_base  # the 1-page hole, not the long run
    for block in (b, c):
        block.free()


def test_a_chunk_is_reclaimable_exactly_when_all_its_pages_are_free(alloc):
    g = alloc.geometry
    alloc.lend([4])
    blocks = [alloc.arena_allocate(PAGE_BYTES) for _ in range(g.pages_per_chunk)]
    assert alloc.arena_allocate(1) is None
    for i, block in enumerate(blocks):
        assert not alloc.can_reclaim(4)
        assert alloc.stats().chunks_lent_idle == 0
        block.free()
    assert alloc.can_reclaim(4) and alloc.stats().chunks_lent_idle == 1
    alloc.reclaim(4)


def test_fragmentation_counts_free_pages_of_partly_used_chunks(alloc):
    g = alloc.geometry
    alloc.lend([0, 6])
    block = alloc.arena_allocate(PAGE_BYTES)
    stats = alloc.stats()
    # One chunk partly used (3 free pages), the other idle (not fragmentation: reclaimable).
    assert stats.fragmentation_bytes == (g.pages_per_chunk - 1) * PAGE_BYTES
    assert stats.chunks_lent_idle == 1
    block.free()
    assert alloc.stats().fragmentation_bytes == 0


def test_arena_tensors_and_empty(alloc):
    alloc.lend([0, 1])
    made = alloc.empty((3, 1000), torch.float32)
    assert made is not None
    tensor, block = made
    assert tensor.shape == (3, 1000) and block.pool == "small"  # 12000 B < one page
    big, big_block = alloc.empty((4, PAGE_BYTES), torch.uint8)
    assert big_block.pool == "arena"
    tensor.fill_(2.5)
    big.fill_(9)
    assert tensor.sum().item() == 2.5 * 3000 and int(big.sum()) == 9 * 4 * PAGE_BYTES
    del tensor, big
    block.free()
    big_block.free()


# Runs in a child interpreter: without the dummy page behind a reclaimed arena range the
# stale write is a SIGSEGV (on a GPU: an illegal address that poisons the context), which
# would take the test run down with it instead of failing one test.
STALE_VIEW = """
import json, torch
from harvest.memory import UnifiedAllocator
alloc = UnifiedAllocator(num_layers=2, kv_heads=2, head_dim=16, dtype_bytes=4, max_tokens=8 * 128,
                         page_bytes=16 * 1024)
g = alloc.geometry
kv = {(layer, kind): alloc.kv_tensor(layer, kind, torch.float32) for layer in range(2) for kind in ("k", "v")}
alloc.lend(2)
block = alloc.arena_allocate(g.chunk_bytes)
stale = block.tensor(torch.float32)  # a view the trainer keeps past the free
stale.fill_(1.0)
block.free()
alloc.reclaim(2)
span = slice(g.chunk_slots(2).start * 32, g.chunk_slots(2).stop * 32)  # 32 floats per token
came_back = all(bool(torch.all(view[span] == 1.0)) for view in kv.values())  # the trainer's writes
for view in kv.values():
    view[span] = 7.0  # decode writes new KV into the reclaimed chunk
stale.fill_(-5.0)  # the stale view: must neither fault nor reach the KV
read_back = float(stale[0])
kv_intact = all(bool(torch.all(view[span] == 7.0)) for view in kv.values())
alloc.check_integrity()
stats = alloc.stats()
del stale, view
kv.clear()
alloc.close()
print(json.dumps({"came_back": came_back, "kv_intact": kv_intact, "read_back": read_back,
                  "lent": stats.chunks_lent}))
"""


def test_a_view_that_outlives_its_free_and_the_reclaim_hits_the_dummy_page_not_the_kv():
    out = subprocess.run([sys.executable, "-c", STALE_VIEW], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, f"exit {out.returncode} (negative: killed by that signal): {out.stderr[-2000:]}"
    result = json.loads(out.stdout.strip().splitlines()[-1])
    assert result == {"came_back": True, "kv_intact": True, "read_back": -5.0, "lent": 0}


def test_a_reclaimed_chunk_keeps_the_dummy_page_in_its_arena_slots_until_it_is_lent_again(alloc):
    g = alloc.geometry
    alloc.lend(6)
    alloc.reclaim(6)
    alloc.check_integrity()  # the arena slots hold the dummy, the KV slices their pages
    before = alloc.counters()
    alloc.lend(6)
    moved = alloc.counters().minus(before)
    assert moved.unmap == 1  # only the arena's dummy run: the KV slices keep their pages
    block = alloc.arena_allocate(g.chunk_bytes)
    assert block.address == g.arena_base + 6 * g.chunk_bytes
    block.tensor().fill_(3)  # the chunk's own pages again, writable
    block.free()
    alloc.reclaim(6)
