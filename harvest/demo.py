"""`harvest demo` (what `make demo` runs): co-location on a live SGLang decode server.

Builds the tiny local model, writes a LoRA job and harvest.yaml (harvest.colocation_config),
starts an SGLang decode instance (``--disaggregation-mode decode``, fake KV transfer) with
``--enable-harvest``, lets the trainer start in lent KV memory, replays a time-scaled slice
of the Azure conversation trace, and reports: requests served, TPOT p50/p99 against the
target, violations, trainer steps and tokens/s, KV chunks lent and reclaimed, decisions by
level; plus a PNG timeline (batch size, step latency vs target, trainer on/off, memory
lent). ``--model-path`` serves another model (its own profile: ``--profile``).
"""

from __future__ import annotations

import concurrent.futures
import json
import math
import statistics
import sys
import tempfile
import threading
import time
import urllib.request
import warnings
from pathlib import Path

from harvest.metrics.percentile import nearest_rank

HELP = "co-locate a LoRA job with an SGLang decode server on a slice of the Azure trace (CPU by default)"


def add_arguments(parser) -> None:
    from harvest.replay.trace import TRACE_HELP  # standard library only: cheap

    parser.add_argument("--requests", type=int, default=120, help="trace requests to replay (default 120)")
    parser.add_argument("--time-scale", type=float, default=0.02, help="multiply trace inter-arrival times (default 0.02)")
    parser.add_argument("--max-context", type=int, default=256, help="cap context tokens per request (default 256)")
    parser.add_argument("--max-output", type=int, default=32, help="cap generated tokens per request (default 32)")
    parser.add_argument("--target-tpot-ms", type=float, default=40.0, help="QoS target per decode step (default 40)")
    parser.add_argument("--trace", type=Path, default=None, help=TRACE_HELP + " (--requests takes its first N)")
    parser.add_argument("--model-path", type=Path, default=None, help="model to serve (default: the tiny local Llama)")
    parser.add_argument("--profile", type=Path, default=None, help="latency profile for --model-path")
    parser.add_argument("--out-dir", type=Path, default=Path("out/demo"), help="where the report and PNG go (default out/demo)")


def run(args) -> int:
    from harvest import colocation_config
    from harvest.replay.trace import SAMPLE_TRACE, TraceError, read_trace
    from harvest.sglang import server
    from harvest.tiny_model import TINY_LLAMA, ensure_tiny_model

    problem = _check_arguments(args)
    if problem is not None:
        print(f"harvest demo: {problem}", file=sys.stderr)
        return 2
    trace_path = args.trace or SAMPLE_TRACE
    try:
        trace = read_trace(trace_path, limit=args.requests)
    except (OSError, TraceError) as exc:
        print(f"harvest demo: {exc}", file=sys.stderr)
        return 2

    print("[1/4] model: " + ("building the tiny local Llama (cached after the first run)" if args.model_path is None else str(args.model_path)))
    model_path = args.model_path or ensure_tiny_model(TINY_LLAMA)
    work = Path(tempfile.mkdtemp(prefix="harvest-demo-"))
    port = server.free_port()
    extra = {} if args.profile is None else {"profile": args.profile.resolve()}
    config = colocation_config.write(work / "harvest", model_path, target_tpot_ms=args.target_tpot_ms, metrics_port=port, **extra)
    print(f"[2/4] starting an SGLang decode instance with --enable-harvest (config {config}, log {work / 'sglang.log'})")
    started = time.monotonic()
    launch_args = server.cpu_server_args(model_path, decode_instance=True) + ["--enable-harvest", "--harvest-config", str(config)]
    with server.launch(launch_args, log_path=work / "sglang.log") as srv:
        print(f"      up in {time.monotonic() - started:.1f}s; harvest metrics at http://127.0.0.1:{port}/metrics")
        print("[3/4] waiting for the trainer to start in lent KV memory")
        first = _wait_for_trainer(port)
        print(f"      trainer running: {first['kv']['chunks_lent']} KV chunks lent, step {first['trainer']['stats']['global_step']}")
        print(f"[4/4] replaying {len(trace)} requests from {trace_path.name} (time x{args.time_scale})")
        timeline: list = []
        replay_start = time.time()
        results = _replay(srv, trace, args, port, timeline)
        time.sleep(1.0)
        final = _get(port, "/harvest/status")
        steps = [s for s in _get(port, "/harvest/steps?limit=8192")["steps"] if s["time_s"] >= replay_start]
    args.out_dir.mkdir(parents=True, exist_ok=True)
    png = _plot(steps, timeline, args.target_tpot_ms, args.out_dir / "timeline.png")
    report = _report(results, first, final, steps, args.target_tpot_ms)
    (args.out_dir / "report.json").write_text(json.dumps(report, indent=2))
    _print_report(report, png, args.out_dir / "report.json")
    return 0 if report["failed_requests"] == 0 else 1


