"""Green-context SM partitions on a real GPU (skipped without one).

The proof that a partition is real is timing: the calibration kernel
(hgc_launch_spin_kernel, pure FP32 arithmetic, many more blocks than the GPU holds at
once) takes about total/k times longer on k SMs than on the whole GPU. Tolerances are
loose (25%) because GPU clocks rise when fewer SMs are busy; a partition that was not
enforced would be off by far more (ratio ~1). Each test prints a `GPU-VALIDATION` line
(run with -s) with the numbers for docs/gpu-validation.md.
"""

from __future__ import annotations

import json
import statistics
import time

import pytest

from harvest.compute import greenctx_lib

pytestmark = [pytest.mark.gpu, pytest.mark.timeout(600)]

TOLERANCE = 0.25
WAVES_ON_WHOLE_GPU = 24  # blocks = total_sms * resident blocks per SM * this
RESIDENT_BLOCKS_PER_SM = 16  # 128-thread blocks, 2048 threads per SM on sm_80/sm_90
TARGET_WHOLE_GPU_SECONDS = 0.04


def record(name: str, **values) -> None:
    print(f"GPU-VALIDATION {name} {json.dumps(values)}")


@pytest.fixture(scope="module")
def torch_cuda():
    import torch

    if not torch.cuda.is_available():
        pytest.skip("torch has no CUDA device (CPU build of torch?)")
    torch.cuda.init()
    return torch


@pytest.fixture(scope="module")
def partitioner(torch_cuda):
    from harvest.compute.green_partitioner import GreenContextPartitioner

    built = GreenContextPartitioner(0, levels=6)
    yield built
    built.close()


class Spin:
    """The calibration kernel sized for this GPU: `blocks` blocks of `iterations`."""

    def __init__(self, partitioner):
        self.total_sms = partitioner.ladder.levels[-1].decode_sms
        self.blocks = self.total_sms * RESIDENT_BLOCKS_PER_SM * WAVES_ON_WHOLE_GPU
        self.iterations = 1000
        whole = partitioner.ladder.levels[-1].decode_stream
        for level in partitioner.ladder.levels:  # first launch in each context loads the kernel
            for stream in (level.decode_stream, level.trainer_stream):
                if stream is not None:
                    self.run(stream, blocks=1, iterations=1)
        elapsed = self.time(whole)
        self.iterations = max(1000, min(2_000_000, int(self.iterations * TARGET_WHOLE_GPU_SECONDS / elapsed)))
        self.whole_gpu_seconds = self.time(whole)

    def run(self, stream, blocks=None, iterations=None) -> None:
        greenctx_lib.launch_spin_kernel(stream.cuda_stream, blocks or self.blocks, iterations or self.iterations)
        stream.synchronize()

    def time(self, stream, repeats: int = 3) -> float:
        samples = []
        for _ in range(repeats):
            stream.synchronize()
            start = time.perf_counter()
            self.run(stream)
            samples.append(time.perf_counter() - start)
        return statistics.median(samples)


@pytest.fixture(scope="module")
def spin(partitioner):
    return Spin(partitioner)


def assert_ratio(measured: float, expected: float, what: str) -> None:
    assert abs(measured / expected - 1) <= TOLERANCE, f"{what}: ratio {measured:.2f}, expected about {expected:.2f}"


def test_ladder_is_built_as_planned(partitioner):
    from harvest.compute.green_partitioner import plan_for_device

    props = greenctx_lib.query_device(0)
    planned = plan_for_device(props, 6)
    constraints = planned.constraints
    levels = partitioner.ladder.levels
    total = props.sm_count
    assert partitioner.spatial and 2 <= len(levels) <= 8
    assert (levels[-1].decode_sms, levels[-1].trainer_sms, levels[-1].trainer_stream) == (total, 0, None)
    decodes = [level.decode_sms for level in levels]
    assert decodes == sorted(set(decodes))
    handles = set()
    for level in levels[:-1]:
        assert level.decode_sms + level.trainer_sms == total, level
        assert level.decode_sms >= constraints.min_decode_sms and level.trainer_sms >= constraints.min_trainer_sms
        handles |= {level.decode_stream.cuda_stream, level.trainer_stream.cuda_stream}
    handles.add(levels[-1].decode_stream.cuda_stream)
    assert len(handles) == 2 * (len(levels) - 1) + 1, "every stream is distinct"
    record(
        "ladder",
        device=props.name,
        driver=props.driver_version,
        compute_capability=props.compute_capability,
        reported_min_partition=props.min_sm_partition_size,
        reported_alignment=props.sm_coscheduled_alignment,
        constraints=constraints.source,
        planned=[(lv.decode_sms, lv.trainer_sms) for lv in planned.levels],
        realised=[(lv.decode_sms, lv.trainer_sms) for lv in levels],
        green_stream_api=partitioner.green_stream_api,
    )


