#!/usr/bin/env python3
"""Why decode keeps only the cores the trainer leaves on a CPU (harvest/train/trainer_cpu.py).

In one process, as in the server: a decode-like loop on the main thread (the tiny model's
forward over a decode-sized batch, then ``--gap-ms`` of single-threaded Python standing
for the scheduler's own work between steps) and harvest's layer-split trainer on the demo
job on a second thread, on ``trainer.cpu_threads`` threads at ``trainer.nice`` (the
harvest.yaml defaults), as the trainer host runs it.

For decode on torch's default intra-op threads and on the cores the trainer leaves
(``decode_threads_beside_trainer``), the same run measures decode's steps alone, then
beside the running trainer: medians, p99, the worst step and the stalls (steps over
``--stall-factor`` x the alone median), and the trainer's units per second. On the 2-core
development machine the default is 2 threads, the split 1.

The last stdout line is one JSON object.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def _busy(seconds: float) -> None:
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        pass


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", action="store_true", help="print only the JSON result line")
    parser.add_argument("--steps", type=int, default=3000, help="decode steps beside the trainer, per thread count")
    parser.add_argument("--alone-steps", type=int, default=300, help="decode steps alone, per thread count")
    parser.add_argument("--batch", type=int, default=12, help="sequences in the decode-like batch")
    parser.add_argument("--gap-ms", type=float, default=1.0, help="single-threaded Python between steps (the scheduler's own work)")
    parser.add_argument("--stall-factor", type=float, default=10.0, help="a stall: a step over this many times the alone median")
    args = parser.parse_args()
    log = (lambda *a: None) if args.json else print

    import torch
    from transformers import AutoModelForCausalLM

    from harvest import colocation_config
    from harvest.metrics.percentile import nearest_rank
    from harvest.train.trainer_cpu import TrainerConfig
    from harvest.tiny_model import ensure_tiny_model
    from harvest.train.build import build_trainer
    from harvest.train.job import load_job
    from harvest.train.trainer_cpu import claim_trainer_thread, decode_threads_beside_trainer, usable_cores

    trainer_settings = TrainerConfig()  # harvest.yaml's defaults
    model_path = ensure_tiny_model()
    work = Path(tempfile.mkdtemp(prefix="harvest-bench-cpu-threads-"))
    colocation_config.write(work, model_path)
    model = AutoModelForCausalLM.from_pretrained(str(model_path), dtype=torch.float32).eval()
    ids = torch.randint(5, 400, (args.batch, 1))

    def step():
        with torch.no_grad():
            model(ids, use_cache=False)

    stop = threading.Event()
    units = [0]
    ready = threading.Event()

    def trainer_main():
        claim_trainer_thread(trainer_settings.cpu_threads, trainer_settings.nice)
        trainer = build_trainer(load_job(work / "job.yaml"))
        trainer.run_one_unit()
        ready.set()
        while not stop.is_set():
            trainer.run_one_unit()
            units[0] += 1
        trainer.close()

    def measure(count):
        times = []
        for _ in range(count):
            start = time.perf_counter()
            step()
            times.append((time.perf_counter() - start) * 1e3)
            _busy(args.gap_ms / 1e3)
        return times

    default_threads = torch.get_num_threads()
    split_threads = decode_threads_beside_trainer(trainer_settings.cpu_threads, default_threads)
    sys.setswitchinterval(0.0005)  # the trainer host's while a trainer runs
    results = {}
    for label, threads in (("default", default_threads), ("split", split_threads)):
        torch.set_num_threads(threads)
        measure(50)  # warm up
        alone = measure(args.alone_steps)
        stop.clear()
        ready.clear()
        thread = threading.Thread(target=trainer_main, name="harvest-trainer", daemon=True)
        thread.start()
        ready.wait()
        units0, started = units[0], time.perf_counter()
        beside = measure(args.steps)
        elapsed = time.perf_counter() - started
        stop.set()
        thread.join()
        alone_median = statistics.median(alone)
        results[label] = {
            "decode_threads": threads,
            "alone_p50_ms": round(alone_median, 3),
            "beside_p50_ms": round(statistics.median(beside), 3),
            "beside_p99_ms": round(nearest_rank(beside, 0.99), 3),
            "beside_max_ms": round(max(beside), 3),
            "stalls": sum(t > args.stall_factor * alone_median for t in beside),
            "trainer_units_per_s": round((units[0] - units0) / elapsed, 1),
        }
        log(f"decode on {threads} thread(s): {results[label]}")
    print(json.dumps({
        "steps": args.steps, "batch": args.batch, "gap_ms": args.gap_ms, "stall_factor": args.stall_factor,
        "cores": usable_cores(), "trainer_cpu_threads": trainer_settings.cpu_threads,
        "trainer_nice": trainer_settings.nice, **results,
        "stalls_split_vs_default": [results["split"]["stalls"], results["default"]["stalls"]],
        "trainer_units_split_over_default": round(results["split"]["trainer_units_per_s"] / max(results["default"]["trainer_units_per_s"], 1e-9), 3),
        "device": "cpu",
    }))
    return 0


if __name__ == "__main__":
    sys.exit(main())
