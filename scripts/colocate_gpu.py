#!/usr/bin/env python3
"""Co-location without SGLang: a transformers decode engine serving a slice of the Azure
trace, with the layer-split LoRA trainer beside it. The last stdout line is one JSON object.

    python scripts/colocate_gpu.py --model-path DIR --random-weights --device cuda \\
        --profile PROFILE.json [--modes decode-alone,harvest,static,trainer-alone] [--out-dir DIR]

Modes, run one after another in one process over the same requests
(harvest.engines.transformers.experiment_modes):
  decode-alone   decode on the whole device, no trainer (the TPOT baseline);
  harvest        the system the SGLang server runs, built by harvest.colocate.assemble
                 (the same composition root) and stepped through Colocation.run_step: the
                 profile's predictor (refined online between trainer units and when
                 idle) and the QoS controller choose the SM level before every step and
                 open or close the trainer's gate; idle gaps give the trainer the most SMs;
  static         StaticMode: the ladder level nearest 60% decode SMs, trainer always on;
  trainer-alone  the trainer alone on the whole device for --trainer-alone-s seconds, and
                 on until it has completed an optimizer step (its rate counts whole steps);
  harvest-tight  harvest under a tight TPOT target (--tight-target-tpot-ms, else
                 --tight-target-factor x decode-alone's TPOT p50 in this run); every
                 serving mode also reports its violation rate at both targets;
  level-graphs   no trace, no trainer: a static-cache decode step's
                 CUDA graph per batch size and ladder level vs eager, vs the graph on the
                 whole GPU (harvest.engines.transformers.level_graph_check).

Results are written as they exist (--out-dir): NAME-<mode>.json when a mode ends,
NAME.json the summary so far ("complete": false until the end), NAME-progress.json what
the running mode has measured, every 2 s. Each file is replaced atomically (--steps-out
too), and when a mode ends its steps and the summary are written before NAME-<mode>.json:
a reader that sees a mode's file sees everything written before it. SIGINT or SIGTERM (a
timeout) ends the run early: the interrupted mode's partial figures and the summary are
written first, the last stdout line is still the summary, and the exit status is 130.

The engine is harvest.engines.transformers: requests and TPOT/ITL (serving), --graphs on
(the default with CUDA) the slot batch whose step is a CUDA graph per (level, bucket)
replayed on the chosen level (static_batch, graph_step, captured_graphs), --graphs off
the ragged eager batch (ragged_batch); --kv paged the paged batch (paged_batch: a step's
attention reads only each request's KV pages). The trainer is harvest's LayerSplitTrainer
on the served model's own weights (shared_trainer), hosted by harvest.colocate.TrainerHost;
its units hold --trainer-micro-batch sequences, or with `auto` as many as fit
--unit-step-fraction of --target-tpot-ms on the trainer's smallest partition, as a server
sizes a job's (the summary's trainer.unit_sizing says what was chosen and why). On a CPU
the ladder is one shared level: the same code paths run (tests/test_gpu_scripts.py, the
tiny model). Nothing here imports sglang or llamafactory.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
import traceback
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# Before CUDA starts: harvest's streams (two per green-context level) need more hardware
# queues than the driver's default 8; 32 is the maximum (harvest.compute.device).
os.environ.setdefault("CUDA_DEVICE_MAX_CONNECTIONS", "32")
ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:  # a source checkout on PYTHONPATH-less runs
    sys.path.insert(0, str(ROOT))

from harvest.engines.transformers.experiment_modes import PROFILE_MODES, harvest_config, run_mode, set_up_engine  # noqa: E402
from harvest.engines.transformers.page_table import check_page_size  # noqa: E402
from harvest.engines.transformers.step_policies import static_level_index  # noqa: E402
from harvest.compute.ladder_planning import levels_argument  # noqa: E402
from harvest.settings import argument  # noqa: E402
from harvest.train.trainer_cpu import TrainerConfig  # noqa: E402

MODES = ("decode-alone", "harvest", "static", "trainer-alone", "harvest-tight", "level-graphs")
DEFAULT_MODES = ("decode-alone", "harvest", "static", "trainer-alone")


# -- results written as they exist -------------------------------------------------------------
def write_atomically(path: Path, text: str) -> None:
    """Replace ``path`` with ``text`` in one step (written beside it, renamed over it): never half a file."""
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(text)
    os.replace(tmp, path)


class ResultSink:
    """Writes results the moment they exist (nothing when ``out_dir`` is None):
    ``NAME-<mode>.json`` when a mode finishes (or is interrupted), ``NAME.json`` the summary
    so far (``complete`` false until the end), ``NAME-progress.json`` what the running mode
    has measured, every few seconds. Each file is replaced atomically."""

    def __init__(self, out_dir: Path | None, name: str, min_interval_s: float = 2.0):
        self.out_dir, self.name, self.min_interval_s = out_dir, name, min_interval_s
        self._last_progress = 0.0
        if out_dir is not None:
            out_dir.mkdir(parents=True, exist_ok=True)

    def _write(self, filename: str, data) -> None:
        if self.out_dir is not None:
            write_atomically(self.out_dir / filename, json.dumps(data, indent=1))

    def progress(self, mode: str, data, force: bool = False) -> None:
        now = time.monotonic()
        if force or now - self._last_progress >= self.min_interval_s:
            self._last_progress = now
            self._write(f"{self.name}-progress.json", {"mode": mode, "at": time.strftime("%H:%M:%S"), "so_far": data})

    def mode_done(self, mode: str, result: dict) -> None:
        """A finished mode's file: last, after its steps and the summary (its reader may read those at once)."""
        self._write(f"{self.name}-{mode}.json", result)

    def summary(self, summary: dict) -> None:
        self._write(f"{self.name}.json", summary)


