"""The cuda backend's fences against the fake driver (tests/compute/fake_libcuda.c): real
cuEventCreate / cuEventRecord / cuEventQuery / cuEventSynchronize / cuMemMap / cuMemUnmap
calls from csrc/vmm_allocator/backend_cuda.cpp, on a machine without a GPU.

The KV ranges are mapped once at start-up and never change: a lend maps a chunk's pages
into the trainer's arena as well, and a reclaim takes that second mapping away (hvmm.h).
The fake keeps kernels "running" on a stream until the test lets them finish; a kernel
may touch anything (fake_queue_work) or one address range (fake_queue_work_in), and the
fake flags (BAD) any cuMemUnmap of a range an unfinished kernel may touch: the fault
that would poison a real context. So these show, with the driver calls in the order they
were made, that a lend maps nothing into the arena before every registered decode
stream's fence has passed (decode work queued before the lend may still write the
chunk's slots), that a lend polled while decode is busy is finished later without
waiting, that a reclaim waits for the trainer's arena-free fences and not for decode
(whose mappings of the pages never leave) before it unmaps the arena run, that a chunk
lent again loses the arena's dummy run only after the decode fences, that the cuda
backend makes the host backend's calls ([P + 1, 3, P + 2, 3] for lend, reclaim, lend,
reclaim of P pages), and that a fenced small-pool block is reused only after its fence
passes. Control cases without a registered decode stream, or a trainer free without its
stream, show what the fences guard against.
"""

from __future__ import annotations

import pytest

from tests import fake_cuda

pytestmark = fake_cuda.needs_fake_driver

# CUstream values (the fake keys streams by value).
DECODE_A, DECODE_B, TRAINER, TRAINER_2 = 0x1000, 0x2000, 0x3000, 0x4000

PRELUDE = f"""
import os
from harvest.memory import UnifiedAllocator, VmmInvalidArgument
fake = ctypes.CDLL("libcuda.so.1")
fake.fake_queue_work.argtypes = [ctypes.c_ulonglong]
fake.fake_queue_work_in.argtypes = [ctypes.c_ulonglong, ctypes.c_ulonglong, ctypes.c_ulonglong]
fake.fake_finish_work.argtypes = [ctypes.c_ulonglong]
DECODE_A, DECODE_B, TRAINER, TRAINER_2 = {DECODE_A}, {DECODE_B}, {TRAINER}, {TRAINER_2}

def mark(text):
    with open(os.environ["FAKE_CUDA_LOG"], "a") as log:
        print("python: " + text, file=log)

# 128 bytes per token per layer per K/V: 16384-token chunks of 2 MiB pages, 4 pages each.
CONFIG = dict(num_layers=2, kv_heads=2, head_dim=16, dtype_bytes=4, max_tokens=4 * 16384, small_pool_bytes=2 << 20)
alloc = UnifiedAllocator(**CONFIG, backend="cuda")
g = alloc.geometry
KV_BYTES = g.pages_per_chunk * g.kv_range_bytes  # every K and V range, one after another

def decode_step(stream):
    # A decode kernel: it reads and writes the KV cache (every range), never the arena.
    fake.fake_queue_work_in(stream, g.kv_base, KV_BYTES)

def finish(**result):
    result["geometry"] = {{name: getattr(g, name) for name in (
        "page_bytes", "pages_per_chunk", "chunk_bytes", "kv_base", "kv_range_bytes", "arena_base", "arena_bytes")}}
    print(json.dumps(result))
"""


@pytest.fixture(scope="module")
def driver_dir(tmp_path_factory):
    return fake_cuda.build_fake_driver(tmp_path_factory.mktemp("fake_cuda"))


def run(driver_dir, tmp_path, script, **kwargs):
    return fake_cuda.run_with_fake_driver(driver_dir, tmp_path, script, prelude=PRELUDE, **kwargs)


def after(lines, marker):
    return lines[lines.index(f"python: {marker}") + 1:]


def between(lines, start, end):
    return lines[lines.index(f"python: {start}") + 1: lines.index(f"python: {end}")]


def event_ids(lines, stream):
    return [line.split()[1] for line in lines if line.startswith("event_record") and line.endswith(f"stream={stream}")]


def field(line, name):
    return int(next(item for item in line.split() if item.startswith(f"{name}=")).split("=")[1])


def calls(lines, kind):
    """The lines of one driver call kind: "mem_map", "mem_unmap", "mem_set_access", "event_sync", ..."""
    return [line for line in lines if line.split()[0] == kind]