def _check_arguments(args) -> str | None:
    """Everything the demo would otherwise find wrong once its server is up (or, for
    --out-dir, after the replay): each flag named with its value. Writes nothing."""
    from harvest.output_paths import folder_problem

    for flag, value in (("--requests", args.requests), ("--max-context", args.max_context),
                        ("--max-output", args.max_output), ("--target-tpot-ms", args.target_tpot_ms)):
        if not (math.isfinite(value) and value > 0):
            return f"{flag}={value!r}: must be a finite number > 0"
    if not (math.isfinite(args.time_scale) and args.time_scale >= 0):
        return f"--time-scale={args.time_scale!r}: must be a finite number >= 0"
    if args.model_path is not None and args.profile is None:
        return "--model-path needs --profile (run `harvest profile` for that model first)"
    if args.model_path is not None and not (args.model_path / "config.json").is_file():
        return f"--model-path {args.model_path}: no config.json there"
    if args.profile is not None:
        from harvest.predict.schema import Profile, ProfileError

        try:
            Profile.load(args.profile)
        except ProfileError as exc:  # names the file and the JSON path
            return f"--profile {exc}"
    problem = folder_problem(args.out_dir)
    return None if problem is None else f"--out-dir {args.out_dir} {problem}"


def _get(port: int, path: str) -> dict:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=10) as response:
        return json.loads(response.read())


def _wait_for_trainer(port: int, timeout_s: float = 180.0) -> dict:
    deadline = time.monotonic() + timeout_s
    while True:
        status = _get(port, "/harvest/status")
        trainer = status["trainer"] or {}
        if trainer.get("state") == "failed":
            raise RuntimeError(f"the trainer failed to start: {trainer.get('error')}")
        if (trainer.get("stats") or {}).get("global_step", 0) > 0 or time.monotonic() > deadline:
            return status
        time.sleep(0.5)


def _replay(srv, trace, args, port: int, timeline: list) -> list[dict]:
    with warnings.catch_warnings():
        # Importing SGLang loads its quantization modules, which warn that their kernels
        # need a GPU: noise in the demo's output (the server itself logs them already).
        warnings.filterwarnings("ignore", message="Only CUDA", category=UserWarning)
        from sglang.srt.disaggregation.utils import FAKE_BOOTSTRAP_HOST

    stop = threading.Event()

    def poll():
        while not stop.is_set():
            try:
                status = _get(port, "/harvest/status")
                timeline.append((time.time(), status["kv"]["chunks_lent"], status["kv"]["tokens_per_chunk"]))
            except OSError:
                pass
            stop.wait(0.2)

    def one(index, request):
        delay = request.arrival_s * args.time_scale - (time.monotonic() - t0)
        if delay > 0:
            time.sleep(delay)
        num_output = max(2, min(request.generated_tokens, args.max_output))
        payload = {
            "input_ids": [(7 * index + 3 * j) % 400 + 5 for j in range(max(1, min(request.context_tokens, args.max_context)))],
            "sampling_params": {"max_new_tokens": num_output, "temperature": 0, "ignore_eos": True},
            "bootstrap_host": FAKE_BOOTSTRAP_HOST, "bootstrap_room": index,  # KV "arrives" from a prefill instance
        }
        sent = time.monotonic()
        try:
            out = srv.post("/generate", payload)
        except Exception as exc:  # noqa: BLE001 - a failed request is a result to report
            return {"ok": False, "error": str(exc)}
        return {"ok": out["meta_info"]["completion_tokens"] == num_output, "latency_s": time.monotonic() - sent,
                "tokens": out["meta_info"]["completion_tokens"]}

    poller = threading.Thread(target=poll, daemon=True)
    poller.start()
    t0 = time.monotonic()
    try:
        with concurrent.futures.ThreadPoolExecutor(max_workers=64) as pool:
            return list(pool.map(lambda item: one(*item), enumerate(trace)))
    finally:
        stop.set()
        poller.join()


