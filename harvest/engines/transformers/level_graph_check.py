"""The level-graphs mode of the GPU experiment: does a decode CUDA
graph replayed on a ladder level keep to that level's SMs?

No trace, no trainer: a static-cache decode step (:class:`~.static_batch.StaticDecodeBatch`)
per batch size and ladder level, eager on the level's decode stream, then captured there
as a CUDA graph (one per (level, batch size), one shared pool:
:class:`~.captured_graphs.CapturedLevelGraphs`) and replayed; the graph's logits checked
against eager's, graph-on-level-k vs eager-on-level-k vs graph-on-the-whole-GPU, memory
each capture added. Without CUDA only the eager figures are measured (the result says
why).
"""

from __future__ import annotations

import time

from harvest.engines.transformers.model import on_stream
from harvest.engines.transformers.static_batch import StaticDecodeBatch


def _median_step_ms(batch, graphs, level_index, stream, graph: bool, warmup: int, repeats: int, on_cuda: bool) -> float:
    """Median latency of one step of ``batch`` on level ``level_index`` (graph replay or
    eager on its decode stream): CUDA events on that stream, a host timer on CPU."""
    import statistics

    import torch

    with on_stream(stream):
        batch.reset()
    for _ in range(warmup):
        batch.run(graphs, level_index, stream, graph=graph)
    samples = []
    for _ in range(repeats):
        if on_cuda:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record(stream)
            batch.run(graphs, level_index, stream, graph=graph)
            end.record(stream)
            end.synchronize()
            samples.append(start.elapsed_time(end))
        else:
            started = time.perf_counter()
            batch.run(graphs, level_index, stream, graph=graph)
            samples.append((time.perf_counter() - started) * 1e3)
    return round(statistics.median(samples), 4)


def graph_verdict(row: dict, whole: dict, total_sms: int, min_slowdown: float = 1.1) -> tuple[bool | None, str]:
    """Does the graph replayed on a partial level keep to its SMs? A graph that escaped
    its green context would run on every SM, as fast as the same step's graph on the
    whole GPU; one that keeps to its level is slower. So: clearly slower (x``min_slowdown``
    or more) keeps to the level; not clearly slower on a level with at most half the SMs
    escapes (a decode step loses bandwidth as well as compute there: x1.29 on 56 of 132
    H100 SMs at batch 8 of an 8B model); not clearly slower on a larger level cannot tell
    (a memory-bound step may not need every SM).

    Eager decode is no reference: on a GPU, transformers' eager step of an 8B model is
    bound by the host's kernel launches (H100: a whole-GPU eager step 1.8-2.5 times its
    graph), so its time per level measures the host, not the SMs; it is reported beside."""
    if row.get("graph_ms") is None or whole.get("graph_ms") is None:
        return None, "no graph measured"
    graph = row["graph_ms"] / whole["graph_ms"]
    eager = row["eager_ms"] / whole["eager_ms"]
    seen = f"graph x{graph:.2f} slower than on the whole GPU (eager x{eager:.2f})"
    if graph >= min_slowdown:
        return True, f"{seen}: the graph keeps to the level"
    if 2 * row["decode_sms"] <= total_sms:
        return False, f"{seen} on {row['decode_sms']} of {total_sms} SMs: the graph escapes the level"
    return None, f"inconclusive: {seen} on {row['decode_sms']} of {total_sms} SMs"


def measure_level_graphs(args, ctx) -> dict:
    """Claim (c) (and (b) for a real decode step): for each batch size and ladder level, a
    static-cache decode step eager on the level's stream, then captured there (one graph
    per (level, batch size), one pool) and replayed; the graph's tokens checked against
    eager's; graph-on-level-k vs eager-on-level-k vs graph-on-the-whole-GPU."""
    import torch

    from harvest.engines.transformers.captured_graphs import CapturedLevelGraphs

    partitioner, model, on_cuda = ctx["partitioner"], ctx["model"], ctx["device_type"] == "cuda"
    ladder = partitioner.ladder
    graphs = CapturedLevelGraphs(ladder.levels)
    warmup, repeats = 2, args.graph_repeats
    result = {"engine": "transformers StaticCache, 4-D boolean mask, greedy token (decode_step of StaticDecodeBatch)",
              "context_length": args.graph_context, "repeats": repeats, "graphs_unavailable": graphs.unavailable,
              "whole_device_level": ladder.whole_device_index, "batch_sizes": {}}
    ctx["live"] = result  # what an interrupt leaves
    sink = ctx["sink"]
    try:
        for batch_size in args.graph_batch_sizes:
            batch = StaticDecodeBatch(model, ctx["device"], batch_size, args.graph_context,
                                      max_steps=warmup + repeats + 2, seed=args.seed)
            rows: list[dict] = []
            result["batch_sizes"][str(batch_size)] = {"levels": rows}
            for index, level in enumerate(ladder.levels):
                stream = level.decode_stream
                row = {"level": index, "decode_sms": level.decode_sms, "trainer_sms": level.trainer_sms}
                rows.append(row)
                row["eager_ms"] = _median_step_ms(batch, graphs, index, stream, False, warmup, repeats, on_cuda)
                with on_stream(stream):
                    batch.reset()
                    batch.run(graphs, index, stream, graph=False)
                    eager_logits = batch.last_logits.float().clone()
                capture = graphs.capture(index, batch_size, batch.decode_step)
                if capture is not None:
                    row["capture_s"] = round(capture.seconds, 3)
                    row["capture_reserved_bytes"] = capture.reserved_bytes
                    row["capture_allocated_bytes"] = capture.allocated_bytes
                    with on_stream(stream):
                        batch.reset()
                    batch.run(graphs, index, stream, graph=True)
                    if stream is not None:
                        stream.synchronize()
                    row["graph_max_abs_diff_vs_eager"] = float((batch.last_logits.float() - eager_logits).abs().max())
                    row["graph_ms"] = _median_step_ms(batch, graphs, index, stream, True, warmup, repeats, on_cuda)
                    row["graph_over_eager"] = round(row["graph_ms"] / row["eager_ms"], 4)
                sink.progress("level-graphs", result)
            whole = rows[ladder.whole_device_index]
            for row in rows:
                row["eager_over_whole_eager"] = round(row["eager_ms"] / whole["eager_ms"], 4)
                if row.get("graph_ms") is not None:
                    row["graph_over_whole_graph"] = round(row["graph_ms"] / whole["graph_ms"], 4)
                if row is not whole:
                    row["partition_respected"], row["verdict"] = graph_verdict(row, whole, ladder.total_sms)
            del batch
            if on_cuda:
                torch.cuda.synchronize()
    finally:
        result["memory_by_level"] = {str(k): v for k, v in graphs.memory_by_level().items()}
        graphs.close()
    if graphs.unavailable is not None:
        result["skipped"] = f"graph figures: {graphs.unavailable}; eager decode per level measured"
    return result