def in_arena(line, geometry):
    return geometry["arena_base"] <= field(line, "va") < geometry["arena_base"] + geometry["arena_bytes"]


def in_kv(line, geometry):
    kv_end = geometry["kv_base"] + geometry["pages_per_chunk"] * geometry["kv_range_bytes"]
    return geometry["kv_base"] <= field(line, "va") < kv_end


def chunk_run(geometry, chunk):
    """va and bytes of one chunk's arena run."""
    return geometry["arena_base"] + chunk * geometry["chunk_bytes"], geometry["chunk_bytes"]


def assert_maps_chunk_into_arena(lines, geometry, chunk):
    """The lines hold one lend of `chunk`: each of its pages mapped into its arena run,
    one set-access over that run, and no mapping call anywhere near the KV ranges."""
    va, size = chunk_run(geometry, chunk)
    maps = calls(lines, "mem_map")
    assert sorted(field(line, "va") for line in maps) == list(range(va, va + size, geometry["page_bytes"]))
    assert all(field(line, "bytes") == geometry["page_bytes"] for line in maps)
    assert [(field(line, "va"), field(line, "bytes")) for line in calls(lines, "mem_set_access")] == [(va, size)]
    mapping = [line for line in lines if line.startswith("mem_")]
    assert not [line for line in mapping if in_kv(line, geometry)]


def assert_all_released(lines):
    counts = fake_cuda.exit_counts(lines)
    assert counts == dict(counts, primary_refs=0, live_events=0, live_reserves=0, live_pages=0, mapped=0), lines[-1]


def test_a_lend_polled_while_decode_is_busy_maps_nothing_into_the_arena_until_every_stream_finished(
        driver_dir, tmp_path):
    result, lines = run(driver_dir, tmp_path, """
    default_streams = list(alloc.fence_streams)
    alloc.set_fence_streams([DECODE_A, DECODE_B])
    decode_step(DECODE_A)  # a decode step in flight on each stream
    decode_step(DECODE_B)
    mark("lend")
    lent_now = alloc.lend(2, wait=False)
    state = int(alloc.chunk_table()[2].state)
    not_yet = alloc.finish_lends()
    arena_empty = alloc.arena_allocate(1) is None
    fake.fake_finish_work(DECODE_A)
    mark("A finished")
    still = alloc.finish_lends()
    arena_still_empty = alloc.arena_allocate(1) is None
    fake.fake_finish_work(DECODE_B)
    mark("B finished")
    done = alloc.finish_lends()
    mark("finished")
    block = alloc.arena_allocate(1)
    block_address = block.address
    block.free(streams=[])
    mark("reclaim")
    alloc.reclaim(2)
    alloc.close()
    finish(default=default_streams, lent_now=lent_now, state=state, not_yet=not_yet, arena_empty=arena_empty,
           still=still, arena_still_empty=arena_still_empty, done=done, block=block_address)
    """)
    geometry = result["geometry"]
    assert result["default"] == [0]  # the legacy default stream until the caller names its streams
    assert result["lent_now"] is False and result["state"] == 4  # LENDING
    assert result["not_yet"] == [] and result["arena_empty"]
    assert result["still"] == [] and result["arena_still_empty"]  # one stream passed is not enough
    assert result["done"] == [2]
    assert result["block"] == chunk_run(geometry, 2)[0]  # the trainer has chunk 2's pages now
    waiting = between(lines, "lend", "B finished")
    assert not [line for line in waiting if line.startswith("mem_")]  # nothing mapped, unmapped or accessed
    assert not calls(waiting, "event_sync")  # polled, never waited
    a_events, b_events = event_ids(waiting, DECODE_A), event_ids(waiting, DECODE_B)
    assert len(a_events) == len(b_events) == 1
    assert [line for line in waiting if line.startswith("event_query") and line.endswith("ready=0")]
    finishing = between(lines, "B finished", "finished")
    assert not calls(finishing, "event_sync")  # finish_lends only queries
    assert not calls(finishing, "mem_unmap")  # the chunk's first lend: no dummy run to take out
    assert_maps_chunk_into_arena(finishing, geometry, 2)
    first_map = next(i for i, line in enumerate(finishing) if line.startswith("mem_map"))
    ready = [line for line in finishing[:first_map] if line.endswith("ready=1")]
    assert {line.split()[1] for line in ready} == {a_events[0], b_events[0]}
    assert_all_released(lines)


