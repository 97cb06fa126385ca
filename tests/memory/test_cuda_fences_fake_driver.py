"""The cuda backend's fences against the fake driver (tests/compute/fake_libcuda.c): real
cuEventCreate / cuEventRecord / cuEventQuery / cuEventSynchronize / cuMemUnmap calls from
csrc/vmm_allocator/backend_cuda.cpp, on a machine without a GPU.

The fake keeps kernels "running" on a stream until the test lets them finish, and flags
(BAD) any cuMemUnmap while a stream still has unfinished kernels: the fault that would
poison a real context. So these show, with the driver calls in the order they were made,
that lend and reclaim never unmap before every registered stream's fence has passed
(issue 18, defect 2), that a lend polled while decode is busy is finished later without
waiting, and that a fenced small-pool block is reused only after its fence passes
(defect 6). A control case without registered streams shows the fake catching the hazard.
"""

from __future__ import annotations

import pytest

from tests import fake_cuda

pytestmark = fake_cuda.needs_fake_driver

DECODE_A, DECODE_B, TRAINER = 0x1000, 0x2000, 0x3000  # CUstream values (the fake keys streams by value)

PRELUDE = f"""
import os
from harvest.memory import UnifiedAllocator, VmmInvalidArgument
fake = ctypes.CDLL("libcuda.so.1")
fake.fake_queue_work.argtypes = [ctypes.c_ulonglong]
fake.fake_finish_work.argtypes = [ctypes.c_ulonglong]
DECODE_A, DECODE_B, TRAINER = {DECODE_A}, {DECODE_B}, {TRAINER}

def mark(text):
    with open(os.environ["FAKE_CUDA_LOG"], "a") as log:
        print("python: " + text, file=log)

# 128 bytes per token per layer per K/V: 16384-token chunks of 2 MiB pages, 4 pages each.
alloc = UnifiedAllocator(num_layers=2, kv_heads=2, head_dim=16, dtype_bytes=4, max_tokens=4 * 16384,
                         small_pool_bytes=2 << 20, backend="cuda")
g = alloc.geometry
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


def assert_all_released(lines):
    counts = fake_cuda.exit_counts(lines)
    assert counts == dict(counts, primary_refs=0, live_events=0, live_reserves=0, live_pages=0, mapped=0), lines[-1]


def test_a_lend_polled_while_decode_is_busy_unmaps_only_after_every_stream_finished(driver_dir, tmp_path):
    result, lines = run(driver_dir, tmp_path, """
    default_streams = list(alloc.fence_streams)
    alloc.set_fence_streams([DECODE_A, DECODE_B])
    fake.fake_queue_work(DECODE_A)  # a decode step in flight on each stream
    fake.fake_queue_work(DECODE_B)
    mark("lend")
    lent_now = alloc.lend(2, wait=False)
    state = int(alloc.chunk_table()[2].state)
    not_yet = alloc.finish_lends()
    arena_empty = alloc.arena_allocate(1) is None
    fake.fake_finish_work(DECODE_A)
    mark("A finished")
    still = alloc.finish_lends()
    fake.fake_finish_work(DECODE_B)
    mark("B finished")
    done = alloc.finish_lends()
    block = alloc.arena_allocate(1)
    block.free(streams=[])
    mark("reclaim")
    alloc.reclaim(2)
    alloc.close()
    print(json.dumps({"default": default_streams, "lent_now": lent_now, "state": state, "not_yet": not_yet,
                      "arena_empty": arena_empty, "still": still, "done": done}))
    """)
    assert result["default"] == [0]  # the legacy default stream until the caller names its streams
    assert result["lent_now"] is False and result["state"] == 4  # LENDING
    assert result["not_yet"] == [] and result["arena_empty"] and result["still"] == []
    assert result["done"] == [2]
    waiting = between(lines, "lend", "B finished")
    assert not [line for line in waiting if line.startswith("mem_")]  # nothing unmapped, mapped or waited on
    assert not [line for line in waiting if line.startswith("event_sync")]  # polled, never waited
    a_events, b_events = event_ids(waiting, DECODE_A), event_ids(waiting, DECODE_B)
    assert len(a_events) == len(b_events) == 1
    assert [line for line in waiting if line.startswith("event_query") and line.endswith("ready=0")]
    finishing = between(lines, "B finished", "reclaim")
    first_unmap = next(i for i, line in enumerate(finishing) if line.startswith("mem_unmap"))
    ready = [line for line in finishing[:first_unmap] if line.endswith("ready=1")]
    assert {line.split()[1] for line in ready} == {a_events[0], b_events[0]}
    assert_all_released(lines)


def test_a_blocking_lend_synchronizes_on_the_events_before_it_unmaps(driver_dir, tmp_path):
    _, lines = run(driver_dir, tmp_path, """
    alloc.set_fence_streams([DECODE_A, None])
    fake.fake_queue_work(DECODE_A)
    mark("lend")
    alloc.lend(1)
    mark("lent")
    alloc.reclaim(1)
    alloc.close()
    print(json.dumps({}))
    """)
    lending = between(lines, "lend", "lent")
    syncs = [i for i, line in enumerate(lending) if line.startswith("event_sync")]
    unmaps = [i for i, line in enumerate(lending) if line.startswith("mem_unmap")]
    assert len(syncs) == 2 and unmaps and max(syncs) < min(unmaps)
    assert event_ids(lending, DECODE_A) and event_ids(lending, 0)  # None: the legacy default stream
    assert_all_released(lines)


def test_without_the_decode_stream_registered_the_fake_sees_the_unmap_under_a_running_kernel(driver_dir, tmp_path):
    _, lines = run(driver_dir, tmp_path, """
    alloc.set_fence_streams([])
    fake.fake_queue_work(DECODE_A)  # decode's kernels, but nobody told the allocator
    alloc.lend(1)
    fake.fake_finish_work(DECODE_A)
    alloc.reclaim(1)
    alloc.close()
    print(json.dumps({}))
    """, allow_bad=True)
    bad = [line for line in lines if line.startswith("BAD")]
    assert bad and all(f"while stream {DECODE_A} has 1 unfinished kernels" in line for line in bad)


def test_a_reclaim_waits_for_the_trainer_frees_and_decode_before_any_unmap(driver_dir, tmp_path):
    _, lines = run(driver_dir, tmp_path, """
    alloc.set_fence_streams([DECODE_A])
    alloc.lend(3)
    block = alloc.arena_allocate(g.page_bytes)
    fake.fake_queue_work(TRAINER)  # the trainer's kernels still use the block
    block.free(streams=[TRAINER])
    fake.fake_queue_work(DECODE_A)  # and a decode step is in flight
    mark("reclaim")
    alloc.reclaim(3)
    mark("reclaimed")
    alloc.close()
    print(json.dumps({}))
    """)
    reclaiming = between(lines, "reclaim", "reclaimed")
    first_unmap = next(i for i, line in enumerate(reclaiming) if line.startswith("mem_unmap"))
    synced = [line for line in reclaiming[:first_unmap] if line.startswith("event_sync")]
    assert {line.split()[-1] for line in synced} == {f"stream={TRAINER}", f"stream={DECODE_A}"}
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


def test_the_cuda_backend_makes_the_same_calls_and_the_fake_driver_accepts_each(driver_dir, tmp_path):
    # The fake refuses (BAD, CUDA_ERROR_INVALID_VALUE) a set-access over any unmapped page,
    # a map at a non-zero offset or past its allocation: the KV side's one access call
    # spans the ranges through other chunks' mapped slices, and the arena's dummy run is
    # one allocation of a chunk's pages, mapped over a reclaimed chunk in one call.
    result, lines = run(driver_dir, tmp_path, """
    alloc.set_fence_streams([])
    moves = []
    for move in (alloc.lend, alloc.reclaim, alloc.lend, alloc.reclaim):
        before = alloc.counters()
        mark(move.__name__)
        move(1)
        moves.append(alloc.counters().minus(before).mapping_calls)
    mark("done")
    alloc.close()
    print(json.dumps({"moves": moves, "pages": g.pages_per_chunk, "page": g.page_bytes, "chunk": g.chunk_bytes,
                      "range": g.kv_range_bytes}))
    """)
    pages = result["pages"]
    assert result["moves"] == [3 * pages + 2, 2 * pages + 4, 3 * pages + 3, 2 * pages + 4]
    lending = between(lines, "lend", "reclaim")
    access = [line for line in lending if line.startswith("mem_set_access")]
    kv_span = (pages - 1) * result["range"] + result["page"]  # chunk 1 of range 0 to chunk 1 of the last
    assert [int(line.split("bytes=")[1]) for line in access] == [kv_span, result["chunk"]]
    reclaiming = between(lines, "reclaim", "done")
    assert any(line.startswith("mem_map") and f"bytes={result['chunk']} " in line for line in reclaiming)
    assert_all_released(lines)
