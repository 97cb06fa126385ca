"""Test driver: run a job until step STEP (0-based) is in its backward pass, print PARKED,
and hold there until killed. Used by the kill-and-resume test to SIGKILL a trainer that
has completed steps after its last checkpoint and is mid-step.

    python tests/train/pausing_driver.py job.yaml STEP
"""

from __future__ import annotations

import sys

from harvest.train.build import build_trainer
from harvest.train.gate import Gate
from harvest.train.job import load_job
from harvest.train.stats import UnitKind


def main(job_path: str, step: int) -> None:
    trainer = build_trainer(load_job(job_path))
    gate = Gate()

    def on_unit(record) -> None:
        if record.step == step and record.kind == UnitKind.BACKWARD and not gate.paused:
            gate.pause()
            # LlamaFactory's LogCallback writes trainer_log.jsonl on a thread of its own:
            # flushed here, so the log on disk at the kill holds every completed step.
            if trainer.train_log is not None:
                trainer.train_log.end()
            print(f"PARKED at step {record.step} after {record.kind.value} {record.stage_name}", flush=True)

    trainer.run(gate, on_unit=on_unit)  # blocks in the gate until the test kills the process


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]))