def test_a_blocking_lend_synchronizes_on_the_decode_events_before_its_first_arena_map(driver_dir, tmp_path):
    _, lines = run(driver_dir, tmp_path, """
    alloc.set_fence_streams([DECODE_A, None])
    decode_step(DECODE_A)
    decode_step(0)
    mark("lend")
    alloc.lend(1)
    mark("lent")
    alloc.reclaim(1)
    decode_step(DECODE_A)
    mark("lend again")
    alloc.lend(1)
    mark("lent again")
    alloc.reclaim(1)
    alloc.close()
    finish()
    """)
    for start, end in (("lend", "lent"), ("lend again", "lent again")):
        lending = between(lines, start, end)
        syncs = [i for i, line in enumerate(lending) if line.startswith("event_sync")]
        moves = [i for i, line in enumerate(lending) if line.startswith("mem_")]
        assert len(syncs) == 2 and moves and max(syncs) < min(moves), (start, lending)
        assert event_ids(lending, DECODE_A) and event_ids(lending, 0)  # None: the legacy default stream
    # Lent again: the arena's dummy run over chunk 1 goes out (one unmap), after the syncs.
    relending = between(lines, "lend again", "lent again")
    assert len(calls(relending, "mem_unmap")) == 1
    assert_all_released(lines)


def test_without_the_decode_stream_registered_the_lend_maps_into_the_arena_under_a_running_decode_kernel(
        driver_dir, tmp_path):
    # Nothing unmaps during a lend, so the fake has nothing to flag: the hazard is the
    # order itself. Decode's kernel, queued before the lend, may still write chunk 1's KV
    # slots while those pages are already the trainer's.
    result, lines = run(driver_dir, tmp_path, """
    alloc.set_fence_streams([])
    decode_step(DECODE_A)  # decode's kernels, but nobody told the allocator
    mark("lend")
    alloc.lend(1)
    mark("lent")
    fake.fake_finish_work(DECODE_A)
    mark("decode finished")
    alloc.reclaim(1)
    alloc.close()
    finish()
    """)
    lending = between(lines, "lend", "lent")
    assert not [line for line in lending if line.startswith("event_")]  # no fence recorded, none waited on
    assert_maps_chunk_into_arena(lending, result["geometry"], 1)
    first_map = next(i for i, line in enumerate(lines)
                     if line.startswith("mem_map") and in_arena(line, result["geometry"]))
    decode_done = lines.index(f"work_finished stream={DECODE_A}")
    assert lines.index("python: lend") < first_map < decode_done
    assert_all_released(lines)


def test_a_reclaim_waits_for_the_trainer_frees_and_not_for_decode_before_it_unmaps_the_arena_run(
        driver_dir, tmp_path):
    result, lines = run(driver_dir, tmp_path, """
    alloc.set_fence_streams([DECODE_A])
    alloc.lend(3)
    block = alloc.arena_allocate(g.page_bytes)
    fake.fake_queue_work(TRAINER)  # the trainer's kernels still use the block
    block.free(streams=[TRAINER])
    decode_step(DECODE_A)  # and a decode step is in flight, on the KV ranges only
    mark("reclaim")
    alloc.reclaim(3)
    mark("reclaimed")
    fake.fake_finish_work(DECODE_A)  # before close unmaps the KV ranges
    alloc.close()
    finish()
    """)
    geometry = result["geometry"]
    reclaiming = between(lines, "reclaim", "reclaimed")
    unmaps = [i for i, line in enumerate(reclaiming) if line.startswith("mem_unmap")]
    assert len(unmaps) == 1
    unmap = reclaiming[unmaps[0]]
    assert (field(unmap, "va"), field(unmap, "bytes")) == chunk_run(geometry, 3)
    synced = calls(reclaiming[:unmaps[0]], "event_sync")
    assert [line.split()[-1] for line in synced] == [f"stream={TRAINER}"]
    assert calls(reclaiming, "event_sync") == synced
    # Decode is neither fenced nor waited for: its kernel is still running after the reclaim.
    assert not [line for line in reclaiming if line.startswith("event_") and line.endswith(f"stream={DECODE_A}")]
    assert not [line for line in reclaiming if line.startswith("work_finished")]
    assert lines.index(f"work_finished stream={DECODE_A}") > lines.index("python: reclaimed")
    # The arena's dummy run over the chunk's slots, one access call; nothing on the KV side.
    after_unmap = reclaiming[unmaps[0] + 1:]
    assert [(field(line, "va"), field(line, "bytes")) for line in calls(after_unmap, "mem_map")] == [
        chunk_run(geometry, 3)]
    assert [(field(line, "va"), field(line, "bytes")) for line in calls(after_unmap, "mem_set_access")] == [
        chunk_run(geometry, 3)]
    assert not [line for line in reclaiming if line.startswith("mem_") and in_kv(line, geometry)]
    assert_all_released(lines)