def _int_list(text: str) -> list[int]:
    values = [int(v) for v in text.split(",") if v.strip()]
    if not values or min(values) < 1:
        raise argparse.ArgumentTypeError(f"{text!r}: positive integers, comma-separated")
    return values


def _micro_batch(text: str) -> int | None:
    """``auto`` (None: sized to the decode step, as a server sizes a job's units) or an integer >= 1."""
    if text == "auto":
        return None
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise argparse.ArgumentTypeError(f"{text!r}: 'auto' or an integer >= 1")
    return value


def _raise_interrupt(signum, frame):
    raise KeyboardInterrupt


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model-path", required=True, help="model directory (config.json; weights unless --random-weights)")
    parser.add_argument("--random-weights", action="store_true", help="build the model from config.json with random weights")
    parser.add_argument("--device", default="cuda", help="cuda, cuda:N or cpu")
    parser.add_argument("--dtype", choices=["auto", "bfloat16", "float32"], default="auto", help="auto: bfloat16 on GPU, float32 on CPU")
    parser.add_argument("--profile", type=Path, default=None, help="latency profile (`harvest profile`) for the harvest modes")
    parser.add_argument("--allow-profile-mismatch", action="store_true", help="use a profile of another device/model/ladder (warns)")
    parser.add_argument("--levels", type=levels_argument, default=5,
                        help="SM ladder levels, or the ladder's decode SM counts comma-separated, as `harvest profile "
                             "--levels` takes them (must match the profile's; default 5)")
    parser.add_argument("--modes", default=",".join(DEFAULT_MODES), help=f"comma-separated, from {', '.join(MODES)}")
    parser.add_argument("--target-tpot-ms", type=float, default=40.0)
    parser.add_argument("--tight-target-tpot-ms", type=float, default=None,
                        help="harvest-tight's target (default: --tight-target-factor x decode-alone's TPOT p50)")
    parser.add_argument("--tight-target-factor", type=float, default=1.25)
    parser.add_argument("--trace", type=Path, default=None, help="Azure-format trace CSV (default: the bundled sample)")
    parser.add_argument("--trace-start-s", type=float, default=0.0)
    parser.add_argument("--trace-seconds", type=float, default=30.0, help="length of the trace window replayed per mode")
    parser.add_argument("--time-scale", type=float, default=1.0, help="factor on arrival times (2: half the rate)")
    parser.add_argument("--max-context", type=int, default=1024, help="cap on a request's context tokens")
    parser.add_argument("--max-generated", type=int, default=128, help="cap on a request's output tokens")
    parser.add_argument("--max-batch-size", type=int, default=48)
    parser.add_argument("--trainer-alone-s", type=float, default=30.0,
                        help="trainer-alone's seconds (then on until an optimizer step completed)")
    parser.add_argument("--lora-rank", type=int, default=16)
    parser.add_argument("--trainer-seq-len", type=int, default=512)
    parser.add_argument("--trainer-batch", type=int, default=4, help="samples per optimizer step")
    parser.add_argument("--trainer-micro-batch", type=_micro_batch, default=2,
                        help="sequences per unit, or auto: sized as a server sizes a job's units, --unit-step-fraction "
                             "of --target-tpot-ms on the trainer's smallest partition (default 2)")
    parser.add_argument("--unit-step-fraction",  # --trainer-micro-batch auto's target, as a server's
                        **argument(TrainerConfig, "unit_step_fraction", yaml_path="trainer.unit_step_fraction"))
    parser.add_argument("--trainer-compile", choices=["auto", "on", "off", "pairs"], default="auto",
                        help="the trainer's decoder layers compiled (harvest.yaml trainer.compile); auto: on with CUDA; "
                             "pairs: on, training units as explicit compiled pairs (harvest.train.compiled_pair) "
                             "on any device")
    parser.add_argument("--graphs", choices=["auto", "on", "off"], default="auto",
                        help="serving modes: on = the slot batch, its step a per-(level, bucket) CUDA graph replayed "
                             "on the chosen level (eager where none: without CUDA); off = the ragged eager batch; "
                             "auto: on with CUDA")
    parser.add_argument("--kv", choices=["static", "paged"], default="static", help="serving modes: static = the slot "
                        "(graphs off: ragged) batch; paged = KV pages, a step's attention reads each request's own only")
    parser.add_argument("--kv-page-size", type=int, default=16, help="--kv paged: tokens per page (a power of two, >= 16 on CUDA)")
    parser.add_argument("--graph-buckets", type=_int_list, default=[8, 16, 32],
                        help="graphs on: batch-size buckets below --max-batch-size (one graph per level and bucket)")
    parser.add_argument("--graph-batch-sizes", type=_int_list, default=[8, 32],
                        help="level-graphs: batch sizes, one graph per (level, batch size)")
    parser.add_argument("--graph-context", type=int, default=512, help="level-graphs: context tokens per request")
    parser.add_argument("--graph-repeats", type=int, default=20, help="level-graphs: timed steps per measurement")
    parser.add_argument("--steps-out", type=Path, default=None, help="write every step of every mode here (JSON)")
    parser.add_argument("--out-dir", type=Path, default=None,
                        help="write NAME.json (summary so far), NAME-<mode>.json and NAME-progress.json here as they exist")
    parser.add_argument("--name", default="colocate", help="file name prefix under --out-dir")
    parser.add_argument("--torch-threads", type=int, default=None,
                        help="CPU intra-op threads (1 is steadier on a small shared machine)")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    modes = [m.strip() for m in args.modes.split(",") if m.strip()]
    unknown = [m for m in modes if m not in MODES]
    if unknown or not modes:
        parser.error(f"--modes: {','.join(unknown) or 'empty'} (choose from {', '.join(MODES)})")
    if any(m in PROFILE_MODES for m in modes) and args.profile is None:
        parser.error("--profile is required for the harvest mode (make one with `harvest profile`)")
    try:
        check_page_size(args.kv_page_size, "cuda" if args.device.startswith("cuda") else "cpu")
    except ValueError as exc:
        parser.error(f"--kv-page-size: {exc}")

    import signal

    import torch

    from harvest.compute import create_partitioner

    device_type = "cuda" if args.device.startswith("cuda") else "cpu"
    if device_type == "cuda" and not torch.cuda.is_available():
        print(f"colocate_gpu: --device {args.device}: no CUDA device here", file=sys.stderr)
        return 2
    signal.signal(signal.SIGTERM, _raise_interrupt)  # a timeout's TERM ends the run as INT does: results first
    device = str(torch.device(args.device, 0) if args.device == "cuda" else torch.device(args.device))
    dtype = args.dtype if args.dtype != "auto" else ("bfloat16" if device_type == "cuda" else "float32")
    torch.manual_seed(args.seed)
    if args.torch_threads is not None:
        torch.set_num_threads(args.torch_threads)
    elif device_type == "cpu":  # as the server does: decode keeps the cores the trainer leaves
        from harvest.colocate.colocation import leave_cores_to_trainer

        leave_cores_to_trainer(harvest_config(args).trainer.cpu_threads)
    sink = ResultSink(args.out_dir, args.name)
    targets = {"target": args.target_tpot_ms}
    if args.tight_target_tpot_ms is not None:
        targets["tight"] = args.tight_target_tpot_ms
    ctx = {"device_type": device_type, "device": device, "dtype": dtype, "step_log": {}, "sink": sink,
           "targets": targets, "requests": [], "trainer": None}
    results: dict = {}
    interrupted = False
    partitioner = None
    started = time.perf_counter()

    def summary(complete: bool, cut: bool = False) -> dict:
        return make_summary(args, ctx, results, complete, interrupted or cut, time.perf_counter() - started)

    def record_interrupted(mode: str, result: dict) -> None:
        results[mode] = result
        write_steps(args.steps_out, ctx["step_log"])
        sink.summary(summary(False, cut=True))
        sink.mode_done(mode, result)  # last: whoever sees it sees the rest

    ctx["record_interrupted"] = record_interrupted

    try:
        partitioner = ctx["partitioner"] = create_partitioner(device, levels=args.levels)
        ctx["alone_stream"] = torch.cuda.Stream(device) if device_type == "cuda" else None
        set_up_engine(args, ctx, modes)
        sink.summary(summary(False))
        for mode in modes:  # a failed mode is recorded; the others still run
            print(f"colocate_gpu: mode {mode} ...", file=sys.stderr, flush=True)
            ctx["live"] = None
            mode_started = time.perf_counter()
            try:  # a bad profile fails the harvest mode only
                results[mode] = run_mode(mode, args, ctx)
            except KeyboardInterrupt:
                if mode not in results:  # cut outside a serving loop (level-graphs, start-up of a mode)
                    record_interrupted(mode, {**(ctx.get("live") or {}), "interrupted": True,
                                              "wall_s": round(time.perf_counter() - mode_started, 2)})
                raise
            except Exception as exc:  # noqa: BLE001
                traceback.print_exc()
                results[mode] = {"error": f"{type(exc).__name__}: {exc}"}
                ctx["batch"].leave(list(ctx["batch"].request_ids))
            write_steps(args.steps_out, ctx["step_log"])
            sink.summary(summary(False))
            sink.mode_done(mode, results[mode])  # last: whoever sees it sees the rest
            print(f"colocate_gpu: {mode}: {json.dumps(results[mode])}", file=sys.stderr, flush=True)
    except KeyboardInterrupt:
        interrupted = True
        print("colocate_gpu: interrupted; writing what was measured", file=sys.stderr, flush=True)
    finally:
        final = summary(complete=not interrupted)
        write_steps(args.steps_out, ctx["step_log"])
        sink.summary(final)  # after the steps: a complete summary means complete steps
        print(json.dumps(final), flush=True)
        if ctx.get("serving_graph_set") is not None:
            if device_type == "cuda":
                torch.cuda.synchronize()
            ctx["serving_graph_set"].close()
        if partitioner is not None:
            partitioner.close()
    if interrupted:
        return 130
    return 1 if any("error" in result for result in results.values()) else 0


