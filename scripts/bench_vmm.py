#!/usr/bin/env python3
"""Benchmark of the unified allocator (libharvest_vmm through harvest.memory).

    python scripts/bench_vmm.py --json [--backend host|cuda] [--fuzz-ops 100000] [--num-layers 4]

The last stdout line is one JSON object. What each figure measures:

  map_calls_per_lend, unmap_calls_per_lend, access_calls_per_lend
      Backend calls (counted inside the library, the same on the host and the CUDA
      backend) to lend ONE chunk (its first lend) of a Llama-like geometry (2 MiB pages,
      8 pages per chunk): one map per page into the general arena, then one access call
      over the chunk's arena run. The KV side makes none: a lent chunk's pages stay at
      their KV slices (docs/design.md §1). access_calls_per_lend_of_4 is the same for 4
      adjacent chunks lent as one batch (still one). --num-layers sets the layers of this
      geometry (default 4; 32 is Llama-3-8B's full KV geometry: 64 pages per chunk).
  map_calls_per_reclaim, unmap_calls_per_reclaim, access_calls_per_reclaim
      The same for reclaiming that chunk: one unmap of its arena run, one map of the
      arena's dummy run over it (one allocation of a chunk's pages), one access call.
  driver_calls_per_lend, driver_calls_per_reclaim, driver_calls_per_lend_again
      Their sums (map + unmap + set-access; the fence calls, an event record and wait per
      fenced stream, are not counted): P + 1 and 3 for a chunk of P pages. _again: the
      chunk lent a second time, which first unmaps the arena's dummy run from its arena
      slots (one call more). A lend cannot make fewer than one map per page with one
      physical allocation per page: cuMemMap maps an allocation from offset 0 only.
  create_calls_after_init
      cuMemCreate-equivalent calls after start-up, summed over every allocator this
      run made (all the work below included). Must be 0.
  lend_us_median, reclaim_us_median
      Wall time of one lend / reclaim of one chunk (median of 50).
  lend_us_median_large_pool, reclaim_us_median_large_pool, large_pool_chunks
      CUDA only (null on host, whose pages are RAM): the same with a pool of 96 chunks
      (12 GiB with --num-layers 32) instead of 12 (median of 20): whether a move's cost
      grows with the memory mapped around it (it touches only the chunk's arena run).
  under_load_*
      Lend/reclaim while decode-like kernels read the KV cache, as a serving engine does
      it: reductions over every layer's K and V slices of the chunks that stay with decode
      (8 of 12), back to back from a thread (on CUDA on a side stream, registered as the
      allocator's KV fence stream, fed as fast as its launch queue takes them), while
      chunks 8-11 are lent and reclaimed (50 rounds). A lend is started without waiting
      (``lend(wait=False)``) and completed by ``finish_lends`` once the work queued on
      the fence stream before it has passed, as harvest's lending controller does.
      under_load_lend_call_us_median: the non-blocking lend call;
      under_load_lend_done_us_median: from that call until the chunks are lent;
      under_load_reclaim_us_median: reclaim (it waits for the fences itself);
      under_load_busy_fraction: share of the calls that began and ended with the kernels
      still running (1.0: every call was made under load); under_load_passes: reductions
      completed; under_load_fault: the error the reads raised, else null;
      under_load_checksum_ok: every reduction read the values decode wrote.
  small_alloc_free_ns_median, small_vs_malloc_ratio
      Timed in C++ (hvmm_bench_small_pool): one random sequence of 200,000 allocations
      and frees (sizes log-uniform in [512 B, 256 KiB], up to 256 live), replayed on the
      small pool and on glibc malloc/free alternately, 9 repetitions; ns per alloc+free
      pair, median; ratio = pool median / malloc median. The *_tiny figures do the
      same for [64 B, 16 KiB] (glibc's fast bins and tcache), *_large for
      [256 KiB, 2 MiB) with up to 32 live (glibc's mmap threshold region).
  fuzz_ops, fuzz_violations
      harvest.memory.fuzz: random operations with check_integrity and an independent
      model check after every one (tiny geometry; host backend writes tag bytes too).
  fragmentation_bytes
      Peak over a trainer-like trace of "free pages of lent chunks that are partly
      used": 10 lent chunks; a window of 3 layers of frozen weights (13 pages each) is
      slid over 200 units with 2 activation tensors of 1-4 pages per unit, and decode
      takes back and re-lends an idle chunk every 25 units. fragmentation_bytes_median
      is the median over the trace.
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import json
import os
import random
import statistics
import sys
import time

# Before CUDA starts: harvest's streams (two per green-context level) need more hardware
# queues than the driver's default 8; 32 is the maximum (harvest.compute.device).
os.environ.setdefault("CUDA_DEVICE_MAX_CONNECTIONS", "32")

MIB = 1 << 20


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--json", action="store_true", help="print only the summary line (still last)")
    parser.add_argument("--backend", choices=("host", "cuda"), default="host")
    parser.add_argument("--fuzz-ops", type=int, default=100_000)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--num-layers", type=int, default=4,
                        help="layers of the lend/reclaim geometry (32: Llama-3-8B's; default 4)")
    parser.add_argument("--out", default=None,
                        help="also write the result here after every measurement (\"complete\": false until the end)")
    args = parser.parse_args(argv)
    if args.num_layers < 1:
        parser.error(f"--num-layers={args.num_layers} must be at least 1")
    if args.fuzz_ops < 1:
        parser.error(f"--fuzz-ops={args.fuzz_ops} must be at least 1")
    return args


def llama_like(backend: str, chunks: int, small_pool_bytes: int, num_layers: int = 4):
    from harvest.memory import UnifiedAllocator

    # 8 KV heads x 128 x 2 bytes (Llama-3-8B per layer) with 4 layers: 1024 tokens and
    # 8 pages of 2 MiB per chunk, small enough to run on a CPU machine's RAM.
    return UnifiedAllocator(num_layers=num_layers, kv_heads=8, head_dim=128, dtype_bytes=2, max_tokens=chunks * 1024,
                            small_pool_bytes=small_pool_bytes, backend=backend)


def measure_lend(backend: str, num_layers: int = 4) -> dict:
    alloc = llama_like(backend, chunks=12, small_pool_bytes=0, num_layers=num_layers)
    g = alloc.geometry
    before = alloc.counters()
    alloc.lend(5)
    lend = alloc.counters().minus(before)
    before = alloc.counters()
    alloc.reclaim(5)
    reclaim = alloc.counters().minus(before)
    before = alloc.counters()
    alloc.lend(5)
    again = alloc.counters().minus(before)
    alloc.reclaim(5)
    before = alloc.counters()
    alloc.lend([6, 7, 8, 9])
    batch = alloc.counters().minus(before)
    alloc.reclaim([6, 7, 8, 9])
    lend_us, reclaim_us = [], []
    for _ in range(50):
        t0 = time.perf_counter()
        alloc.lend(3)
        t1 = time.perf_counter()
        alloc.reclaim(3)
        t2 = time.perf_counter()
        lend_us.append((t1 - t0) * 1e6)
        reclaim_us.append((t2 - t1) * 1e6)
    alloc.check_integrity()
    large = _time_lend_reclaim(backend, num_layers, chunks=96, rounds=20) if backend == "cuda" else (None, None, 0)
    result = {
        "num_layers": num_layers,
        "page_bytes": g.page_bytes,
        "pages_per_chunk": g.pages_per_chunk,
        "map_calls_per_lend": lend.map,
        "unmap_calls_per_lend": lend.unmap,
        "access_calls_per_lend": lend.set_access,
        "access_calls_per_lend_of_4": batch.set_access,
        "map_calls_per_reclaim": reclaim.map,
        "unmap_calls_per_reclaim": reclaim.unmap,
        "access_calls_per_reclaim": reclaim.set_access,
        "driver_calls_per_lend": lend.mapping_calls,
        "driver_calls_per_reclaim": reclaim.mapping_calls,
        "driver_calls_per_lend_again": again.mapping_calls,
        "lend_us_median": round(statistics.median(lend_us), 1),
        "reclaim_us_median": round(statistics.median(reclaim_us), 1),
        "lend_us_median_large_pool": large[0],
        "reclaim_us_median_large_pool": large[1],
        "large_pool_chunks": 96 if backend == "cuda" else None,
    }
    creates = alloc.counters().create_calls_after_init + large[2]
    alloc.close()
    return result, creates


def _time_lend_reclaim(backend: str, num_layers: int, chunks: int, rounds: int) -> tuple[float, float, int]:
    """Median µs of a lend and of a reclaim of one chunk in the middle of a pool of `chunks`,
    and the allocator's create calls after init."""
    alloc = llama_like(backend, chunks=chunks, small_pool_bytes=0, num_layers=num_layers)
    chunk = chunks // 2
    lend_us, reclaim_us = [], []
    for _ in range(rounds):
        t0 = time.perf_counter()
        alloc.lend(chunk)
        t1 = time.perf_counter()
        alloc.reclaim(chunk)
        lend_us.append((t1 - t0) * 1e6)
        reclaim_us.append((time.perf_counter() - t1) * 1e6)
    alloc.check_integrity()
    creates = alloc.counters().create_calls_after_init
    alloc.close()
    return round(statistics.median(lend_us), 1), round(statistics.median(reclaim_us), 1), creates