def _report(results, first, final, steps, target_ms) -> dict:
    decode_ms = [s["measured_ms"] for s in steps if s["is_decode"]]  # TPOT: decode steps only (a decode instance has no others)
    trainer_first, trainer_final = first["trainer"]["stats"], final["trainer"]["stats"] or {}
    return {
        "requests": len(results),
        "requests_served": sum(r["ok"] for r in results),
        "failed_requests": sum(not r["ok"] for r in results),
        "tokens_generated": sum(r.get("tokens", 0) for r in results),
        "qos_target_ms": target_ms,
        "decode_steps": len(decode_ms),
        "tpot_p50_ms": statistics.median(decode_ms) if decode_ms else None,
        "tpot_p99_ms": nearest_rank(decode_ms, 0.99) if decode_ms else None,
        "qos_violations": sum(ms > target_ms for ms in decode_ms),
        "trainer_steps": trainer_final.get("global_step", 0) - trainer_first["global_step"],
        "trainer_tokens": trainer_final.get("tokens_seen", 0) - trainer_first["tokens_seen"],
        "trainer_tokens_per_s": trainer_final.get("tokens_per_s"),
        "trainer_loss": trainer_final.get("loss"),
        "kv_chunks_lent_now": final["kv"]["chunks_lent"],
        "kv_lends_total": final["kv"]["lends_total"],
        "kv_reclaims_total": final["kv"]["reclaims_total"],
        "decisions_by_level": final["qos"]["decisions_by_level"],
        "ladder": final["level"].get("ladder"),  # absent from a server older than the field
        "decisions_by_reason": {k: v for k, v in final["qos"]["decisions_by_reason"].items() if v},
        "sm_partitioning": final["level"]["partitioner"],
    }


def _print_report(report: dict, png: Path | None, json_path: Path) -> None:
    print()
    print("harvest demo report")
    print(f"  requests served      {report['requests_served']}/{report['requests']} ({report['tokens_generated']} tokens)")
    if report["tpot_p50_ms"] is not None:
        print(f"  decode step (TPOT)   p50 {report['tpot_p50_ms']:.1f} ms, p99 {report['tpot_p99_ms']:.1f} ms, target {report['qos_target_ms']:.0f} ms;"
              f" violations {report['qos_violations']}/{report['decode_steps']} steps")
    loss = report["trainer_loss"]
    print(f"  trainer              {report['trainer_steps']} steps, {report['trainer_tokens']} tokens during the replay"
          f" ({report['trainer_tokens_per_s'] or 0:.0f} tokens/s while running), loss {'n/a' if loss is None else f'{loss:.4g}'}")
    print(f"  KV memory            {report['kv_lends_total']} chunks lent, {report['kv_reclaims_total']} reclaimed, {report['kv_chunks_lent_now']} lent now")
    legend = level_legend(report.get("ladder"))
    print(f"  decisions by level   {report['decisions_by_level']}" + (f"  ({legend})" if legend else ""))
    print(f"  decisions by reason  {report['decisions_by_reason']}")
    print(f"  SM partitioning      {report['sm_partitioning']}")
    print(f"  report               {json_path}" + (f"; timeline {png}" if png else ""))


def level_legend(ladder: dict | None) -> str | None:
    """What each level index of ``decisions by level`` means, from the server's ladder (its
    ``to_dict`` form); None when the server does not report one."""
    from harvest.ladder import Ladder, LadderError

    try:
        parsed = Ladder.from_dict(ladder)
    except LadderError:
        return None
    whole = parsed.whole_device_index
    if not parsed.spatial:
        return f"{whole} = decode and the trainer share the whole device; decisions that pause the trainer count there too"
    splits = ", ".join(f"{index} = decode {level.decode_sms}/trainer {level.trainer_sms} SMs"
                       for index, level in enumerate(parsed.levels) if index != whole)
    return f"{splits}; {whole} = decode has the whole device, trainer paused"


def _plot(steps, timeline, target_ms, path: Path) -> Path | None:
    if not steps:
        return None
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    t0 = steps[0]["time_s"]
    t = [s["time_s"] - t0 for s in steps]
    fig = Figure(figsize=(11, 8), tight_layout=True)
    FigureCanvasAgg(fig)
    ax1, ax2, ax3, ax4 = fig.subplots(4, 1, sharex=True)
    ax1.plot(t, [s["batch_size"] for s in steps], drawstyle="steps-post", color="tab:blue")
    ax1.set_ylabel("batch size")
    ax2.plot(t, [s["measured_ms"] for s in steps], ".", markersize=2, color="tab:green", label="measured")
    ax2.axhline(target_ms, color="tab:red", linestyle="--", label=f"target {target_ms:.0f} ms")
    ax2.set_ylabel("decode step (ms)")
    ax2.legend(loc="upper right")
    ax3.plot(t, [1 if s["trainer_ran"] else 0 for s in steps], drawstyle="steps-post", color="tab:orange")
    ax3.set_yticks([0, 1], ["paused", "running"])
    ax3.set_ylabel("trainer")
    if timeline:
        ax4.plot([x[0] - t0 for x in timeline], [x[1] * x[2] for x in timeline], drawstyle="steps-post", color="tab:purple")
    ax4.set_ylabel("KV tokens lent")
    ax4.set_xlabel("time (s)")
    fig.suptitle("harvest demo: decode steps and the co-located trainer")
    fig.savefig(path, dpi=110)
    return path