def test_a_lend_again_waits_for_decode_and_not_for_trainer_work_elsewhere_in_the_arena(driver_dir, tmp_path):
    # The dummy run over a reclaimed chunk's arena slots goes out before its pages come
    # back in: after the decode fences, and under a trainer kernel running on another lent
    # chunk (whose earlier kernel, the fake sees, ended at the reclaim's event sync).
    result, lines = run(driver_dir, tmp_path, """
    alloc.set_fence_streams([DECODE_A])
    alloc.lend([2, 3])
    block = alloc.arena_allocate(g.page_bytes)
    fake.fake_queue_work(TRAINER)
    block.free(streams=[TRAINER])
    alloc.reclaim(2)  # waits for that kernel
    late = alloc.arena_allocate(g.page_bytes)
    addresses = [block.address, late.address]
    fake.fake_queue_work_in(TRAINER, late.address, g.page_bytes)
    decode_step(DECODE_A)
    mark("lend again")
    alloc.lend(2)
    mark("lent again")
    late.free(streams=[TRAINER])
    alloc.reclaim([2, 3])
    alloc.close()
    finish(addresses=addresses)
    """)
    geometry = result["geometry"]
    va, size = chunk_run(geometry, 2)
    assert result["addresses"] == [va, chunk_run(geometry, 3)[0]]
    relending = between(lines, "lend again", "lent again")
    unmap = relending.index(f"mem_unmap va={va} bytes={size}")
    assert [line.split()[-1] for line in calls(relending[:unmap], "event_sync")] == [f"stream={DECODE_A}"]
    assert calls(relending, "mem_unmap") == [relending[unmap]]
    assert_maps_chunk_into_arena(relending[unmap + 1:], geometry, 2)
    assert not [line for line in relending if line.startswith("event_") and line.endswith(f"stream={TRAINER}")]
    assert_all_released(lines)


def test_an_arena_free_without_its_stream_lets_the_reclaim_unmap_under_a_running_trainer_kernel(
        driver_dir, tmp_path):
    # The control case for the arena fences: the fake flags the unmap of chunk 2's arena
    # run under the trainer kernel nobody fenced, and only that one: decode's kernel on
    # the KV ranges and a trainer kernel on chunk 3's arena pages are running too.
    result, lines = run(driver_dir, tmp_path, """
    alloc.set_fence_streams([DECODE_A])
    alloc.lend([2, 3])
    here = alloc.arena_allocate(g.page_bytes)
    rest = alloc.arena_allocate(g.chunk_bytes - g.page_bytes)
    there = alloc.arena_allocate(g.page_bytes)
    addresses = [here.address, rest.address, there.address]
    fake.fake_queue_work_in(TRAINER, here.address, g.page_bytes)
    fake.fake_queue_work_in(TRAINER_2, there.address, g.page_bytes)
    here.free(streams=[])  # the caller forgot the stream its kernel runs on
    rest.free(streams=[])
    decode_step(DECODE_A)
    mark("reclaim")
    alloc.reclaim(2)
    mark("reclaimed")
    fake.fake_finish_work(TRAINER)
    fake.fake_finish_work(DECODE_A)
    there.free(streams=[TRAINER_2])
    mark("reclaim 3")
    alloc.reclaim(3)  # waits for TRAINER_2's fence before the unmap: no BAD
    alloc.close()
    finish(addresses=addresses)
    """, allow_bad=True)
    geometry = result["geometry"]
    va, size = chunk_run(geometry, 2)
    assert result["addresses"] == [va, va + geometry["page_bytes"], chunk_run(geometry, 3)[0]]
    bad = [line for line in lines if line.startswith("BAD")]
    assert bad == [f"BAD mem_unmap va={va} bytes={size} while stream {TRAINER} has 1 unfinished kernels "
                   "that may touch it"]
    assert bad[0] in between(lines, "reclaim", "reclaimed")
    assert not calls(between(lines, "reclaim", "reclaimed"), "event_sync")
    reclaiming_3 = after(lines, "reclaim 3")
    first_unmap = next(i for i, line in enumerate(reclaiming_3) if line.startswith("mem_unmap"))
    assert [line.split()[-1] for line in calls(reclaiming_3[:first_unmap], "event_sync")] == [f"stream={TRAINER_2}"]
    assert_all_released(lines)


