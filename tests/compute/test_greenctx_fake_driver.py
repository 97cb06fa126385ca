"""libharvest_greenctx's driver paths against a fake libcuda.so.1 (fake_libcuda.c).

The fake logs every create/destroy and flags misuse with "BAD" lines (tests/fake_cuda.py
runs each case in a fresh interpreter under it); these tests check the order of
creation and teardown, rollback on a failure half-way, the 12.4 stream fallback, and the
"needs driver >= 12.4" refusal, none of which this GPU-less machine could run otherwise.
"""

from __future__ import annotations

import pytest

from tests import fake_cuda

pytestmark = fake_cuda.needs_fake_driver
GREEN_ENTRY_POINTS = (
    "cuDeviceGetDevResource,cuDevSmResourceSplitByCount,cuDevResourceGenerateDesc,cuGreenCtxCreate,"
    "cuGreenCtxDestroy,cuGreenCtxGetDevResource,cuCtxFromGreenCtx,cuGreenCtxRecordEvent,cuGreenCtxStreamCreate"
)
PRELUDE = "from harvest.compute import greenctx_lib as g\n"


@pytest.fixture(scope="module")
def fake_driver_dir(tmp_path_factory):
    return fake_cuda.build_fake_driver(tmp_path_factory.mktemp("fake_cuda"))


def run_with_fake_driver(fake_driver_dir, tmp_path, script: str, **knobs) -> tuple[dict, list[str]]:
    """Run `script` (which prints one JSON object) under the fake; return it and the log."""
    return fake_cuda.run_with_fake_driver(fake_driver_dir, tmp_path, script, prelude=PRELUDE, **knobs)


def assert_everything_released(lines: list[str]) -> None:
    counts = fake_cuda.exit_counts(lines)
    assert (counts["primary_refs"], counts["live_green"], counts["live_streams"]) == (0, 0, 0), lines


BUILD_AND_CLOSE = """
handle = g.LadderHandle(0, [24, 60, 132])
levels = [(lv.decode_sms, lv.trainer_sms, bool(lv.decode_stream), bool(lv.trainer_stream)) for lv in handle.ladder.levels]
current = ctypes.CDLL("libcuda.so.1").fake_current_context_id()
g.launch_spin_kernel(handle.ladder.levels[1].decode_stream, 10, 5)
handle.close()
print(json.dumps({"levels": levels, "green_stream_api": handle.green_stream_api, "current_after_build": current,
                  "total_sms": handle.ladder.total_sms, "whole_device_index": handle.ladder.whole_device_index}))
"""


def test_ladder_is_built_from_one_split_per_level_and_torn_down_in_order(fake_driver_dir, tmp_path):
    result, lines = run_with_fake_driver(fake_driver_dir, tmp_path, BUILD_AND_CLOSE)
    # 60 is rounded up to the fake's granularity of 8: the reported counts are realised ones.
    assert result["levels"] == [[24, 108, True, True], [64, 68, True, True], [132, 0, True, False]]
    assert result["green_stream_api"] and result["current_after_build"] == -1
    assert (result["total_sms"], result["whole_device_index"]) == (132, 2)
    assert [line for line in lines if line.startswith("split")] == [
        "split asked=24 group=24 remainder=108",
        "split asked=60 group=64 remainder=68",
    ]
    creates = [line for line in lines if line.startswith("stream_create")]
    assert all("via=cuGreenCtxStreamCreate" in line for line in creates[:4])
    assert creates[4] == "stream_create id=9 context=0 green=0 via=cuStreamCreate"  # whole device: primary
    assert "launch grid=10 block=128 stream=7 context=5 iterations=5 never=-1" in lines
    teardown = lines[lines.index("stream_sync id=3"):]
    assert teardown[:5] == [f"stream_sync id={i}" for i in (3, 4, 7, 8, 9)]  # drained before anything goes
    assert teardown[5:-1] == [
        "stream_destroy id=4", "stream_destroy id=3", "green_destroy id=2", "green_destroy id=1",
        "stream_destroy id=8", "stream_destroy id=7", "green_destroy id=6", "green_destroy id=5",
        "stream_destroy id=9", "primary_release refs=0",
    ]
    assert_everything_released(lines)


def test_driver_12_4_streams_fall_back_to_the_converted_context(fake_driver_dir, tmp_path):
    result, lines = run_with_fake_driver(
        fake_driver_dir, tmp_path, BUILD_AND_CLOSE, version=12040, missing="cuGreenCtxStreamCreate"
    )
    assert not result["green_stream_api"]
    assert result["current_after_build"] == -1, "the thread's current context is restored"
    creates = [line for line in lines if line.startswith("stream_create")]
    assert creates[:4] == [
        "stream_create id=3 context=1 green=1 via=cuStreamCreate",
        "stream_create id=4 context=2 green=1 via=cuStreamCreate",
        "stream_create id=7 context=5 green=1 via=cuStreamCreate",
        "stream_create id=8 context=6 green=1 via=cuStreamCreate",
    ]
    assert_everything_released(lines)