def measure_lend_under_load(backend: str, num_layers: int = 4, rounds: int = 50) -> tuple[dict, int]:
    import threading

    import torch

    alloc = llama_like(backend, chunks=12, small_pool_bytes=0, num_layers=num_layers)
    g = alloc.geometry
    owned = 8 * g.page_bytes // 4  # float32 elements of chunks 0-7 in one K or V range
    slices = [alloc.kv_tensor(layer, kind, torch.float32)[:owned] for layer in range(num_layers) for kind in ("k", "v")]
    for layer_slice in slices:
        layer_slice.fill_(1.0)
    del layer_slice
    expected = float(owned * len(slices))
    on_cuda = backend == "cuda"
    stream = torch.cuda.Stream() if on_cuda else None
    if on_cuda:
        torch.cuda.synchronize()
    sums: list = []
    stop, started = threading.Event(), threading.Event()
    errors: list[str] = []

    def one_pass():
        total = torch.zeros((), dtype=torch.float64, device=slices[0].device)
        for view in slices:
            total += view.sum(dtype=torch.float64)
        sums.append(total)

    def decode():  # a decode-like loop: on CUDA it enqueues on a side stream as fast as the launch queue takes
        try:
            with torch.cuda.stream(stream) if on_cuda else contextlib.nullcontext():
                while not stop.is_set():
                    one_pass()
                    started.set()
        except Exception as exc:  # noqa: BLE001 - a fault on the side stream, reported below
            errors.append(f"{type(exc).__name__}: {exc}")
            started.set()

    thread = threading.Thread(target=decode, daemon=True)
    thread.start()
    started.wait(60)

    def under_load() -> bool:
        return thread.is_alive() and (not on_cuda or not stream.query())

    if on_cuda:
        alloc.set_fence_streams([stream])  # the decode stream: lends wait for its queued work
    chunks = [8, 9, 10, 11]
    call_us, lend_us, reclaim_us, loaded = [], [], [], []
    try:
        for _ in range(rounds):
            was_loaded = under_load()
            t0 = time.perf_counter()
            done = alloc.lend(chunks, wait=False)
            call_us.append((time.perf_counter() - t0) * 1e6)
            lent = set(chunks) if done else set()
            deadline = t0 + 30
            while lent != set(chunks) and time.perf_counter() < deadline:
                lent.update(alloc.finish_lends())
                time.sleep(0)
            if lent != set(chunks):
                raise RuntimeError(f"lend of {chunks} not finished after 30 s")
            lend_us.append((time.perf_counter() - t0) * 1e6)
            loaded.append(was_loaded and under_load())
            was_loaded = under_load()
            t0 = time.perf_counter()
            alloc.reclaim(chunks)
            reclaim_us.append((time.perf_counter() - t0) * 1e6)
            loaded.append(was_loaded and under_load())
    finally:
        stop.set()
        thread.join()
    try:
        if on_cuda:
            stream.synchronize()  # an illegal address on the side stream surfaces here
        values = [float(total) for total in sums]
    except RuntimeError as exc:
        errors.append(f"{type(exc).__name__}: {exc}")
        values = []
    fault = "; ".join(errors) or None
    alloc.check_integrity()
    result = {
        "under_load_lend_call_us_median": round(statistics.median(call_us), 1),
        "under_load_lend_done_us_median": round(statistics.median(lend_us), 1),
        "under_load_reclaim_us_median": round(statistics.median(reclaim_us), 1),
        "under_load_chunks_per_call": 4,
        "under_load_busy_fraction": round(sum(loaded) / len(loaded), 3),
        "under_load_passes": len(values),
        "under_load_fault": fault,
        "under_load_checksum_ok": fault is None and bool(values) and all(v == expected for v in values),
    }
    del slices, sums
    creates = alloc.counters().create_calls_after_init
    alloc.close()
    return result, creates