def test_a_small_block_freed_on_a_busy_stream_is_reused_only_after_its_event_passes(driver_dir, tmp_path):
    result, lines = run(driver_dir, tmp_path, """
    whole = alloc.small_allocate(g.page_bytes - 1)  # the pool's only page
    fake.fake_queue_work(TRAINER)
    whole.free(streams=[TRAINER])
    pending = alloc.stats().small_pending_frees
    refused = alloc.small_allocate(1) is None
    fake.fake_finish_work(TRAINER)
    mark("finished")
    again = alloc.small_allocate(g.page_bytes - 1)
    same = again.address == whole.address
    again.free(streams=[])
    alloc.close()
    print(json.dumps({"pending": pending, "refused": refused, "same": same}))
    """)
    assert result == {"pending": 1, "refused": True, "same": True}
    assert any(line.startswith("event_query") and line.endswith("ready=0") for line in lines)
    assert any(line.startswith("event_query") and line.endswith("ready=1") for line in after(lines, "finished"))
    assert_all_released(lines)


def test_holding_fences_is_a_host_backend_hook(driver_dir, tmp_path):
    result, _ = run(driver_dir, tmp_path, """
    try:
        alloc.hold_fences()
        message = None
    except VmmInvalidArgument as error:
        message = str(error)
    alloc.close()
    print(json.dumps({"message": message}))
    """)
    assert "test hook of the host backend" in result["message"]


def test_the_cuda_backend_makes_the_same_calls_as_the_host_backend_and_the_fake_driver_accepts_each(
        driver_dir, tmp_path):
    # The fake refuses (BAD, CUDA_ERROR_INVALID_VALUE) a set-access over any unmapped page,
    # a map over a mapped page, at a non-zero offset or past its allocation: the lend's one
    # access call spans the chunk's arena run, and the arena's dummy run is one allocation
    # of a chunk's pages, mapped over a reclaimed chunk in one call.
    result, lines = run(driver_dir, tmp_path, """
    host = UnifiedAllocator(**CONFIG, backend="host", page_bytes=g.page_bytes)
    counted = {}
    for name, allocator in (("host", host), ("cuda", alloc)):
        allocator.set_fence_streams([])
        counted[name] = []
        for step, move in enumerate((allocator.lend, allocator.reclaim, allocator.lend, allocator.reclaim)):
            before = allocator.counters()
            if name == "cuda":
                mark(f"{move.__name__} {step // 2}")
            move(1)
            counted[name].append(allocator.counters().minus(before).mapping_calls)
        counted[name + " creates"] = allocator.counters().create_at_init
    mark("done")
    host.close()
    alloc.close()
    finish(counted=counted, kv_pages=g.num_chunks * g.pages_per_chunk, small_pages=g.small_pages)
    """)
    geometry = result["geometry"]
    pages = geometry["pages_per_chunk"]
    counted = result["counted"]
    assert counted["cuda"] == counted["host"] == [pages + 1, 3, pages + 2, 3]
    # At start-up: one allocation per KV page and small-pool page, and the arena's dummy
    # run (one allocation of a chunk's pages). No KV-side dummy page.
    assert counted["cuda creates"] == counted["host creates"] == result["kv_pages"] + result["small_pages"] + 1
    va, size = chunk_run(geometry, 1)
    first_lend = between(lines, "lend 0", "reclaim 0")
    assert not calls(first_lend, "mem_unmap")
    assert_maps_chunk_into_arena(first_lend, geometry, 1)
    relend = between(lines, "lend 1", "reclaim 1")
    assert relend[0] == f"mem_unmap va={va} bytes={size}"  # the arena's dummy run out first, in one call
    assert_maps_chunk_into_arena(relend[1:], geometry, 1)
    for reclaim in (between(lines, "reclaim 0", "lend 1"), between(lines, "reclaim 1", "done")):
        # Out of the arena in one unmap, the dummy run over the chunk's slots, one access call.
        assert [line.split()[0] for line in reclaim] == ["mem_unmap", "mem_map", "mem_set_access"]
        assert all((field(line, "va"), field(line, "bytes")) == (va, size) for line in reclaim)
    assert_all_released(lines)
