#!/usr/bin/env python3
"""Urgent reclaims under bursts of long prompts: reclaim ahead with the auto reserve vs
Harli's fixed reserve alone.

A real SGLang server on the CPU (a decode instance's settings: batch capped, no radix
cache, a small KV pool) with the LoRA job, served the same synthetic trace three times:
steady short requests with, every ``--burst-every-s``, a burst of ``--burst-size`` long
prompts at once (what a decode instance sees when prefill hands over a wave of long
contexts).

1. harvest off: the reference greedy outputs.
2. "ahead": harvest on, ``memory.reserve_tokens: auto`` and ``memory.reclaim_ahead: true``
   (the free target: the reserve plus what SGLang promised its running requests), the
   allocator's work on the lending thread (``memory.lending_thread: true``).
3. "fixed": harvest on, ``memory.reserve_tokens`` fixed at Harli's formula (what ``auto``
   meant before the reserve followed the demand; the value the ahead run started with),
   ``reclaim_ahead: false``, the allocator's work on the scheduler thread: before this
   work.

An urgent reclaim is serving waiting for lent memory (``kv.urgent_reclaims_total`` of
/harvest/status): an allocation or a decode capacity check that had to take lent chunks
back first, or an admission round whose queue head lent memory held back (also counted as
``kv.admissions_held_total``, once per episode; SGLang admits a request only when its KV
fits the free slots, so without harvest's admission hook such a burst waited in the queue
unseen). The last stdout line is one JSON object. Targets: outputs identical, no failed
request, no retraction, ``urgent_reclaims_ahead`` <= 0.1 x ``urgent_reclaims_fixed``.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import json
import re
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

RETRACTION = "KV cache pool is full. Retract requests"  # SGLang's warning when decode runs out of KV


def _get(port, path):
    with urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=10) as response:
        return json.loads(response.read())


def _trace(args) -> list[tuple[float, list[int]]]:
    """(arrival s, prompt ids): a short request every ``--steady-every-s``, and bursts."""
    requests = []
    t = 0.0
    while t < args.duration_s:
        requests.append((t, 24))
        t += args.steady_every_s
    burst_at = args.burst_every_s / 2
    while burst_at < args.duration_s:
        requests += [(burst_at + 0.001 * i, args.burst_prompt_tokens) for i in range(args.burst_size)]
        burst_at += args.burst_every_s
    requests.sort()
    return [(at, [(7 * index + 3 * j) % 400 + 5 for j in range(length)]) for index, (at, length) in enumerate(requests)]


def _replay(srv, trace, args) -> list[tuple[list[int] | None, str | None, float]]:
    """(output ids, error, seconds from arrival to the last token) per request."""
    def one(at, ids):
        delay = at - (time.monotonic() - t0)
        if delay > 0:
            time.sleep(delay)
        started = time.monotonic()
        try:
            out = srv.post("/generate", {"input_ids": ids, "sampling_params": {
                "max_new_tokens": args.max_output, "temperature": 0, "ignore_eos": True}}, timeout=300)
            return out["output_ids"], None, time.monotonic() - started
        except Exception as error:  # noqa: BLE001 - a failed request is a result here
            return None, str(error), time.monotonic() - started

    t0 = time.monotonic()
    with concurrent.futures.ThreadPoolExecutor(max_workers=64) as pool:
        return list(pool.map(lambda request: one(*request), trace))


def _quantile(values, q: float) -> float:
    values = sorted(values)
    return round(values[min(len(values) - 1, int(q * len(values)))], 3)


def _serve(server, base, env, work: Path, name: str, trace, args, config: Path | None):
    extra = ["--enable-harvest", "--harvest-config", str(config)] if config is not None else []
    log_path = work / f"{name}.log"
    with server.launch(base + extra, log_path=log_path, env=env) as srv:
        status = None
        if config is not None:
            port = int(re.search(r"port: (\d+)", config.read_text()).group(1))
            deadline = time.monotonic() + 300
            while time.monotonic() < deadline:
                status = _get(port, "/harvest/status")
                if (status["trainer"]["stats"] or {}).get("global_step", 0) > 0 and status["kv"]["chunks_lent"] > 0:
                    break
                time.sleep(0.5)
            before = _get(port, "/harvest/status")["kv"]
        outputs = _replay(srv, trace, args)
        if config is not None:
            time.sleep(1.0)  # the endpoint's snapshot is up to 0.5 s old
            status = _get(port, "/harvest/status")
            status["kv_before"] = before
    return outputs, status, log_path.read_text(errors="replace")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", action="store_true", help="print only the JSON result line")
    parser.add_argument("--duration-s", type=float, default=120.0, help="length of the trace")
    parser.add_argument("--steady-every-s", type=float, default=0.25, help="one short request this often")
    parser.add_argument("--burst-every-s", type=float, default=6.0, help="a burst this often")
    parser.add_argument("--burst-size", type=int, default=6, help="long prompts per burst")
    parser.add_argument("--burst-prompt-tokens", type=int, default=400, help="tokens of each burst prompt")
    parser.add_argument("--max-output", type=int, default=8)
    parser.add_argument("--kv-tokens", type=int, default=8192, help="KV pool size (--max-total-tokens)")
    parser.add_argument("--max-batch", type=int, default=32, help="--max-running-requests")
    parser.add_argument("--target-tpot-ms", type=float, default=200.0,
                        help="QoS target (generous on a CPU: this measures memory, not step time)")
    args = parser.parse_args()

    from harvest import colocation_config
    from harvest.sglang import server
    from harvest.tiny_model import ensure_tiny_model

    log = (lambda *a: None) if args.json else print
    model = ensure_tiny_model()
    trace = _trace(args)
    work = Path(tempfile.mkdtemp(prefix="harvest-bench-lending-"))
    base = server.cpu_server_args(model, max_total_tokens=args.kv_tokens) + [
        "--max-running-requests", str(args.max_batch), "--disable-radix-cache"]
    env = server.cpu_server_env()

    log(f"[1/3] harvest off: reference outputs ({len(trace)} requests over {args.duration_s:.0f} s)")
    reference, _, _ = _serve(server, base, env, work, "off", trace, args, None)

    runs = {}
    variants = (("ahead", "auto", {"reclaim_ahead": True, "lending_thread": True}),
                ("fixed", None, {"reclaim_ahead": False, "lending_thread": False}))
    for index, (name, reserve, memory) in enumerate(variants, start=2):
        if reserve is None:  # Harli's formula, as the ahead run started with: fixed for this run
            reserve = runs["ahead"]["floor_tokens"]
        log(f"[{index}/3] harvest on ({name}): memory.reserve_tokens: {reserve}, {memory}")
        config = colocation_config.write(work / name, model, target_tpot_ms=args.target_tpot_ms,
                                         metrics_port=server.free_port(),
                                         config_keys={"memory": {"reserve_tokens": reserve, **memory}})
        outputs, status, text = _serve(server, base, env, work, name, trace, args, config)
        kv, before = status["kv"], status["kv_before"]
        burst = [s for (_, ids), (_, _, s) in zip(trace, outputs) if len(ids) == args.burst_prompt_tokens]
        runs[name] = {
            "outputs_identical": [o for o, _, _ in outputs] == [o for o, _, _ in reference],
            "failed_requests": sum(e is not None for _, e, _ in outputs),
            "retractions": text.count(RETRACTION),
            "urgent_reclaims": kv["urgent_reclaims_total"] - before["urgent_reclaims_total"],
            "admissions_held": kv["admissions_held_total"] - before["admissions_held_total"],
            "urgent_reclaim_ms_total": round((kv["urgent_reclaim_s_total"] - before["urgent_reclaim_s_total"]) * 1e3, 2),
            "burst_latency_s_p50": _quantile(burst, 0.5), "burst_latency_s_max": round(max(burst), 3),
            "steady_latency_s_p50": _quantile([s for (_, ids), (_, _, s) in zip(trace, outputs)
                                               if len(ids) != args.burst_prompt_tokens], 0.5),
            "chunks_lent": kv["lends_total"], "chunks_reclaimed": kv["reclaims_total"],
            "lending_thread": kv["lending_thread"], "reclaim_ahead": kv["reclaim_ahead"],
            "reserve_tokens_end": kv["reserve_tokens"], "reserve_reason_end": kv["reserve_reason"],
            "free_target_tokens_end": kv["free_target_tokens"],
            "floor_tokens": before["reserve_tokens"],  # before any traffic: Harli's formula
            "trainer_tokens": status["trainer"]["stats"]["tokens_seen"],
        }

    ahead, fixed = runs["ahead"], runs["fixed"]
    result = {
        "requests": len(trace), "duration_s": args.duration_s,
        "bursts": sum(len(ids) == args.burst_prompt_tokens for _, ids in trace) // max(1, args.burst_size),
        "burst_size": args.burst_size, "burst_prompt_tokens": args.burst_prompt_tokens, "kv_tokens": args.kv_tokens,
        "urgent_reclaims_ahead": ahead["urgent_reclaims"], "urgent_reclaims_fixed": fixed["urgent_reclaims"],
        "urgent_ratio": ahead["urgent_reclaims"] / fixed["urgent_reclaims"] if fixed["urgent_reclaims"] else None,
        "admissions_held_ahead": ahead["admissions_held"], "admissions_held_fixed": fixed["admissions_held"],
        "burst_latency_s_max_ahead": ahead["burst_latency_s_max"],
        "burst_latency_s_max_fixed": fixed["burst_latency_s_max"],
        "runs": runs,
        "targets": {
            "outputs_identical": ahead["outputs_identical"] and fixed["outputs_identical"],
            "no_failed_request": ahead["failed_requests"] == fixed["failed_requests"] == 0,
            "no_retraction": ahead["retractions"] == fixed["retractions"] == 0,
            "urgent_ahead_le_0.1x_fixed": fixed["urgent_reclaims"] > 0
            and ahead["urgent_reclaims"] <= 0.1 * fixed["urgent_reclaims"],
        },
        "work_dir": str(work),
    }
    if not args.json:
        print(json.dumps(result, indent=2))
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