def write_steps(path: Path | None, step_log: dict) -> None:
    if path is None:
        return
    fields = ("start_s", "tpot_s", "itl_s", "batch_size", "sum_context", "padded_sum_context", "level", "trainer_ran")
    write_atomically(path, json.dumps({m: [dict(zip(fields, s)) for s in steps] for m, steps in step_log.items()}))


def make_summary(args, ctx, results: dict, complete: bool, interrupted: bool, wall_s: float) -> dict:
    import torch

    partitioner = ctx.get("partitioner")
    trainer = ctx.get("trainer")
    summary = {
        "complete": complete, "interrupted": interrupted, "wall_s": round(wall_s, 1),
        "device": torch.cuda.get_device_name(ctx["device"]) if ctx["device_type"] == "cuda" else "cpu",
        "model": Path(args.model_path).name, "dtype": ctx["dtype"], "engine": "transformers",
        "target_tpot_ms": args.target_tpot_ms, "targets_ms": dict(ctx["targets"]),
        "cuda_device_max_connections": os.environ.get("CUDA_DEVICE_MAX_CONNECTIONS"),
        "profile": str(args.profile) if args.profile else None,
        "serving_graphs_on": ctx.get("graphs"), "serving_graphs": ctx.get("serving_graphs"),
        "kv": {"layout": args.kv, "page_size": args.kv_page_size if args.kv == "paged" else None},
        "trace": {"path": str(args.trace) if args.trace else "bundled sample", "start_s": args.trace_start_s,
                  "seconds": args.trace_seconds, "time_scale": args.time_scale, "requests": len(ctx["requests"]),
                  "max_context": args.max_context, "max_generated": args.max_generated},
        "modes": results,
    }
    if partitioner is not None:
        summary.update(ladder=[(lv.decode_sms, lv.trainer_sms) for lv in partitioner.ladder.levels],
                       partitioner=partitioner.description, static_level=static_level_index(partitioner.ladder))
    if trainer is not None:
        summary["trainer"] = {"lora_rank": args.lora_rank, "seq_len": args.trainer_seq_len,
                              "samples_per_step": args.trainer_batch, "micro_batch": trainer.micro_batch_size,
                              "unit_sizing": trainer.unit_sizing, "weights": "shared with the decode model"}
    rate = {mode: result.get("trainer_tokens_per_s") for mode, result in results.items()}
    for mode, baseline, name in (("harvest", "trainer-alone", "alone"), ("static", "trainer-alone", "alone"),
                                 ("harvest", "static", "static"), ("harvest-tight", "trainer-alone", "alone")):
        if rate.get(mode) is not None and rate.get(baseline):
            summary[f"{mode}_trainer_vs_{name}"] = round(rate[mode] / rate[baseline], 4)
    return summary


if __name__ == "__main__":
    sys.exit(main())
