"""`harvest demo` (what `make demo` runs): harvest's plugin on a live SGLang server, on CPU.

Builds the tiny local model, starts an SGLang decode server (``--disaggregation-mode
decode`` with the fake transfer backend, the way harvest is deployed) with harvest's
plugin loaded, replays a time-scaled slice of the Azure conversation trace against it,
and prints what was served. Co-location itself (KV lending, SM partitioning, the
co-located trainer) is not enabled yet: the report says so rather than pretending.
"""

from __future__ import annotations

import concurrent.futures
import statistics
import sys
import tempfile
import time
from pathlib import Path

HELP = "serve a slice of the Azure trace through SGLang + harvest on a tiny local model (CPU)"

NOT_YET_ENABLED = (
    "unified KV/trainer allocator (KV lending)",
    "green-context SM partitioning",
    "latency predictor and QoS scheduler",
    "co-located LoRA trainer",
)


def add_arguments(parser) -> None:
    parser.add_argument("--requests", type=int, default=24, help="trace requests to replay (default 24)")
    parser.add_argument("--time-scale", type=float, default=0.05, help="multiply trace inter-arrival times (default 0.05)")
    parser.add_argument("--max-context", type=int, default=96, help="cap context tokens per request (tiny model; default 96)")
    parser.add_argument("--max-output", type=int, default=24, help="cap generated tokens per request (default 24)")
    parser.add_argument("--trace", type=Path, default=None, help="trace CSV (default: ../shared/traces or the bundled sample)")


def run(args) -> int:
    from harvest.replay.trace import FULL_TRACE, SAMPLE_TRACE, TraceError, read_trace
    from harvest.sglang import server
    from harvest.tiny_model import TINY_LLAMA, ensure_tiny_model

    if args.requests <= 0 or args.time_scale < 0 or args.max_context <= 0 or args.max_output <= 0:
        print("harvest demo: --requests, --max-context and --max-output must be > 0, --time-scale >= 0", file=sys.stderr)
        return 2
    trace_path = args.trace or (FULL_TRACE if FULL_TRACE.is_file() else SAMPLE_TRACE)
    try:
        trace = read_trace(trace_path, limit=args.requests)
    except (OSError, TraceError) as exc:
        print(f"harvest demo: {exc}", file=sys.stderr)
        return 2

    print(f"[1/3] building the tiny model (cached after the first run)")
    model_path = ensure_tiny_model(TINY_LLAMA)
    log_path = Path(tempfile.mkdtemp(prefix="harvest-demo-")) / "sglang.log"
    print(f"[2/3] starting SGLang decode instance on CPU (log: {log_path})")
    started = time.monotonic()
    with server.launch(server.cpu_server_args(model_path, decode_instance=True), log_path=log_path) as srv:
        print(f"      up in {time.monotonic() - started:.1f}s at {srv.base_url}")
        plugin_loaded = "harvest plugin loaded" in srv.log_path.read_text(errors="replace")
        print(f"[3/3] replaying {len(trace)} requests from {trace_path.name} (time x{args.time_scale})")
        results = _replay(srv, trace, args)
    _report(results, plugin_loaded)
    return 0 if all(r["ok"] for r in results) else 1


def _replay(srv, trace, args) -> list[dict]:
    from sglang.srt.disaggregation.utils import FAKE_BOOTSTRAP_HOST

    def one(index, request):
        delay = request.arrival_s * args.time_scale - (time.monotonic() - t0)
        if delay > 0:
            time.sleep(delay)
        num_context = max(1, min(request.context_tokens, args.max_context))
        num_output = max(1, min(request.generated_tokens, args.max_output))
        payload = {
            "input_ids": [(7 * index + 3 * j) % 400 + 5 for j in range(num_context)],
            "sampling_params": {"max_new_tokens": num_output, "temperature": 0, "ignore_eos": True},
            # Decode instance: the KV "arrives" from a prefill instance through the fake backend.
            "bootstrap_host": FAKE_BOOTSTRAP_HOST,
            "bootstrap_room": index,
        }
        sent = time.monotonic()
        try:
            out = srv.post("/generate", payload)
        except Exception as exc:  # noqa: BLE001 - a failed request is a result to report
            return {"ok": False, "error": str(exc)}
        latency = time.monotonic() - sent
        tokens = out["meta_info"]["completion_tokens"]
        return {"ok": tokens == num_output, "latency_s": latency, "tokens": tokens,
                "tpot_ms": 1000 * latency / max(tokens, 1)}

    t0 = time.monotonic()
    with concurrent.futures.ThreadPoolExecutor(max_workers=16) as pool:
        return list(pool.map(lambda item: one(*item), enumerate(trace)))


def _report(results: list[dict], plugin_loaded: bool) -> None:
    served = [r for r in results if r["ok"]]
    print()
    print("harvest demo report")
    print(f"  requests served      {len(served)}/{len(results)}")
    if served:
        tpot = sorted(r["tpot_ms"] for r in served)
        p99 = tpot[min(len(tpot) - 1, round(0.99 * (len(tpot) - 1)))]
        print(f"  tokens generated     {sum(r['tokens'] for r in served)}")
        print(f"  TPOT p50 / p99       {statistics.median(tpot):.1f} / {p99:.1f} ms  (request latency / output tokens)")
    for r in results:
        if not r["ok"]:
            print(f"  failed: {r.get('error', 'wrong token count')}")
    print(f"  harvest plugin       {'loaded in the server' if plugin_loaded else 'NOT loaded (check the entry point)'}")
    print("  not yet enabled:     " + "; ".join(NOT_YET_ENABLED))