def test_each_stream_runs_kernels(partitioner, torch_cuda):
    torch = torch_cuda
    n = 1 << 20
    for level in partitioner.ladder.levels:
        for stream in (level.decode_stream, level.trainer_stream):
            if stream is None:
                continue
            with torch.cuda.stream(stream):
                x = torch.arange(n, device="cuda", dtype=torch.float32)
                y = x * 2 + 1
            greenctx_lib.launch_spin_kernel(stream.cuda_stream, 64, 100)
            stream.synchronize()
            assert y[-1].item() == 2 * (n - 1) + 1 and y[:3].tolist() == [1.0, 3.0, 5.0]


def test_compute_bound_kernel_slows_by_total_over_k(partitioner, spin):
    rows = []
    for level in partitioner.ladder.levels[:-1]:
        for side, sms, stream in (("decode", level.decode_sms, level.decode_stream),
                                  ("trainer", level.trainer_sms, level.trainer_stream)):
            ratio = spin.time(stream) / spin.whole_gpu_seconds
            rows.append({"side": side, "sms": sms, "ratio": round(ratio, 3), "expected": round(spin.total_sms / sms, 3)})
    record("scaling", total_sms=spin.total_sms, whole_gpu_ms=round(spin.whole_gpu_seconds * 1e3, 2),
           blocks=spin.blocks, iterations=spin.iterations, rows=rows)
    for row in rows:
        assert_ratio(row["ratio"], row["expected"], f"{row['side']} partition of {row['sms']} SMs")


def test_decode_partition_is_not_slowed_by_a_trainer_kernel(partitioner, spin):
    level = partitioner.ladder.levels[len(partitioner.ladder.levels) // 2 - 1]
    solo = spin.time(level.decode_stream)
    # Start a trainer kernel that outlasts the decode one, then time decode alone.
    long_trainer = max(1, int(spin.iterations * 3 * solo / spin.time(level.trainer_stream)))
    greenctx_lib.launch_spin_kernel(level.trainer_stream.cuda_stream, spin.blocks, long_trainer)
    start = time.perf_counter()
    spin.run(level.decode_stream)
    beside_trainer = time.perf_counter() - start
    trainer_still_running = not level.trainer_stream.query()
    level.trainer_stream.synchronize()
    record("isolation", decode_sms=level.decode_sms, trainer_sms=level.trainer_sms,
           decode_solo_ms=round(solo * 1e3, 2), decode_beside_trainer_ms=round(beside_trainer * 1e3, 2),
           trainer_still_running=trainer_still_running)
    assert trainer_still_running, "the trainer kernel must overlap the whole decode kernel for this to prove anything"
    assert beside_trainer <= solo * (1 + TOLERANCE)


def test_cuda_graph_captured_on_a_level_stays_within_it(partitioner, spin, torch_cuda):
    torch = torch_cuda
    level = partitioner.ladder.levels[len(partitioner.ladder.levels) // 2 - 1]
    stream = level.decode_stream
    eager = spin.time(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, stream=stream):
        greenctx_lib.launch_spin_kernel(stream.cuda_stream, spin.blocks, spin.iterations)
    samples = []
    for _ in range(3):
        stream.synchronize()
        start = time.perf_counter()
        with torch.cuda.stream(stream):
            graph.replay()
        stream.synchronize()
        samples.append(time.perf_counter() - start)
    replay = statistics.median(samples)
    record("graph", decode_sms=level.decode_sms, eager_ms=round(eager * 1e3, 2), replay_ms=round(replay * 1e3, 2),
           whole_gpu_ms=round(spin.whole_gpu_seconds * 1e3, 2))
    assert_ratio(replay / spin.whole_gpu_seconds, spin.total_sms / level.decode_sms, "graph replay on the level")
    assert_ratio(replay / eager, 1.0, "graph replay vs eager launch on the same stream")


def test_factory_builds_green_contexts_and_ladders_can_be_rebuilt(torch_cuda):
    from harvest.compute import create_partitioner
    from harvest.compute.green_partitioner import GreenContextPartitioner

    for _ in range(2):  # close releases everything: a second ladder builds the same
        partitioner = create_partitioner("cuda:0", levels=4)
        assert isinstance(partitioner, GreenContextPartitioner), partitioner.description
        counts = [(lv.decode_sms, lv.trainer_sms) for lv in partitioner.ladder.levels]
        partitioner.close()
        partitioner.close()
    assert len(counts) == 4


def test_whole_device_fallback_runs_on_the_gpu(torch_cuda):
    from harvest.compute import WholeDevicePartitioner

    with WholeDevicePartitioner("cuda:0", reason="test") as partitioner:
        (level,) = partitioner.ladder.levels
        assert partitioner.ladder.total_sms == torch_cuda.cuda.get_device_properties(0).multi_processor_count
        assert level.decode_sms == level.trainer_sms == partitioner.ladder.total_sms
        for stream in (level.decode_stream, level.trainer_stream):
            greenctx_lib.launch_spin_kernel(stream.cuda_stream, 64, 100)
            stream.synchronize()