def measure_small_pool(backend: str, seed: int) -> tuple[dict, int]:
    from harvest.memory import _lib

    alloc = llama_like(backend, chunks=1, small_pool_bytes=160 * MIB)
    runs = {}
    for name, (low, high, live) in {
        "": (512, 256 << 10, 256),
        "_tiny": (64, 16 << 10, 256),
        "_large": (256 << 10, 2 * MIB - 1, 32),
    }.items():
        out = _lib.SmallBench()
        _lib.check(_lib.lib().bench_small_pool(alloc._h(), seed, 200_000, live, low, high, 9, ctypes.byref(out)))
        runs[f"small_alloc_free_ns_median{name}"] = round(out.pool_ns_per_pair_median, 1)
        runs[f"malloc_free_ns_median{name}"] = round(out.malloc_ns_per_pair_median, 1)
        runs[f"small_vs_malloc_ratio{name}"] = round(out.pool_ns_per_pair_median / out.malloc_ns_per_pair_median, 3)
    alloc.check_integrity()
    creates = alloc.counters().create_calls_after_init
    alloc.close()
    return runs, creates


def measure_fuzz(backend: str, ops: int, seed: int) -> tuple[dict, int]:
    from harvest.memory import UnifiedAllocator
    from harvest.memory.fuzz import run_fuzz

    if backend == "host":
        alloc = UnifiedAllocator(num_layers=2, kv_heads=2, head_dim=16, dtype_bytes=4, max_tokens=1024,
                                 small_pool_bytes=64 << 10, page_bytes=16 << 10)
    else:  # the device granularity: 2 MiB pages, 16384 tokens per chunk
        alloc = UnifiedAllocator(num_layers=2, kv_heads=2, head_dim=16, dtype_bytes=4, max_tokens=8 * 16384,
                                 small_pool_bytes=8 * MIB, backend="cuda")
    progress = _progress(ops)
    started = time.perf_counter()
    report = run_fuzz(alloc, ops=ops, seed=seed, progress=progress.update if progress else None)
    seconds = time.perf_counter() - started
    if progress:
        progress.close()
    creates = alloc.counters().create_calls_after_init
    alloc.close()
    result = {
        "fuzz_ops": report.ops,
        "fuzz_violations": report.violations,
        "fuzz_seconds": round(seconds, 1),
        "fuzz_leak_free": report.leak_free_at_end,
    }
    if report.first_violation:
        result["fuzz_first_violation"] = report.first_violation
    return result, creates


