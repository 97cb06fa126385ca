#!/usr/bin/env python3
"""Fair share between two jobs on one real SGLang server (CPU by default), in one run:

1. harvest on, two LoRA jobs in harvest.yaml with weights 1 and 3 (``--weights``), the
   queue's quantum ``--quantum-s``; request traffic (``--concurrency`` clients sending
   short greedy requests) for ``--seconds``;
2. halfway, a third job is submitted with ``harvest ctl submit`` (checked by the server,
   then queued): the time until it runs units (``late_job_start_s``: the job check, the
   build on its own thread) is measured, and the server never restarts;
3. the trainer time each job was charged over the run (``trainer_s``, from
   ``/harvest/status``), the first two jobs' ratio against their weights' ratio, and
   what decode saw meanwhile (TPOT p50/p99 of the last steps, violations, failed requests).

The last stdout line is one JSON object. Target: ``ratio_error`` (|measured/weights - 1|
of the first two jobs' trainer time) <= 0.10, ``late_job_started`` true, ``failed_requests`` 0.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def _status(port: int) -> dict:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/harvest/status", timeout=10) as response:
        return json.loads(response.read())


def _jobs(port: int) -> dict:
    return {job["name"]: job for job in _status(port)["trainer"]["jobs"]}


def _wait_for(predicate, timeout_s: float, interval_s: float = 0.5):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            value = predicate()
        except OSError:
            value = None
        if value:
            return value
        time.sleep(interval_s)
    return None


def _traffic(srv, stop: threading.Event, results: dict, index: int) -> None:
    i = 0
    while not stop.is_set():
        ids = [(7 * index + 3 * j + i) % 400 + 5 for j in range(16 + i % 16)]
        try:
            srv.post("/generate", {"input_ids": ids,
                                   "sampling_params": {"max_new_tokens": 16, "temperature": 0, "ignore_eos": True}})
            results["ok"] += 1
        except Exception:  # noqa: BLE001 - counted, reported
            results["failed"] += 1
        i += 1
        stop.wait(0.05)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", action="store_true", help="print only the JSON result line")
    parser.add_argument("--seconds", type=float, default=90.0, help="measured run, after both jobs run")
    parser.add_argument("--weights", type=float, nargs=2, default=(1.0, 3.0))
    parser.add_argument("--quantum-s", type=float, default=0.5)
    parser.add_argument("--concurrency", type=int, default=2)
    args = parser.parse_args()

    from harvest import colocation_config
    from harvest.sglang import server
    from harvest.tiny_model import TINY_LLAMA, ensure_tiny_model

    def say(text):
        if not args.json:
            print(text, flush=True)

    model = ensure_tiny_model(TINY_LLAMA)
    work = Path(tempfile.mkdtemp(prefix="bench-job-queue-"))
    port = server.free_port()
    weight_a, weight_b = args.weights
    config = colocation_config.write(work, model, metrics_port=port,
                                     jobs={"a": {"weight": weight_a}, "b": {"weight": weight_b}},
                                     config_keys={"queue": {"quantum_s": args.quantum_s}})
    late_job = colocation_config.write_job(work, model, "late")
    server_args = server.cpu_server_args(model, max_total_tokens=16384) + [
        "--disable-radix-cache", "--enable-harvest", "--harvest-config", str(config)]
    results = {"ok": 0, "failed": 0}
    with server.launch(server_args, log_path=work / "sglang.log") as srv:
        say(f"server up; waiting for both jobs to run ({work})")
        if not _wait_for(lambda: all(j["state"] in ("running", "paused") and j["global_step"] > 0
                                     for j in _jobs(port).values()) and len(_jobs(port)) == 2, 300):
            raise SystemExit(f"the jobs did not start: {_status(port)['trainer']}")
        start = _jobs(port)
        stop = threading.Event()
        clients = [threading.Thread(target=_traffic, args=(srv, stop, results, i), daemon=True)
                   for i in range(args.concurrency)]
        for client in clients:
            client.start()
        t0 = time.monotonic()
        time.sleep(args.seconds / 2)
        say("submitting a third job with harvest ctl")
        submitted_at = time.monotonic()
        ctl = subprocess.run([sys.executable, "-m", "harvest.cli", "ctl", "--server", f"127.0.0.1:{port}", "submit",
                              str(late_job)], capture_output=True, text=True, check=False)
        started = _wait_for(lambda: _jobs(port).get("late", {}).get("global_step", 0) > 0, 300, 0.2)
        late_start_s = time.monotonic() - submitted_at if started else None
        remaining = args.seconds - (time.monotonic() - t0)
        if remaining > 0:
            time.sleep(remaining)
        end = _jobs(port)
        final_status = _status(port)
        stop.set()
        for client in clients:
            client.join(30)
    gained = {name: end[name]["trainer_s"] - start.get(name, {}).get("trainer_s", 0.0) for name in end}
    ratio = gained["b"] / gained["a"] if gained["a"] > 0 else None
    expected = weight_b / weight_a
    result = {
        "seconds": round(args.seconds, 1), "weights": [weight_a, weight_b], "quantum_s": args.quantum_s,
        "trainer_s": {name: round(value, 2) for name, value in gained.items()},
        "ratio_b_over_a": round(ratio, 3) if ratio is not None else None, "expected_ratio": expected,
        "ratio_error": round(abs(ratio / expected - 1), 4) if ratio is not None else None,
        "steps": {name: end[name]["global_step"] - start.get(name, {}).get("global_step", 0) for name in end},
        "deficit_s": {name: round(job["deficit_s"], 3) for name, job in end.items()},
        "late_job_submit_exit": ctl.returncode, "late_job_submit_reply": (ctl.stdout or ctl.stderr).strip()[-300:],
        "late_job_started": bool(started), "late_job_start_s": round(late_start_s, 2) if late_start_s else None,
        "requests_ok": results["ok"], "failed_requests": results["failed"],
        "tpot_ms": final_status.get("tpot_ms"), "qos_target_ms": final_status["qos"]["target_tpot_ms"],
        "qos_violation_rate": final_status["qos"]["violation_rate"],
    }
    result["ok"] = bool(result["ratio_error"] is not None and result["ratio_error"] <= 0.10 and started
                        and results["failed"] == 0)
    say(json.dumps(result, indent=2))
    print(json.dumps(result))
    return 0 if result["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
