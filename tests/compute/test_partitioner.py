"""The Partitioner interface, the whole-device fallback and the factory's choice, on CPU.

The green-context path is driven here with fakes in place of the driver (device query,
dry-run split, ladder creation) to check its decisions; the real thing runs in
test_greenctx_gpu.py.
"""

from __future__ import annotations

import dataclasses
import itertools
import logging
import tracemalloc

import pytest

from harvest.compute import factory, green_partitioner, greenctx_lib
from harvest.compute.greenctx_lib import DeviceProperties, GreenContextError, GreenContextsUnavailable
from harvest.compute.ladder_planning import plan_ladder
from harvest.compute.partitioner import BasePartitioner, WholeDevicePartitioner, _parse_device
from harvest.ladder import GREEN_CONTEXTS, Ladder, LadderError, Level
from tests.conftest import gpu_unavailable_reason

NO_GPU = gpu_unavailable_reason() is not None


class LadderOfFakeLevels(BasePartitioner):
    """A spatial ladder without a device, to exercise the base class alone."""

    description = "fake"

    def __init__(self, plan):
        self.released = 0
        levels = tuple(
            Level(lv.decode_sms, lv.trainer_sms, f"d{i}", f"t{i}" if lv.trainer_sms else None)
            for i, lv in enumerate(plan.levels)
        )
        super().__init__(dataclasses.replace(plan, levels=levels))

    def _release(self):
        self.released += 1


@pytest.fixture
def harvest_warnings():
    """Records what harvest logs (its logger does not propagate to pytest's caplog)."""
    records: list[logging.LogRecord] = []
    handler = logging.Handler(level=logging.WARNING)
    handler.emit = records.append
    logger = logging.getLogger("harvest")
    logger.addHandler(handler)
    yield records
    logger.removeHandler(handler)


def test_cpu_partitioner_is_one_honest_shared_level():
    with WholeDevicePartitioner("cpu") as partitioner:
        assert not partitioner.spatial
        assert "no spatial partitioning" in partitioner.description
        ladder = partitioner.ladder
        (level,) = ladder.levels
        assert not ladder.spatial and level.decode_stream is None and level.trainer_stream is None
        assert level.decode_sms == level.trainer_sms == ladder.total_sms
        assert ladder.decode_fraction(0) == ladder.trainer_fraction(0) == 1.0
        assert partitioner.current is level and ladder.whole_device_index == 0 and partitioner.current_index == 0
        assert partitioner.select(0) is level
    assert partitioner.closed
    with pytest.raises(RuntimeError, match="closed"):
        partitioner.select(0)
    partitioner.close()  # idempotent


def test_select_is_constant_time_lookup_with_range_check():
    partitioner = LadderOfFakeLevels(plan_ladder(132, (9, 0), 8))
    levels = partitioner.ladder.levels
    assert partitioner.spatial and partitioner.current is levels[-1]  # starts with decode on the whole device
    assert partitioner.current_index == partitioner.ladder.whole_device_index == 7
    for index, level in enumerate(levels):
        assert partitioner.select(index) is level and partitioner.current is level
        assert partitioner.current_index == index and level.decode_stream == f"d{index}"
    last = levels[-1]
    assert (last.decode_sms, last.trainer_sms, last.trainer_stream) == (132, 0, None)
    assert partitioner.ladder.decode_fraction(0) == pytest.approx(16 / 132)
    for bad in (-1, 8, 100):
        with pytest.raises(IndexError, match=f"level index {bad} out of range"):
            partitioner.select(bad)
    partitioner.close()
    partitioner.close()
    assert partitioner.released == 1


def _peak_bytes_of_loop(fn, indices) -> int:
    tracemalloc.start()
    try:
        before, _ = tracemalloc.get_traced_memory()
        tracemalloc.reset_peak()
        for _ in itertools.repeat(None, 2000):
            for index in indices:
                fn(index)
        after, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert after == before, "the loop leaked"
    return peak - before


def test_select_allocates_nothing():
    """16,000 selections peak at exactly the memory of the same loop calling a function
    that allocates nothing (the loop's own iterators). A per-call allocation that reaches
    the allocator would show (objects CPython serves from free lists would not)."""
    partitioner = LadderOfFakeLevels(plan_ladder(132, (9, 0), 8))
    indices = tuple(range(partitioner.ladder.num_levels))

    def baseline(index):
        return index

    for fn in (baseline, partitioner.select):  # warm up any lazy interpreter state
        _peak_bytes_of_loop(fn, indices)
    assert _peak_bytes_of_loop(partitioner.select, indices) <= _peak_bytes_of_loop(baseline, indices)


