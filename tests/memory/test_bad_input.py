"""Every bad input is a clear exception naming the problem, and changes nothing."""

from __future__ import annotations

import os

import pytest
import torch

from harvest.memory import UnifiedAllocator, VmmInvalidArgument, VmmNoDriver
from tests.conftest import gpu_unavailable_reason

from .conftest import PAGE_BYTES, TINY_SHAPE, snapshot


def refused(alloc, match, call, error=VmmInvalidArgument):
    """`call` raises `error` matching `match`, and the allocator's state is as before."""
    before = snapshot(alloc)
    with pytest.raises(error, match=match):
        call()
    assert snapshot(alloc) == before
    alloc.check_integrity()


# ---------------------------------------------------------------- double free
def test_double_free_in_the_arena(alloc):
    alloc.lend(0)
    block = alloc.arena_allocate(PAGE_BYTES)
    alloc.free_address(block.address, "arena")
    refused(alloc, "double free", lambda: alloc.free_address(block.address, "arena"))


def test_double_free_of_an_arena_page_whose_chunk_was_reclaimed(alloc):
    alloc.lend(0)
    block = alloc.arena_allocate(PAGE_BYTES)
    block.free()
    alloc.reclaim(0)
    refused(alloc, "not lent.*double free", lambda: alloc.free_address(block.address, "arena"))


def test_double_free_in_the_small_pool(alloc):
    block = alloc.small_allocate(100)
    alloc.free_address(block.address, "small")
    refused(alloc, "double free", lambda: alloc.free_address(block.address, "small"))


def test_double_free_through_an_allocation_object(alloc):
    block = alloc.small_allocate(100)
    block.free()
    refused(alloc, "double free", block.free)


# ---------------------------------------------------------------- unknown pointers
def test_unknown_pointer_outside_every_pool(alloc):
    refused(alloc, "not in the general arena.*unknown pointer", lambda: alloc.free_address(0x1000, "arena"))
    refused(alloc, "not in the small pool.*unknown pointer", lambda: alloc.free_address(0x1000, "small"))


def test_unknown_pointer_inside_an_arena_allocation(alloc):
    alloc.lend(0)
    block = alloc.arena_allocate(2 * PAGE_BYTES)
    refused(alloc, "not page aligned", lambda: alloc.free_address(block.address + 8, "arena"))
    refused(alloc, "inside the allocation", lambda: alloc.free_address(block.address + PAGE_BYTES, "arena"))
    block.free()


def test_unknown_pointer_inside_a_small_block(alloc):
    block = alloc.small_allocate(8192)
    refused(alloc, "not at a 2 KiB block start", lambda: alloc.free_address(block.address + 4, "small"))
    refused(alloc, "inside a block", lambda: alloc.free_address(block.address + 2048, "small"))
    block.free()


def test_unknown_pool_name(alloc):
    refused(alloc, "pool=", lambda: alloc.free_address(0, "heap"), ValueError)


# ---------------------------------------------------------------- lend / reclaim
def test_lending_a_chunk_with_live_token_slots(alloc):
    alloc.mark_slots_live([300])  # chunk 2
    refused(alloc, r"chunk 2 still holds 1 live token slots \(its slots are \[256, 384\)\)",
            lambda: alloc.lend(2))
    # A batch is all or nothing: chunk 1 is not lent either.
    refused(alloc, "chunk 2 still holds", lambda: alloc.lend([1, 2]))


def test_reclaiming_a_chunk_the_trainer_still_uses(alloc):
    alloc.lend(3)
    block = alloc.arena_allocate(PAGE_BYTES)
    refused(alloc, "chunk 3 is still used by the trainer: 1 of its 4 pages", lambda: alloc.reclaim(3))
    block.free()


def test_lend_and_reclaim_in_the_wrong_state(alloc):
    alloc.lend(1)
    refused(alloc, "chunk 1 is already lent", lambda: alloc.lend(1))
    refused(alloc, "chunk 0 is not lent", lambda: alloc.reclaim(0))
    refused(alloc, "chunk 8 is out of range", lambda: alloc.lend(8))
    refused(alloc, "chunk -1 is out of range", lambda: alloc.reclaim(-1))
    refused(alloc, "chunk 2 is listed twice", lambda: alloc.lend([2, 2]))
    refused(alloc, "pass at least one chunk", lambda: alloc.lend([]))
    refused(alloc, "chunk 9 is out of range", lambda: alloc.can_lend(9))
    refused(alloc, "must be integers", lambda: alloc.lend([1.5]), TypeError)


