"""The control endpoint's snapshot (StatusReporter.snapshot): each one carries the steps
recorded since the snapshot before the last, so an endpoint that misses one loses no
step; rows follow STEP_FIELDS; the status and the exposition come with it."""

from __future__ import annotations

import json

from harvest.colocate import StepLoad
from harvest.colocate.assemble import EngineAdapter, assemble
from harvest.colocate.status import STEP_FIELDS, StatusReporter
from harvest.config import HarvestConfig
from harvest.schedule import SchedulerConfig


def test_each_snapshot_carries_the_steps_since_the_one_before_the_last(tiny_llama_path):
    engine = EngineAdapter(device="cpu", model_path=str(tiny_llama_path), model_dtype="float32")
    colocation = assemble(HarvestConfig(qos=SchedulerConfig(target_tpot_ms=12.0)), engine)
    try:
        reporter = StatusReporter(colocation, interval_s=3600.0)

        def steps(count):
            for _ in range(count):
                colocation.run_step(StepLoad(2, 10, True), lambda: None)

        def seqs(snapshot):
            return [row[0] for row in snapshot["steps"]["rows"]]

        assert reporter.due()
        steps(3)
        first = reporter.snapshot(decode_graphs=None)
        assert not reporter.due()  # a snapshot counts as the interval's publish
        steps(2)
        second = reporter.snapshot()
        steps(1)
        third = reporter.snapshot()
        assert (seqs(first), seqs(second), seqs(third)) == ([1, 2, 3], [1, 2, 3, 4, 5], [4, 5, 6])
        assert first["steps"]["fields"] == STEP_FIELDS and len(first["steps"]["rows"][0]) == len(STEP_FIELDS)
        row = dict(zip(STEP_FIELDS, third["steps"]["rows"][-1]))
        assert row["batch_size"] == 2 and row["is_decode"] is True and row["measured_ms"] >= 0
        assert "decode_graphs" in first["status"] and first["status"]["steps"] == 3
        assert "harvest_decode_step_seconds_count{" in first["metrics"] and "} 3.0" in first["metrics"]
        json.loads(json.dumps(third))  # what ControlLink.publish writes
    finally:
        colocation.close(trainer_timeout_s=5.0)
        colocation.partitioner.close()