@pytest.mark.parametrize(
    "device, expected",
    [("cpu", ("cpu", 0)), ("cuda", ("cuda", 0)), ("cuda:3", ("cuda", 3)), (2, ("cuda", 2))],
)
def test_device_parsing(device, expected):
    assert _parse_device(device) == expected


@pytest.mark.parametrize("device", ["cuda:x", "tpu", "cpu:1", -1, "cuda:-1"])
def test_bad_device_is_refused(device):
    with pytest.raises(ValueError, match="device="):
        _parse_device(device)


def test_factory_on_cpu_device_is_whole_device_without_a_warning(harvest_warnings):
    partitioner = factory.create_partitioner("cpu")
    assert isinstance(partitioner, WholeDevicePartitioner) and partitioner.reason == "CPU device"
    assert harvest_warnings == []


@pytest.mark.skipif(not NO_GPU, reason="a GPU is present")
def test_factory_without_a_driver_falls_back_and_says_why(harvest_warnings):
    partitioner = factory.create_partitioner("cuda:0")
    assert isinstance(partitioner, WholeDevicePartitioner) and not partitioner.spatial
    assert "no driver" in partitioner.reason and "libcuda.so.1" in partitioner.reason
    (record,) = harvest_warnings
    message = record.getMessage()
    assert "using WholeDevicePartitioner" in message and "no driver" in message


def fake_device(**overrides) -> DeviceProperties:
    fields = dict(
        ordinal=0,
        name="Fake H100",
        driver_version=12080,
        sm_count=132,
        compute_capability=(9, 0),
        total_memory_bytes=80 << 30,
        green_contexts_supported=True,
        min_sm_partition_size=0,
        sm_coscheduled_alignment=0,
    )
    fields.update(overrides)
    return DeviceProperties(**fields)


def exact_split(ordinal, decode_sms):
    return decode_sms, 132 - decode_sms


def provisioned(decode_sms) -> Ladder:
    """What LadderHandle.ladder holds for a 132-SM device: raw stream handles per level."""
    levels = (Level(d, 132 - d, 0x1000 + d, 0x2000 + d if d < 132 else None) for d in decode_sms)
    return Ladder(132, tuple(levels), GREEN_CONTEXTS)


@pytest.mark.parametrize(
    "device, levels, reason",
    [
        (fake_device(driver_version=12020, green_contexts_supported=False), 6,
         "CUDA driver 12.2 is too old: green contexts need a CUDA driver >= 12.4"),
        (fake_device(driver_version=12080, green_contexts_supported=False), 6,
         "lacks the green-context entry points"),
        (fake_device(), [200], "more SMs than the device's 132"),
        (fake_device(), [4], "minimum partition of 8"),
        (fake_device(), [], "levels is empty"),
        (fake_device(sm_count=12), 6, "no partial level fits 12 SMs"),
        (fake_device(compute_capability=(5, 0)), 6, "compute capability 6.0"),
    ],
)
def test_factory_falls_back_on_every_refusal_naming_it(monkeypatch, harvest_warnings, device, levels, reason):
    monkeypatch.setattr(greenctx_lib, "query_device", lambda ordinal: device)
    monkeypatch.setattr(greenctx_lib, "split_preview", exact_split)
    partitioner = factory.create_partitioner("cuda:0", levels=levels)
    assert isinstance(partitioner, WholeDevicePartitioner)
    assert reason in partitioner.reason
    assert len(harvest_warnings) == 1 and reason in harvest_warnings[0].getMessage()


def test_factory_falls_back_when_the_driver_refuses_the_ladder(monkeypatch, harvest_warnings):
    def refuse(ordinal, decode_sms):
        raise GreenContextError(
            "hgc_ladder_create", greenctx_lib.HGC_ERR_DRIVER, "cuGreenCtxCreate(...) failed: CUDA_ERROR_OUT_OF_MEMORY"
        )

    monkeypatch.setattr(greenctx_lib, "query_device", lambda ordinal: fake_device())
    monkeypatch.setattr(greenctx_lib, "split_preview", exact_split)
    monkeypatch.setattr(greenctx_lib, "LadderHandle", refuse)
    partitioner = factory.create_partitioner(0)
    assert "CUDA_ERROR_OUT_OF_MEMORY" in partitioner.reason


def test_a_failure_after_the_ladder_is_built_releases_it(monkeypatch):
    class RecordingLadder:
        closed = 0

        def __init__(self, ordinal, decode_sms):
            self.green_stream_api = True
            self.ladder = provisioned(decode_sms)

        def close(self):
            RecordingLadder.closed += 1

    def no_streams(*args, **kwargs):
        raise RuntimeError("ExternalStream refused (CPU build of torch)")

    import torch

    monkeypatch.setattr(greenctx_lib, "query_device", lambda ordinal: fake_device())
    monkeypatch.setattr(greenctx_lib, "split_preview", exact_split)
    monkeypatch.setattr(greenctx_lib, "LadderHandle", RecordingLadder)
    monkeypatch.setattr(torch.cuda, "ExternalStream", no_streams)
    with pytest.raises(RuntimeError, match="ExternalStream refused"):
        green_partitioner.GreenContextPartitioner(0, levels=4)
    assert RecordingLadder.closed == 1