# ---------------------------------------------------------------- token slots
def test_slot_marking_errors_change_no_slot(alloc):
    alloc.mark_slots_live([10])
    refused(alloc, "slot 10 is already live", lambda: alloc.mark_slots_live([11, 10]))
    refused(alloc, "slot 12 is not live", lambda: alloc.mark_slots_free([10, 12]))
    refused(alloc, r"slot 1024 is out of range \[0, 1024\)", lambda: alloc.mark_slots_live([1024]))
    refused(alloc, "slot -3 is out of range", lambda: alloc.mark_slots_free([-3]))
    alloc.lend(5)
    refused(alloc, "slot 640 belongs to chunk 5, which is lent", lambda: alloc.mark_slots_live([640]))
    assert alloc.chunk_info(0).live_slots == 1


# ---------------------------------------------------------------- sizes
@pytest.mark.parametrize("num_bytes", [0, -1, -(2**40)])
def test_zero_or_negative_allocation_sizes(alloc, num_bytes):
    alloc.lend(0)
    refused(alloc, f"num_bytes={num_bytes} must be positive", lambda: alloc.arena_allocate(num_bytes))
    refused(alloc, f"num_bytes={num_bytes} must be positive", lambda: alloc.small_allocate(num_bytes))
    refused(alloc, f"num_bytes={num_bytes} must be positive", lambda: alloc.allocate(num_bytes))


def test_sizes_no_pool_can_ever_serve(alloc):
    refused(alloc, "not under one page", lambda: alloc.small_allocate(PAGE_BYTES))
    refused(alloc, "exceeds the whole KV pool", lambda: alloc.arena_allocate(10**12))


def open_fds() -> int:
    return len(os.listdir("/proc/self/fd"))


@pytest.mark.parametrize(
    "overrides, match",
    [
        (dict(head_dim=20), r"per-token bytes 160 \(kv_heads 2 x head_dim 20 x dtype_bytes 4\) do not divide "
                            r"the page size 16384"),
        (dict(max_tokens=0), "max_tokens=0 must be positive"),
        (dict(max_tokens=-5), "max_tokens=-5 must be positive"),
        (dict(num_layers=0), "num_layers=0 must be positive"),
        (dict(kv_heads=-1), "kv_heads=-1 must be positive"),
        (dict(head_dim=0), "head_dim=0 must be positive"),
        (dict(dtype_bytes=0), "dtype_bytes=0 must be positive"),
        (dict(small_pool_bytes=-1), "small_pool_bytes=-1 must not be negative"),
        (dict(page_bytes=-4096), "page_bytes=-4096 must not be negative"),
        (dict(page_bytes=3 * 4096), "page_bytes=12288 must be a power of two"),
        (dict(page_bytes=1024), "page_bytes=1024 must be a power of two and at least the OS page size"),
    ],
)
def test_bad_configuration_creates_nothing(overrides, match):
    kwargs = dict(TINY_SHAPE, max_tokens=1024, small_pool_bytes=PAGE_BYTES, page_bytes=PAGE_BYTES)
    kwargs.update(overrides)
    fds = open_fds()
    with pytest.raises(VmmInvalidArgument, match=match):
        UnifiedAllocator(**kwargs)
    assert open_fds() == fds  # no memfd or other resource left behind


def test_bad_argument_types():
    base = dict(TINY_SHAPE, max_tokens=1024, page_bytes=PAGE_BYTES)
    with pytest.raises(TypeError, match="max_tokens must be an int, got float"):
        UnifiedAllocator(**{**base, "max_tokens": 10.5})
    with pytest.raises(TypeError, match="num_layers must be an int, got bool"):
        UnifiedAllocator(**{**base, "num_layers": True})
    with pytest.raises(ValueError, match="backend='tpu' is unknown"):
        UnifiedAllocator(**base, backend="tpu")


@pytest.mark.skipif(gpu_unavailable_reason() is None, reason="a GPU is present")
def test_cuda_backend_without_a_driver_says_why():
    with pytest.raises(VmmNoDriver, match="libcuda.so.1|cuInit"):
        UnifiedAllocator(**TINY_SHAPE, max_tokens=1024, backend="cuda")


# ---------------------------------------------------------------- lifetime
def test_close_is_refused_while_views_live_and_calls_after_close_fail(make_allocator):
    alloc = make_allocator()
    view = alloc.kv_tensor(0, "k", torch.float32)
    with pytest.raises(VmmInvalidArgument, match="1 tensor views still point into allocator memory"):
        alloc.close()
    del view
    alloc.close()
    with pytest.raises(VmmInvalidArgument, match="closed"):
        alloc.stats()


def test_views_must_lie_inside_allocator_memory(alloc):
    g = alloc.geometry
    refused(alloc, "not inside this allocator's memory", lambda: alloc.tensor_view(g.arena_base - 1, 10))
    refused(alloc, "not inside", lambda: alloc.tensor_view(g.small_base + g.small_bytes - 4, 8))
    refused(alloc, "needs 4096 bytes but the memory has 100",
            lambda: alloc.tensor_view(g.kv_base, 100, torch.float32, (1024,)), ValueError)
