"""The measured cost of lending (harvest.memory.lend_timing): lends and reclaims of single
chunks of the served geometry through the allocator, under a decode-like load, as a
profile's memory section; the same code path on the host backend as on a GPU."""

from __future__ import annotations

import math
import threading
import time

import pytest

from harvest.memory import UnifiedAllocator, VmmNoDriver
from harvest.memory.lend_timing import KvShape, LendTimingError, _rounds, measure
from harvest.predict.schema import MemorySection

TINY = KvShape(num_layers=2, kv_heads=2, head_dim=16, dtype_bytes=4)


@pytest.mark.parametrize("load", [True, False])
def test_a_measurement_times_single_chunk_lends_and_reclaims_of_the_geometry(load):
    timing = measure(TINY, page_bytes=64 * 1024, rounds=8, load=load)
    assert timing.backend == "host" and timing.rounds == 8
    assert timing.pages_per_chunk == 4 and timing.page_bytes == 64 * 1024 and timing.chunk_bytes == 4 * 64 * 1024
    assert timing.tokens_per_chunk == 64 * 1024 // (2 * 16 * 4)
    for value in (timing.lend_ms_per_chunk, timing.reclaim_ms_per_chunk):
        assert math.isfinite(value) and 0 < value < 1000
    assert timing.lend_ms_per_page == pytest.approx(timing.lend_ms_per_chunk / 4)
    if load:  # the load runs from before the first timed call to after the last
        assert timing.busy_fraction == 1.0 and timing.load_passes >= 1
    else:
        assert timing.busy_fraction == 0.0 and timing.load_passes == 0
    section = MemorySection(**timing.section_fields())  # what `harvest profile` writes
    assert section.ms_per_page(section.reclaim_ms_per_chunk) == pytest.approx(timing.reclaim_ms_per_page)
    assert "per chunk of 0.25 MiB (4 pages of 64 KiB" in timing.describe()


def test_a_lend_waiting_for_its_fences_is_finished_as_the_lending_controller_does_and_timed_whole():
    alloc = UnifiedAllocator(num_layers=2, kv_heads=2, head_dim=16, dtype_bytes=4, max_tokens=4 * 1024, page_bytes=64 * 1024)
    try:
        alloc.set_fence_streams([7])
        alloc.hold_fences(True)  # decode's queued work has not passed yet

        def pass_fences_50_ms_into_the_lend():  # counted from when the lend waits, however late this thread runs
            while 2 not in alloc.lending_chunks():
                time.sleep(0.001)
            time.sleep(0.05)
            alloc.hold_fences(False)

        releaser = threading.Thread(target=pass_fences_50_ms_into_the_lend, daemon=True)
        releaser.start()
        lend_ms, _, loaded = _rounds(alloc, [2], 1, lambda: True)
        releaser.join()
        assert lend_ms[0] >= 50 and loaded == [True]
        assert 2 in alloc.lendable_chunks()  # back with decode
        alloc.check_integrity()
    finally:
        alloc.close()


def test_the_kv_shape_is_one_ranks_of_the_models_config():
    config = {"num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 8, "hidden_size": 4096}
    assert KvShape.of_model(config, 2) == KvShape(32, 8, 128, 2)
    assert KvShape.of_model(config, 2, tp_size=4) == KvShape(32, 2, 128, 2)
    assert KvShape.of_model(config, 2, tp_size=16).kv_heads == 1  # SGLang replicates: at least one per rank
    assert KvShape.of_model({**config, "head_dim": 64}, 4).head_dim == 64
    with pytest.raises(LendTimingError, match="latent attention"):
        KvShape.of_model({**config, "kv_lora_rank": 512}, 2)
    with pytest.raises(LendTimingError, match="lacks the KV layout"):
        KvShape.of_model({"num_attention_heads": 8}, 2)
    with pytest.raises(LendTimingError, match="num_layers=0"):
        KvShape(0, 1, 1, 1)


def test_the_profilers_memory_section_is_the_served_geometrys(tiny_llama_path, capsys):
    from harvest.predict.profiler.session import lend_costs_section

    section = lend_costs_section(str(tiny_llama_path), "cpu", "float32", 1)
    # the tiny model: 2 layers, 2 KV heads of 16 dims in float32; SGLang's 64 KiB host pages
    assert section.chunk_bytes == 2 * 2 * 64 * 1024 and section.pages_per_chunk == 4
    assert section.reclaim_ms_per_chunk > 0 and section.lend_ms_per_chunk > 0
    assert capsys.readouterr().out.startswith("lend/reclaim under decode-like load: a lend ")


def test_a_measurement_that_cannot_be_made_leaves_the_section_out_with_a_warning(tiny_llama_path, capsys, monkeypatch):
    from harvest.predict.profiler import session

    def no_driver(*args, **kwargs):
        raise VmmNoDriver("libcuda.so.1 not found", 3)

    monkeypatch.setattr("harvest.memory.lend_timing.measure", no_driver)
    assert session.lend_costs_section(str(tiny_llama_path), "cpu", "float32", 1) is None
    err = capsys.readouterr().err
    assert err.startswith("harvest profile: warning: lend/reclaim not timed (libcuda.so.1 not found")
    assert "the profile has no memory section" in err


@pytest.mark.gpu
def test_on_a_gpu_lends_and_reclaims_are_timed_under_decode_like_kernels():
    # Llama-3-8B's per-layer KV shape with 4 layers: 2 MiB pages, 8 per chunk
    timing = measure(KvShape(num_layers=4, kv_heads=8, head_dim=128, dtype_bytes=2), backend="cuda", rounds=8)
    assert timing.backend == "cuda" and timing.pages_per_chunk == 8 and timing.chunk_bytes == 8 * timing.page_bytes
    assert 0 < timing.lend_ms_per_chunk < 1000 and 0 < timing.reclaim_ms_per_chunk < 1000
    assert timing.load_passes >= 1 and timing.busy_fraction > 0.5, timing
