"""The transformers engine's decode CUDA graphs per ladder level, on CPU through emulated
graphs (a 'graph' re-runs its captured step) and on CUDA for real: the serving step
replays the chosen level's graph for the batch's bucket; the level-graphs measurement
captures, checks and compares graph, eager and whole-GPU steps, and reads the verdict;
the profiler's ``--graphs on`` engine replays what the static batch decodes eagerly."""

from __future__ import annotations

import pytest

from harvest.engines.transformers.graph_step import GraphStep, capture_serving_graphs
from harvest.engines.transformers.level_graph_check import graph_verdict, measure_level_graphs
from harvest.engines.transformers.static_batch import SlotDecodeBatch, StaticDecodeBatch
from tests.engines.helpers import emulated_graphs, model_on


class ProgressSink:
    """The result sink's progress side: what the measurement reports as it goes."""

    def __init__(self):
        self.reports = []

    def progress(self, mode, data, force=False):
        self.reports.append(mode)


def test_graph_step_replays_the_chosen_levels_graph_for_the_batchs_bucket(tiny_llama_path, one_thread):
    """With (emulated) graphs captured per (level, bucket) on an empty slot batch, the serving
    step replays the graph of the partitioner's level and the batch's bucket, and decodes
    what the eager step decodes."""
    import torch

    from harvest.ladder import GREEN_CONTEXTS, Ladder, Level

    class Partitioner:
        ladder = Ladder(2, (Level(1, 1), Level(2, 0)), GREEN_CONTEXTS)
        current_index = 1

    model = model_on(tiny_llama_path, "cpu")
    prompts = [[5 + 7 * j % 300 for j in range(6)], [9, 8, 7], [4, 4, 4, 4]]
    runs = {}
    for graphs_on in (True, False):
        batch = SlotDecodeBatch(model, "cpu", 4, 8, 5, buckets=[2])
        graphs = emulated_graphs()(Partitioner.ladder.levels)
        if graphs_on:
            report = capture_serving_graphs(batch, graphs, Partitioner.ladder)
            assert report["captured"] == 4 and sorted(graphs.captures) == [(0, 2), (0, 4), (1, 2), (1, 4)]
        step, rows = GraphStep(batch, graphs, Partitioner()), []
        batch.join([1, 2], [6, 3], prompts=prompts[:2])
        for joining in ([3], []):  # buckets 2, then 4
            for _ in range(2):
                step()
                rows.append(batch.last_logits[:batch.num_requests].clone())
            if joining:
                batch.join(joining, [4], prompts=prompts[2:])
        runs[graphs_on] = rows, step.graph_steps, step.eager_steps
    assert runs[True][1:] == (4, 0) and runs[False][1:] == (0, 4)
    assert all(torch.allclose(a, b, atol=1e-5) for a, b in zip(runs[True][0], runs[False][0]))


def test_level_graph_measurement_compares_graph_eager_and_whole_gpu(tiny_llama_path, monkeypatch, one_thread):
    import argparse

    from harvest.engines.transformers import captured_graphs
    from harvest.ladder import GREEN_CONTEXTS, Ladder, Level

    class TwoLevels:
        ladder = Ladder(2, (Level(1, 1), Level(2, 0)), GREEN_CONTEXTS)

    monkeypatch.setattr(captured_graphs, "CapturedLevelGraphs", emulated_graphs())
    sink = ProgressSink()
    ctx = {"partitioner": TwoLevels(), "model": model_on(tiny_llama_path, "cpu"), "device_type": "cpu", "device": "cpu",
           "sink": sink}
    args = argparse.Namespace(graph_batch_sizes=[2, 3], graph_context=8, graph_repeats=3, seed=0)
    result = measure_level_graphs(args, ctx)
    assert result["graphs_unavailable"] is None and "skipped" not in result
    for bs in ("2", "3"):
        partial, whole = result["batch_sizes"][bs]["levels"]
        for row in (partial, whole):
            assert row["eager_ms"] > 0 and row["graph_ms"] > 0 and row["graph_max_abs_diff_vs_eager"] == 0.0
        assert whole["graph_over_whole_graph"] == 1.0 and "verdict" not in whole
        assert partial["partition_respected"] is None or isinstance(partial["partition_respected"], bool)
        assert partial["capture_reserved_bytes"] > 0
    per_level = {"graphs": 2, "allocated_bytes": 2 * (1 << 19), "reserved_bytes": 2 * (1 << 20)}  # 2 batch sizes
    assert result["memory_by_level"] == {"0": per_level, "1": per_level}
    assert sink.reports == ["level-graphs"] * 4  # one report per (batch size, level)


