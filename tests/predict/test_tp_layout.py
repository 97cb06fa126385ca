"""Where `harvest profile --tp N` puts its ranks: the engine and machine checks, and each
CPU rank's cores (SGLANG_CPU_OMP_THREADS_BIND, the operator's or harvest's split)."""

from __future__ import annotations

import pytest

from harvest.predict.profiler import tp_layout
from harvest.predict.profiler.session import default_profile_path
from harvest.predict.profiler.tp_layout import TensorParallelError


def test_split_cores_gives_each_rank_a_contiguous_group_differing_by_at_most_one():
    assert tp_layout.split_cores([0, 1], 2) == ((0,), (1,))
    assert tp_layout.split_cores(range(7), 3) == ((0, 1, 2), (3, 4), (5, 6))
    for cores, ranks in (([3, 9, 4, 10, 5], 2), (range(16), 4), (range(5), 5)):
        groups = tp_layout.split_cores(cores, ranks)
        flat = [c for g in groups for c in g]
        assert flat == sorted(cores) and len(groups) == ranks  # every core once, in order
        assert max(map(len, groups)) - min(map(len, groups)) <= 1
    with pytest.raises(TensorParallelError, match=r"--tp 3: needs at least 3 CPU cores \(one per rank\), this process may use 2 \(0-1,"):
        tp_layout.split_cores([0, 1], 3)


def test_core_lists_are_written_and_read_as_sglang_reads_them():
    assert tp_layout.format_cores([8, 0, 1, 2, 3, 10, 11]) == "0-3,8,10-11"
    assert tp_layout.format_threads_bind(((0, 1), (2,))) == "0-1|2"
    assert tp_layout.parse_threads_bind("0-1,4|2", 2, range(8)) == ((0, 1, 4), (2,))


@pytest.mark.parametrize(
    "text, message",
    [
        ("0-3", r"1 '\|'-separated core group\(s\), need one per rank \(2\)"),
        ("0|x", r"rank 1's group 'x' is not a list of core ids"),
        ("0|9", r"rank 1's cores 9 are not usable by this process \(it may use 0-3\)"),
    ],
)
def test_an_operators_threads_bind_that_cannot_work_is_refused_naming_it(text, message):
    with pytest.raises(TensorParallelError, match=message) as refused:
        tp_layout.parse_threads_bind(text, 2, range(4))
    assert f"SGLANG_CPU_OMP_THREADS_BIND={text!r}" in str(refused.value)


def test_cpu_core_groups_sets_the_variable_unless_the_operator_did():
    environ: dict = {}
    assert tp_layout.cpu_core_groups(2, environ, usable=[4, 5, 6, 7]) == ((4, 5), (6, 7))
    assert environ == {tp_layout.THREADS_BIND_VAR: "4-5|6-7"}
    given = {tp_layout.THREADS_BIND_VAR: "7|4"}
    assert tp_layout.cpu_core_groups(2, given, usable=[4, 5, 6, 7]) == ((7,), (4,))
    assert given == {tp_layout.THREADS_BIND_VAR: "7|4"}
    one: dict = {}
    assert tp_layout.cpu_core_groups(1, one, usable=[0, 1]) == ((0, 1),) and one == {}


def test_engine_and_gpu_checks_name_the_flag():
    tp_layout.check_engine(1, "transformers")
    tp_layout.check_engine(4, "sglang")
    with pytest.raises(TensorParallelError, match=r"--tp 2: the transformers engine decodes in one process.*use --engine sglang"):
        tp_layout.check_engine(2, "transformers")
    with pytest.raises(TensorParallelError, match=r"--tp=0: must be >= 1"):
        tp_layout.check_engine(0, "sglang")
    tp_layout.check_gpus(2, "cuda", 2)
    tp_layout.check_gpus(1, "cuda:3", 4)
    with pytest.raises(TensorParallelError, match=r"--tp 4: needs 4 GPUs, 2 visible"):
        tp_layout.check_gpus(4, "cuda:0", 2)
    with pytest.raises(TensorParallelError, match=r"--tp 2 with --device cuda:1: the ranks take GPUs 0..1; .*CUDA_VISIBLE_DEVICES"):
        tp_layout.check_gpus(2, "cuda:1", 8)


def test_the_default_profile_name_carries_the_tp_degree_above_1():
    assert str(default_profile_path("cuda", "llama3-8b", "sglang", 1)) == "profiles/cuda-llama3-8b-sglang.json"
    assert str(default_profile_path("cuda", "llama3-8b", "sglang", 2)) == "profiles/cuda-llama3-8b-sglang-tp2.json"
