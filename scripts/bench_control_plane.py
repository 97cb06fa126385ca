#!/usr/bin/env python3
"""Does polling harvest's control endpoint slow decode? One real SGLang server (CPU) with
harvest and the LoRA job, in one run:

- **quiet**: ``--requests`` generate requests (``--concurrency`` at a time), nobody polls;
- **polled**: the same requests while ``--pollers`` clients poll ``/metrics``,
  ``/harvest/status`` and ``/harvest/steps`` in turn, ``--poll-rate`` polls/s in all (the
  hammer: 8 clients and 6000 polls in about 27 s; with the endpoint in the
  scheduler process it took decode p99 from 29.7 to 182.8 ms and 167 of 578 steps over a
  40 ms target). ``--poll-rate 0`` polls flat out.

Phases run quiet, polled, polled, quiet (``--rounds`` times), so that a drift of the
machine (another tenant, thermal) falls on both alike. Decode step times are harvest's
own measurements (``/harvest/steps``, decode steps only, read once after each phase);
violations count steps over the target.

The pollers run in a process of their own at ``--pollers-nice`` (19 by default): they
stand for a Prometheus and dashboards, which run on other machines, and on this 2-core
machine eight clients polling flat out would otherwise take a core from decode however
cheap the endpoint is; what this measures is the endpoint's cost to decode (the
scheduler's GIL, its snapshot, the endpoint process's own CPU, reported as
``endpoint_cpu_ms_per_poll``). ``--pollers-nice 0`` measures them as local neighbours.

The last stdout line is one JSON object. Targets: ``decode_p99_change`` <= 0.10 and
``added_violations`` <= 0 (polled minus quiet, per 1000 decode steps).
"""

from __future__ import annotations

import argparse
import concurrent.futures
import json
import multiprocessing
import statistics
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

POLLED_PATHS = ("/metrics", "/harvest/status", "/harvest/steps")


def _get(port, path, timeout=30):
    with urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=timeout) as response:
        return response.read()


def _status(port):
    return json.loads(_get(port, "/harvest/status"))


def _poll(port, stop, counts, index, interval_s):
    """One polling client (a thread of the pollers' process): a poll every ``interval_s``
    (0: flat out) until ``stop`` is set."""
    served = errors = 0
    latencies = []
    k = index
    next_poll = time.monotonic()
    while not stop.is_set():
        if interval_s:
            next_poll += interval_s
            delay = next_poll - time.monotonic()
            if delay > 0:
                time.sleep(delay)
        path = POLLED_PATHS[k % len(POLLED_PATHS)]
        k += 1
        started = time.perf_counter()
        try:
            _get(port, path)
            served += 1
            latencies.append(time.perf_counter() - started)
        except OSError:
            errors += 1
    counts.put((served, errors, latencies))


def _pollers(port, num_clients, nice, rate):
    """``num_clients`` polling threads in one child process, ``rate`` polls/s in all (0:
    flat out); returns (stop, results queue, process)."""
    context = multiprocessing.get_context("spawn")
    stop, results = context.Event(), context.Queue()
    interval_s = num_clients / rate if rate else 0.0
    process = context.Process(target=_poller_process, args=(port, num_clients, nice, interval_s, stop, results),
                              daemon=True)
    process.start()
    return stop, results, process