@pytest.mark.parametrize("decode_sms, graph, respected, words", [
    (24, 2.07, True, "keeps to"), (104, 1.10, True, "keeps to"), (56, 1.02, False, "escapes"),
    (66, 1.05, False, "escapes"), (104, 1.05, None, "inconclusive")])
def test_graph_verdict(decode_sms, graph, respected, words):
    """A graph no slower than on the whole GPU ran on every SM: on half the SMs or fewer
    that is an escape; on a larger level a memory-bound step may just not need them."""
    whole = {"eager_ms": 40.0, "graph_ms": 13.0, "decode_sms": 132}
    row = {"eager_ms": 45.0, "graph_ms": 13.0 * graph, "decode_sms": decode_sms}
    verdict = graph_verdict(row, whole, 132)
    assert verdict[0] is respected and words in verdict[1], verdict


def test_graph_verdict_does_not_lean_on_a_launch_bound_eager_step():
    """H100, batch 8 of an 8B model: eager 32 ms on the whole GPU against a 13 ms graph, and
    eager no slower on 80 SMs; the graph's own x1.12 decides."""
    whole = {"eager_ms": 32.0, "graph_ms": 12.9, "decode_sms": 132}
    respected, words = graph_verdict({"eager_ms": 31.0, "graph_ms": 14.5, "decode_sms": 80}, whole, 132)
    assert respected is True and "x1.12" in words and "eager x0.97" in words


@pytest.mark.gpu
def test_each_levels_graph_replays_the_eager_step_on_its_own_stream(tiny_llama_path):
    """On the GPU: one graph per level of a real ladder, each replayed on its level's
    stream, gives the logits of the eager step (the measurement's correctness half)."""
    import torch

    from harvest.compute import create_partitioner
    from harvest.engines.transformers.captured_graphs import CapturedLevelGraphs

    model = model_on(tiny_llama_path, "cuda:0")
    with create_partitioner("cuda:0", levels=4) as partitioner:
        graphs = CapturedLevelGraphs(partitioner.ladder.levels)
        batch = StaticDecodeBatch(model, "cuda:0", 4, 16, max_steps=8)
        for index, level in enumerate(partitioner.ladder.levels):
            with torch.cuda.stream(level.decode_stream):
                batch.reset()
                batch.decode_step()
            level.decode_stream.synchronize()
            eager = batch.last_logits.clone()
            assert graphs.capture(index, 4, batch.decode_step) is not None
            with torch.cuda.stream(level.decode_stream):
                batch.reset()
            assert graphs.replay(index, 4) is True
            level.decode_stream.synchronize()
            assert torch.equal(batch.last_logits, eager), index
        assert set(graphs.memory_by_level()) == set(range(len(partitioner.ladder.levels)))
        graphs.close()


@pytest.mark.gpu
def test_profilers_graph_steps_decode_what_eager_static_steps_decode(tiny_llama_path):
    """`harvest profile --graphs on` (the transformers engine): each timed step is the
    captured graph of the grid point's static batch, replayed on the current stream; it
    decodes the tokens the same batch decodes eagerly, and reports the cache it reads."""
    import torch

    from harvest.predict.profiler.engines import EngineConfig
    from harvest.predict.profiler.hf_engine import TransformersDecodeEngine

    config = EngineConfig(str(tiny_llama_path), "cuda:0", "float32", False, 4, 64, graphs=True, steps_per_point=6)
    engine = TransformersDecodeEngine(config)
    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream):
        engine.prepare(4, 16)
        sums = []
        for _ in range(5):
            sums.append(engine.begin_step())
            engine.step()
        stream.synchronize()
        replayed = engine._static.ids.clone()
        reference = StaticDecodeBatch(engine.model, "cuda:0", 4, 16, max_steps=6, seed=config.seed + 1)
        for _ in range(5):
            reference.decode_step()
        stream.synchronize()
    assert torch.equal(replayed, reference.ids)
    assert sums == [4.0 * (16 + 6)] * 5
    with torch.cuda.stream(stream):
        engine.step()
        with pytest.raises(Exception, match="more than the 6 steps"):
            engine.begin_step()
    engine.close()
