"""The serving step with graphs on (``--graphs on`` of the GPU experiment): a
:class:`~.static_batch.SlotDecodeBatch` or (``--kv paged``) a
:class:`~.paged_batch.PagedDecodeBatch` whose step is one CUDA graph per (ladder level,
bucket), captured on the level's decode stream before serving
(:func:`capture_serving_graphs`, into a :class:`~.captured_graphs.CapturedLevelGraphs`)
and replayed for the level the partitioner is on, i.e. the one the QoS decision chose
(:class:`GraphStep`); eager on that stream where no graph was captured (always without
CUDA). The load the scheduler sees is what such a step computes
(``padded_sum_context``): bucket x the cache's columns for the slot batch, each request's
pages for the paged one. The batch's host bookkeeping (``check_room`` before the replay,
``after_step`` after it: a paged batch's new pages) stays outside the graph.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from harvest.engines.transformers.paged_batch import PagedDecodeBatch
    from harvest.engines.transformers.static_batch import SlotDecodeBatch


class GraphStep:
    """The serving step with graphs on: the captured graph of (the level the partitioner
    is on, i.e. the one the QoS decision chose; the batch's bucket), replayed on that
    level's decode stream; eager there where no graph was captured (or without CUDA)."""

    def __init__(self, batch: SlotDecodeBatch | PagedDecodeBatch, graphs, partitioner):
        self.batch, self.graphs, self.partitioner = batch, graphs, partitioner
        self.graph_steps = self.eager_steps = 0

    def __call__(self) -> None:
        batch = self.batch
        batch.check_room()
        bucket = batch.bucket
        if self.graphs.replay(self.partitioner.current_index, bucket, eager=lambda: batch.decode_step(bucket)):
            self.graph_steps += 1
        else:
            self.eager_steps += 1
        batch.after_step()


def capture_serving_graphs(batch: SlotDecodeBatch | PagedDecodeBatch, graphs, ladder) -> dict:
    """One graph per (level, bucket) of the slot batch's step, each on the level's decode
    stream (the batch may be empty: inactive slots compute garbage, a join resets them)."""
    report = {"buckets": list(batch.buckets), "levels": ladder.num_levels, "captured": 0, "capture_s": 0.0,
              "unavailable": graphs.unavailable}
    if graphs.unavailable is None:
        for index in range(ladder.num_levels):
            for bucket in batch.buckets:
                capture = graphs.capture(index, bucket, lambda bucket=bucket: batch.decode_step(bucket))
                report["captured"] += 1
                report["capture_s"] += capture.seconds
        report["capture_s"] = round(report["capture_s"], 3)
        report["memory_by_level"] = {str(k): v for k, v in graphs.memory_by_level().items()}
    return report