def _progress(total: int):
    try:
        from tqdm import tqdm
    except ImportError:
        return None
    return tqdm(total=total, desc="fuzz", unit="op", file=sys.stderr, disable=not sys.stderr.isatty())


def measure_fragmentation(backend: str, seed: int) -> tuple[dict, int]:
    alloc = llama_like(backend, chunks=12, small_pool_bytes=0)
    g = alloc.geometry
    rng = random.Random(seed)
    alloc.lend(list(range(2, 12)))
    layer_bytes = 13 * g.page_bytes
    window: list = []
    activations: list = []
    samples: list[int] = []
    reclaimed: int | None = None
    failed = 0
    for unit in range(200):
        if len(window) == 3:
            window.pop(0).free()
        block = alloc.arena_allocate(layer_bytes)
        if block is None:
            failed += 1
        else:
            window.append(block)
        for block in activations:
            block.free()
        activations = [b for b in (alloc.arena_allocate(rng.randint(1, 4) * g.page_bytes) for _ in range(2)) if b]
        if unit % 25 == 24:
            if reclaimed is None:
                idle = alloc.reclaimable_chunks()
                if idle:
                    reclaimed = idle[-1]
                    alloc.reclaim(reclaimed)
            else:
                alloc.lend(reclaimed)
                reclaimed = None
        samples.append(alloc.stats().fragmentation_bytes)
    for block in window + activations:
        block.free()
    alloc.check_integrity()
    creates = alloc.counters().create_calls_after_init
    alloc.close()
    return {
        "fragmentation_bytes": max(samples),
        "fragmentation_bytes_median": int(statistics.median(samples)),
        "fragmentation_trace_alloc_failures": failed,
    }, creates


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.backend == "cuda":
        from harvest.compute import device

        gpus, reason, _ = device.probe_gpus()
        if not gpus:
            print(f"bench_vmm: --backend cuda needs an NVIDIA GPU: {reason}", file=sys.stderr)
            return 2
    result: dict = {"backend": args.backend, "complete": False}
    creates = 0
    measurements = [
        ("lend/reclaim call counts", lambda: measure_lend(args.backend, args.num_layers)),
        ("lend/reclaim under decode kernels", lambda: measure_lend_under_load(args.backend, args.num_layers)),
        ("small pool vs malloc", lambda: measure_small_pool(args.backend, args.seed)),
        ("fragmentation trace", lambda: measure_fragmentation(args.backend, args.seed)),
        ("fuzz", lambda: measure_fuzz(args.backend, args.fuzz_ops, args.seed)),
    ]
    for name, measure in measurements:
        part, made = measure()
        creates += made
        result.update(part)
        if args.backend == "cuda" and "device" not in result:
            import torch

            result["device"] = torch.cuda.get_device_name()
        _write(args.out, result)  # what is measured survives a timeout
        if not args.json:
            print(f"{name}: {json.dumps(part)}")
    result["create_calls_after_init"] = creates
    result["complete"] = True
    _write(args.out, result)
    print(json.dumps(result))
    ok = result["fuzz_violations"] == 0 and creates == 0 and result["under_load_fault"] is None
    return 0 if ok and result["under_load_checksum_ok"] else 1


def _write(path, result: dict) -> None:
    if path is None:
        return
    tmp = f"{path}.tmp"
    with open(tmp, "w") as f:
        json.dump(result, f, indent=1)
    os.replace(tmp, path)


if __name__ == "__main__":
    sys.exit(main())