def _poller_process(port, num_clients, nice, interval_s, stop, results):
    import os
    import queue
    import threading

    os.nice(nice)
    counts: queue.Queue = queue.Queue()
    threads = [threading.Thread(target=_poll, args=(port, stop, counts, i, interval_s)) for i in range(num_clients)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    served = errors = 0
    latencies = []
    while not counts.empty():
        s, e, lat = counts.get()
        served, errors, latencies = served + s, errors + e, latencies + lat
    results.put((served, errors, latencies))


def _endpoint_pid(srv) -> int:
    """harvest's endpoint process of the server this benchmark runs (not another server's
    on this machine)."""
    pids = srv.processes("harvest.sglang.endpoint_server")
    if len(pids) != 1:
        raise RuntimeError(f"expected one harvest endpoint process, found {sorted(pids)}")
    return pids.pop()


def _cpu_seconds(pid: int) -> float:
    """User + system CPU time of ``pid`` so far."""
    import os

    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _load(srv, args):
    """The generate requests: ``--requests``, ``--concurrency`` at a time; their latencies."""
    def one(index):
        ids = [5 + (index * 7 + j) % 300 for j in range(16 + index % 48)]
        started = time.perf_counter()
        srv.post("/generate", {"input_ids": ids, "sampling_params": {"max_new_tokens": args.max_output, "temperature": 0,
                                                                      "ignore_eos": True}})
        return time.perf_counter() - started

    with concurrent.futures.ThreadPoolExecutor(args.concurrency) as pool:
        return list(pool.map(one, range(args.requests)))


def _phase(srv, port, args, polled):
    before = _status(port)
    seq = json.loads(_get(port, "/harvest/steps?limit=1"))["steps"]
    since = seq[-1]["seq"] if seq else 0
    poll = _pollers(port, args.pollers, args.pollers_nice, args.poll_rate) if polled else None
    endpoint_cpu = _cpu_seconds(_endpoint_pid(srv))
    started = time.monotonic()
    request_s = _load(srv, args)
    elapsed = time.monotonic() - started
    endpoint_cpu = _cpu_seconds(_endpoint_pid(srv)) - endpoint_cpu
    polls = None
    if poll is not None:
        stop, results, process = poll
        stop.set()
        served, errors, latencies = results.get(timeout=120)
        process.join(timeout=30)
        polls = {"served": served, "errors": errors, "per_s": served / elapsed, "endpoint_cpu_s": endpoint_cpu,
                 "p50_ms": statistics.median(latencies) * 1e3 if latencies else None}
    time.sleep(1.5)  # the endpoint serves a snapshot up to metrics.publish_interval_s old
    after = _status(port)
    steps = json.loads(_get(port, f"/harvest/steps?since_seq={since}"))["steps"]
    decode_ms = [s["measured_ms"] for s in steps if s["is_decode"]]
    trainer = lambda status: (status["trainer"]["stats"] or {}).get("global_step", 0)  # noqa: E731
    return {"polled": polled, "seconds": elapsed, "decode_ms": decode_ms, "request_s": request_s, "polls": polls,
            "trainer_steps": trainer(after) - trainer(before),
            "backoffs": after["qos"]["num_backoffs"] - before["qos"]["num_backoffs"]}


def _summary(phases, target_ms):
    from harvest.metrics.percentile import nearest_rank

    decode = [ms for phase in phases for ms in phase["decode_ms"]]
    requests = [s for phase in phases for s in phase["request_s"]]
    seconds = sum(phase["seconds"] for phase in phases)
    violations = sum(ms > target_ms for ms in decode)
    return {
        "decode_steps": len(decode),
        "decode_p50_ms": round(statistics.median(decode), 3) if decode else None,
        "decode_p99_ms": round(nearest_rank(decode, 0.99), 3) if decode else None,
        "violations": violations,
        "violations_per_1000_steps": round(1000 * violations / len(decode), 2) if decode else None,
        "request_p50_s": round(statistics.median(requests), 3),
        "request_p99_s": round(nearest_rank(requests, 0.99), 3),
        "trainer_steps_per_s": round(sum(phase["trainer_steps"] for phase in phases) / seconds, 2),
        "qos_backoffs": sum(phase["backoffs"] for phase in phases),
        "phase_p99_ms": [round(nearest_rank(phase["decode_ms"], 0.99), 3) for phase in phases if phase["decode_ms"]],
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", action="store_true", help="print only the JSON result line")
    parser.add_argument("--requests", type=int, default=300, help="generate requests per phase")
    parser.add_argument("--concurrency", type=int, default=16)
    parser.add_argument("--max-output", type=int, default=24)
    parser.add_argument("--pollers", type=int, default=8)
    parser.add_argument("--poll-rate", type=float, default=250.0,
                        help="polls per second, all pollers together (0: flat out); 250: the default hammer "
                             "(6000 polls in about 27 s), itself far above a Prometheus (one scrape per 15 s) plus "
                             "dashboards")
    parser.add_argument("--pollers-nice", type=int, default=19,
                        help="the pollers' nice value (19: as clients on other machines; 0: as local neighbours)")
    parser.add_argument("--rounds", type=int, default=2, help="rounds of quiet, polled, polled, quiet")
    parser.add_argument("--target-tpot-ms", type=float, default=40.0)
    args = parser.parse_args()

    from harvest import colocation_config
    from harvest.sglang import server
    from harvest.tiny_model import ensure_tiny_model

    log = (lambda *a: None) if args.json else print
    model = ensure_tiny_model()
    work = Path(tempfile.mkdtemp(prefix="harvest-bench-control-"))
    port = server.free_port()
    config = colocation_config.write(work / "harvest", model, target_tpot_ms=args.target_tpot_ms, metrics_port=port)
    server_args = server.cpu_server_args(model) + ["--disable-radix-cache", "--enable-harvest", "--harvest-config", str(config)]
    log(f"starting the server (log {work / 'sglang.log'})")
    with server.launch(server_args, log_path=work / "sglang.log") as srv:
        deadline = time.monotonic() + 180
        while (_status(port)["trainer"]["stats"] or {}).get("global_step", 0) == 0 and time.monotonic() < deadline:
            time.sleep(0.5)
        _load(srv, argparse.Namespace(**{**vars(args), "requests": 32}))  # warm the server up
        phases = []
        for round_index in range(args.rounds):
            for polled in (False, True, True, False):
                phase = _phase(srv, port, args, polled)
                phases.append(phase)
                log(f"round {round_index + 1} {'polled' if polled else 'quiet '}: {len(phase['decode_ms'])} decode steps, "
                    f"{phase['seconds']:.1f} s" + (f", {phase['polls']['served']} polls" if polled else ""))
        final = _status(port)
    quiet = _summary([p for p in phases if not p["polled"]], args.target_tpot_ms)
    polled = _summary([p for p in phases if p["polled"]], args.target_tpot_ms)
    polls = [p["polls"] for p in phases if p["polled"]]
    result = {
        "benchmark": "control_plane",
        "target_tpot_ms": args.target_tpot_ms,
        "requests_per_phase": args.requests,
        "pollers": args.pollers,
        "pollers_nice": args.pollers_nice,
        "poll_rate_asked": args.poll_rate,
        "quiet": quiet,
        "polled": polled,
        "polls_served": sum(p["served"] for p in polls),
        "poll_errors": sum(p["errors"] for p in polls),
        "polls_per_s": round(statistics.median(p["per_s"] for p in polls), 1),
        "poll_p50_ms": round(statistics.median(p["p50_ms"] for p in polls if p["p50_ms"] is not None), 2),
        "endpoint_cpu_ms_per_poll": round(1e3 * sum(p["endpoint_cpu_s"] for p in polls)
                                          / max(1, sum(p["served"] for p in polls)), 3),
        "decode_p99_change": round(polled["decode_p99_ms"] / quiet["decode_p99_ms"] - 1, 4),
        "added_violations_per_1000_steps": round(polled["violations_per_1000_steps"] - quiet["violations_per_1000_steps"], 2),
        "trainer_error": final["trainer"]["error"],
    }
    result["ok"] = result["decode_p99_change"] <= 0.10 and result["added_violations_per_1000_steps"] <= 0 \
        and result["poll_errors"] == 0
    if not args.json:
        print(json.dumps({k: v for k, v in result.items() if k not in ("quiet", "polled")}, indent=1))
        print("quiet ", json.dumps(quiet))
        print("polled", json.dumps(polled))
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