def test_failure_half_way_releases_everything_and_names_the_call(fake_driver_dir, tmp_path):
    script = """
    try:
        g.LadderHandle(0, [24, 64, 132])
    except g.GreenContextError as error:
        print(json.dumps({"status": error.status, "message": str(error)}))
    """
    result, lines = run_with_fake_driver(fake_driver_dir, tmp_path, script, fail_green_create_at=4)
    assert result["status"] == 3  # HGC_ERR_DRIVER
    assert "level 1 (64 decode SMs): cu->cuGreenCtxCreate(&context, desc, device, CU_GREEN_CTX_DEFAULT_STREAM) failed" in result["message"]
    assert "CUDA_ERROR_OUT_OF_MEMORY (fake driver error, code 2)" in result["message"]
    assert "stream_destroy id=4" in lines and "green_destroy id=5" in lines
    assert_everything_released(lines)


def test_a_driver_older_than_12_4_is_refused_naming_the_version(fake_driver_dir, tmp_path):
    script = """
    info = g.query_device(0)
    errors = []
    for call in (lambda: g.LadderHandle(0, [64, 132]), lambda: g.split_preview(0, 64)):
        try:
            call()
        except g.GreenContextsUnavailable as error:
            errors.append([error.status, str(error)])
    print(json.dumps({"supported": info.green_contexts_supported, "errors": errors}))
    """
    result, lines = run_with_fake_driver(fake_driver_dir, tmp_path, script, version=12020, missing=GREEN_ENTRY_POINTS)
    assert result["supported"] is False
    for status, message in result["errors"]:
        assert status == 4  # HGC_ERR_UNSUPPORTED
        assert "green contexts need a CUDA driver >= 12.4 (this driver is 12.2; missing cuDeviceGetDevResource" in message
    assert not [line for line in lines if line.startswith(("green_create", "primary_retain"))]


def test_bad_requests_reach_the_driver_check_and_are_refused(fake_driver_dir, tmp_path):
    script = """
    out = {}
    for name, call in (("too_many", lambda: g.LadderHandle(0, [64, 200])),
                       ("no_device", lambda: g.split_preview(3, 64)),
                       ("nothing_left", lambda: g.LadderHandle(0, [130, 132]))):
        try:
            call()
        except g.GreenContextError as error:
            out[name] = [error.status, str(error)]
    print(json.dumps(out))
    """
    result, lines = run_with_fake_driver(fake_driver_dir, tmp_path, script)
    assert result["too_many"] == [1, "hgc_ladder_create(0, [64, 200]): decode_sms 200 exceeds the device's 132 SMs"]
    assert result["no_device"][0] == 1 and "device 3 out of range (1 devices visible)" in result["no_device"][1]
    assert result["nothing_left"][0] == 1
    assert "a split of 130 decode SMs from 132 is not realisable" in result["nothing_left"][1]
    assert_everything_released(lines)


def test_driver_13_constraints_and_the_ladder_report(fake_driver_dir, tmp_path):
    script = """
    from harvest.compute.factory import ladder_report
    info = g.query_device(0)
    report = ladder_report("cuda:0", levels=[40, 56, 96])
    print(json.dumps({"min": info.min_sm_partition_size, "alignment": info.sm_coscheduled_alignment, "report": report}))
    """
    result, lines = run_with_fake_driver(fake_driver_dir, tmp_path, script, version=13000, granularity=16)
    assert (result["min"], result["alignment"]) == (8, 8)
    report = result["report"]
    assert report["partitioner"] == "GreenContextPartitioner" and report["spatial"]
    assert report["constraints"]["source"] == "driver (min partition 8, alignment 8)"
    # Planned with the reported step of 8; the fake's split really rounds to 16, and the
    # report shows what the split gives.
    assert report["planned_decode_sms"] == [40, 56, 96, 132]
    assert [(lv["decode_sms"], lv["trainer_sms"]) for lv in report["levels"]] == [(48, 84), (64, 68), (96, 36), (132, 0)]
    assert report["preview_notes"] == ["level 40: the driver gives 48/84", "level 56: the driver gives 64/68"]
    assert not [line for line in lines if line.startswith(("green_create", "stream_create"))], "a preview creates nothing"


def test_partitioner_start_up_failure_after_the_build_releases_the_real_ladder(fake_driver_dir, tmp_path):
    # The CPU build of torch cannot wrap the streams (ExternalStream raises): the ladder
    # the C library built must be torn down before the error propagates.
    script = """
    from harvest.compute.green_partitioner import GreenContextPartitioner
    try:
        GreenContextPartitioner(0, levels=4)
    except RuntimeError as error:
        print(json.dumps({"error": str(error)}))
    """
    result, lines = run_with_fake_driver(fake_driver_dir, tmp_path, script)
    assert "compiled without CUDA" in result["error"]
    assert len([line for line in lines if line.startswith("green_create")]) == 6  # 3 partial levels
    assert lines[-2] == "primary_release refs=0"
    assert_everything_released(lines)


def test_a_ladder_dropped_without_close_is_released_by_the_finalizer(fake_driver_dir, tmp_path):
    script = """
    import gc, os
    handle = g.LadderHandle(0, [64, 132])
    del handle
    gc.collect()
    with open(os.environ["FAKE_CUDA_LOG"], "a") as log:
        print("python: collected", file=log)
    print(json.dumps({}))
    """
    _, lines = run_with_fake_driver(fake_driver_dir, tmp_path, script)
    collected = lines.index("python: collected")
    assert lines[collected - 2 : collected] == ["stream_destroy id=5", "primary_release refs=0"]
    assert_everything_released(lines)