def test_green_partitioner_builds_levels_from_what_the_driver_provisioned(monkeypatch):
    class FakeLadder:
        def __init__(self, ordinal, decode_sms):
            self.requested = list(decode_sms)
            self.green_stream_api = False
            self.ladder = provisioned(decode_sms)
            self.closed = 0

        def close(self):
            self.closed += 1

    import torch

    monkeypatch.setattr(greenctx_lib, "query_device", lambda ordinal: fake_device())
    monkeypatch.setattr(greenctx_lib, "split_preview", exact_split)
    monkeypatch.setattr(greenctx_lib, "LadderHandle", FakeLadder)
    monkeypatch.setattr(torch.cuda, "ExternalStream", lambda handle, device: ("stream", handle, str(device)))
    partitioner = factory.create_partitioner("cuda:0", levels=4)
    assert isinstance(partitioner, green_partitioner.GreenContextPartitioner) and partitioner.spatial
    assert partitioner._native.requested == [32, 64, 96, 132]
    ladder = partitioner.ladder
    assert [(lv.decode_sms, lv.trainer_sms) for lv in ladder.levels] == [(32, 100), (64, 68), (96, 36), (132, 0)]
    assert ladder.levels[1].decode_stream == ("stream", 0x1000 + 64, "cuda:0")
    assert ladder.levels[1].trainer_stream == ("stream", 0x2000 + 64, "cuda:0")
    assert ladder.levels[-1].trainer_stream is None
    assert ladder.constraints is not None and ladder.realisation == GREEN_CONTEXTS
    assert ladder.whole_device_index == 3 and not partitioner.green_stream_api
    assert "Fake H100" in partitioner.description
    partitioner.close()
    partitioner.close()
    assert partitioner._native.closed == 1


def test_preview_uses_the_driver_counts_and_drops_collapsed_levels(monkeypatch):
    # A driver that rounds requests up to multiples of 16: 40 -> 48 and 48 -> 48 collapse,
    # and 120 -> 128 leaves the trainer 4 SMs.
    def rounding_split(ordinal, decode_sms):
        decode = -(-decode_sms // 16) * 16
        return decode, 132 - decode

    monkeypatch.setattr(greenctx_lib, "split_preview", rounding_split)
    planned = plan_ladder(132, (9, 0), [16, 40, 48, 120])
    realised, requested, notes = green_partitioner.preview_ladder(0, planned)
    assert [(lv.decode_sms, lv.trainer_sms) for lv in realised.levels] == [(16, 116), (48, 84), (132, 0)]
    assert realised.constraints == planned.constraints
    assert requested == (16, 40, 132)
    notes = " | ".join(notes)
    assert "level 40: the driver gives 48/84" in notes
    assert "level 48 dropped: same SMs as the level below" in notes
    assert "level 120 dropped: leaves the trainer 4 SMs (< 8)" in notes


def test_preview_refuses_when_nothing_is_left(monkeypatch):
    monkeypatch.setattr(greenctx_lib, "split_preview", lambda ordinal, d: (128, 4))
    with pytest.raises(LadderError, match="no planned level is realisable on device 0"):
        green_partitioner.preview_ladder(0, plan_ladder(132, (9, 0), [64]))


def test_ladder_report_shows_what_would_be_built(monkeypatch):
    assert factory.ladder_report("cpu")["partitioner"] == "WholeDevicePartitioner"
    monkeypatch.setattr(greenctx_lib, "query_device", lambda ordinal: fake_device(min_sm_partition_size=8, sm_coscheduled_alignment=8))
    monkeypatch.setattr(greenctx_lib, "split_preview", exact_split)
    report = factory.ladder_report("cuda:0", levels=3)
    assert report["partitioner"] == "GreenContextPartitioner" and report["spatial"]
    assert [lv["decode_sms"] for lv in report["levels"]] == [48, 88, 132]  # 44 -> 48: ties favour decode
    assert report["constraints"]["source"].startswith("driver")

    def no_driver(ordinal):
        raise GreenContextsUnavailable("hgc_device_info(0)", greenctx_lib.HGC_ERR_NO_DRIVER, "no driver: libcuda.so.1 not found")

    monkeypatch.setattr(greenctx_lib, "query_device", no_driver)
    report = factory.ladder_report("cuda:0")
    assert not report["spatial"] and "no driver" in report["note"]
