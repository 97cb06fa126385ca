"""One mode of the GPU co-location experiment (scripts/colocate_gpu.py), start to end:
the trainer hosted beside the decode engine (or not), the requests served under the
mode's step policy, and the mode's result.

Modes: decode-alone, harvest and harvest-tight (built by harvest.colocate.assemble, the
server's composition root, and stepped through ``Colocation.run_step``), static, trainer-
alone and level-graphs (:mod:`.level_graph_check`); scripts/colocate_gpu.py describes each.
Trainer tokens/s counts completed optimizer steps over the mode's wall time; each serving
mode reports whether its steps replayed graphs. ``ctx`` is the experiment's state the
script builds; ``args`` its command line.
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

from harvest.engines.transformers.level_graph_check import measure_level_graphs
from harvest.engines.transformers.model import on_stream
from harvest.engines.transformers.serving import serve, summarize
from harvest.engines.transformers.step_policies import FixedLevel, HarvestMode, static_level_index


SERVING_MODES = ("decode-alone", "harvest", "static", "harvest-tight")
TRAINER_MODES = ("harvest", "static", "trainer-alone", "harvest-tight")
PROFILE_MODES = ("harvest", "harvest-tight")


def target_for(mode: str, args, ctx) -> float:
    if mode != "harvest-tight":
        return args.target_tpot_ms
    tight = ctx["targets"].get("tight")
    if tight is None:
        raise RuntimeError("harvest-tight: no tight target (give --tight-target-tpot-ms, or run decode-alone first "
                           "for --tight-target-factor x its TPOT p50)")
    return tight


def run_mode(mode, args, ctx) -> dict:
    if mode == "level-graphs":
        return measure_level_graphs(args, ctx)
    import torch

    from harvest.colocate import TrainerHost, make_step_timer
    from harvest.schedule import TrainerState

    trainer, partitioner, sink = ctx["trainer"], ctx["partitioner"], ctx["sink"]
    job = Path(f"colocated-lora-{mode}")
    target = target_for(mode, args, ctx)
    colocation = host = None
    if mode in PROFILE_MODES:  # the system the server runs, from the same composition root
        from harvest.colocate.assemble import EngineAdapter, assemble

        engine = EngineAdapter(device=ctx["device"], model_path=args.model_path, model_dtype=ctx["dtype"],
                               build_trainer=lambda _job: trainer, jobs=(job,))
        colocation = assemble(harvest_config(args, target), engine, partitioner=partitioner)
        colocation.start()
        host = colocation.trainer_host
    elif mode != "decode-alone":
        host = TrainerHost([job], build=lambda _job: trainer)
        host.start()
    interrupted = False
    try:
        if host is not None:
            deadline = time.monotonic() + 60
            while host.scheduler_state() is TrainerState.BUILDING and time.monotonic() < deadline:
                time.sleep(0.01)
        before = trainer.stats() if trainer is not None else None  # none built for decode-alone alone
        if ctx["device_type"] == "cuda":
            torch.cuda.reset_peak_memory_stats()
        steps: list = []
        served: dict = {}  # serve()'s result, once it ends
        started = time.perf_counter()
        result = {"target_tpot_ms": round(target, 3)}
        try:
            if mode == "trainer-alone":
                host.apply(True, ctx["alone_stream"])
                try:
                    time.sleep(args.trainer_alone_s)
                    # Its rate counts completed optimizer steps: on until one is in the
                    # window (however slow the device), unless the trainer ended (failed).
                    # Both counters: the trainer updates them one after the other.
                    while host.live and _no_step_since(before, trainer.stats()):
                        time.sleep(0.01)
                finally:
                    host.apply(False)
            else:
                if mode == "decode-alone":
                    policy = FixedLevel(partitioner, partitioner.ladder.whole_device_index, False,
                                        make_step_timer(ctx["device_type"]))
                elif mode == "static":
                    policy = FixedLevel(partitioner, static_level_index(partitioner.ladder), True,
                                        make_step_timer(ctx["device_type"]))
                    host.apply(True, policy.level.trainer_stream)
                else:
                    policy = HarvestMode(colocation)

                def progress(so_far, wall_s):
                    sink.progress(mode, summarize({"wall_s": wall_s, "steps": so_far}, target, len(ctx["requests"])))

                graph_step = ctx.get("graph_step")
                if graph_step is not None:
                    graph_step.graph_steps = graph_step.eager_steps = 0
                served = serve(ctx["requests"], ctx["batch"], policy, args.max_batch_size, steps=steps,
                               on_progress=progress, step=graph_step)
        except KeyboardInterrupt:
            interrupted = True
            result["interrupted"] = True
        wall_s = time.perf_counter() - started
        if mode != "trainer-alone":
            if mode == "decode-alone" and steps and args.tight_target_tpot_ms is None:
                import numpy as np

                p50 = float(np.percentile([s[1] for s in steps], 50)) * 1e3
                ctx["targets"]["tight"] = round(args.tight_target_factor * p50, 3)
            partial = {"wall_s": wall_s, "steps": steps, "unmeasured_steps": served.get("unmeasured_steps")}
            result.update(summarize(partial, target, len(ctx["requests"]), targets=ctx["targets"]))
            result.update(serving_graphs_report(ctx))
            ctx["step_log"][mode] = steps
            if colocation is not None:
                result.update(qos=colocation.step_controller.qos.stats().to_dict(), prediction_error=colocation.refiner.error,
                              control_us_per_step=round(colocation.profiler.summary()["hook_overhead_us_per_step"], 2))
        else:
            result["wall_s"] = round(wall_s, 2)
        after = trainer.stats() if trainer is not None else None  # before the trainer stops: work after wall_s is not counted
        result.update(trainer_tokens_per_s=None, trainer_steps=0)
        if host is not None:
            result.update(trainer_tokens_per_s=round((after.tokens_seen - before.tokens_seen) / wall_s, 1),
                          trainer_steps=after.global_step - before.global_step, trainer_compile=after.compile)
        if ctx["device_type"] == "cuda":
            result["max_memory_gib"] = round(torch.cuda.max_memory_allocated() / 2**30, 2)
        if interrupted:  # written before the trainer's shutdown, which may outlast the kill
            ctx["record_interrupted"](mode, result)
            raise KeyboardInterrupt
    finally:
        timeout_s = 5.0 if interrupted else 60.0
        if colocation is not None:
            colocation.close(trainer_timeout_s=timeout_s)
        elif host is not None:
            host.shutdown(timeout_s=timeout_s)
    if host is not None:
        status = host.status()
        result["trainer_state"] = status.state
        if status.error:
            result["trainer_error"] = status.error
    return result


def _no_step_since(before, now) -> bool:
    """No optimizer step (its tokens counted) completed between two TrainerStats."""
    return now.global_step == before.global_step or now.tokens_seen == before.tokens_seen


def harvest_config(args, target_tpot_ms: float | None = None):
    """The harvest.yaml this run stands for: the QoS target and the profile (jobs are
    built here, not from files)."""
    from harvest.config import HarvestConfig
    from harvest.schedule import SchedulerConfig

    target = args.target_tpot_ms if target_tpot_ms is None else target_tpot_ms
    return HarvestConfig(qos=SchedulerConfig(target_tpot_ms=target), profile=args.profile,
                         allow_profile_mismatch=args.allow_profile_mismatch)


def serving_graphs_report(ctx) -> dict:
    """What a serving mode's decode steps ran: ``graphs`` true when captured graphs were
    replayed (``graph_steps``; ``eager_steps`` ran eagerly for want of one), else why not."""
    step, captured, batch = ctx.get("graph_step"), ctx.get("serving_graphs") or {}, ctx.get("batch")
    paged = getattr(batch, "page_size", None) is not None
    if step is None and not paged:
        return {"graphs": False, "graphs_reason": "--graphs off: the ragged eager batch",
                "decode_engine": "transformers eager, DynamicCache (ragged batch; no CUDA graphs in the serving loop)"}
    buckets = ",".join(map(str, batch.buckets))
    if paged:
        attention = "compiled" if batch.compiled else "eager"
        engine = (f"transformers paged KV batch ({batch.max_batch_size} slots, {batch.num_pages} pages x "
                  f"{batch.page_size} tokens, buckets {buckets}; FlexAttention {attention} over each request's pages), ")
    else:
        engine = f"transformers StaticCache slot batch ({batch.max_batch_size} slots x {batch.max_length} columns, buckets {buckets}), "
    if step is None:
        return {"graphs": False, "graphs_reason": "--graphs off: the paged batch, eager",
                "decode_engine": engine + "eager (no CUDA graphs in the serving loop)"}
    report = {"graphs": step.graph_steps > 0, "graph_steps": step.graph_steps, "eager_steps": step.eager_steps}
    if step.graph_steps:
        report["decode_engine"] = engine + "per-(level, bucket) CUDA graph replayed on the chosen level's stream"
    else:
        report["graphs_reason"] = captured.get("unavailable") or "no graph was replayed"
        report["decode_engine"] = engine + "eager on the chosen level's stream (the graphs' fallback)"
    return report


def warm_up(batch, trainer, partitioner, on_cuda) -> None:
    """First launches on each green context load kernels and create handles: keep them out
    of the timed modes. ``trainer`` None: decode only."""
    import torch

    cap = getattr(batch, "max_context", 32)
    for level in partitioner.ladder.levels:
        with on_stream(level.decode_stream):
            batch.join([-1, -2], [min(16, cap), min(32, cap)])
            for _ in range(min(3, getattr(batch, "max_steps", 3))):
                batch.step()
            batch.leave([-1, -2])
            if hasattr(batch, "warm_buckets"):  # a paged batch: every bucket's attention compiled now, not mid-serving
                batch.warm_buckets()
        if trainer is not None:
            for _ in range(3):
                trainer.run_one_unit(level.trainer_stream)  # None: the current stream (all SMs)
        if on_cuda:
            torch.cuda.synchronize()
    if trainer is not None:
        # One whole optimizer step: every unit kind has run (a compiled trainer compiles its
        # layers' forward and backward graphs here, not in the first timed mode).
        step = trainer.stats().global_step
        while trainer.stats().global_step == step:
            trainer.run_one_unit()
        if on_cuda:
            torch.cuda.synchronize()


def trainer_compile_options(choice: str) -> dict:
    """``--trainer-compile``: harvest.yaml's ``trainer.compile`` (auto | on | off), or
    ``pairs``: compiled, with the training units as explicit compiled pairs on any device
    (harvest.train.compiled_units.compile_layers' ``pairs``)."""
    if choice == "pairs":
        return dict(compile_layers="on", compile_pairs=True)
    return dict(compile_layers=choice, compile_pairs=None)


def set_up_engine(args, ctx, modes) -> None:
    """The decode engine of a run of ``modes``, into ``ctx`` (which holds the device and
    the partitioner): the trace's requests, the model, the decode batch (``--kv paged``:
    the paged batch; else graphs on: the slot batch, graphs off: the ragged one), the
    trainer on the model's weights, the warm-up on every level, and with graphs on the
    serving step's graphs, one per (level, bucket)."""
    from harvest.engines.transformers.captured_graphs import CapturedLevelGraphs
    from harvest.engines.transformers.graph_step import GraphStep, capture_serving_graphs
    from harvest.engines.transformers.model import load_causal_lm
    from harvest.engines.transformers.paged_batch import PagedDecodeBatch
    from harvest.engines.transformers.ragged_batch import RaggedDecodeBatch
    from harvest.engines.transformers.serving import load_requests
    from harvest.engines.transformers.shared_trainer import build_shared_trainer
    from harvest.engines.transformers.static_batch import SlotDecodeBatch
    from harvest.train.microbatch import decode_step_sizing

    device, device_type, dtype, partitioner = ctx["device"], ctx["device_type"], ctx["dtype"], ctx["partitioner"]
    if any(m in SERVING_MODES or m in TRAINER_MODES for m in modes):
        ctx["requests"] = load_requests(args.trace, args.trace_start_s, args.trace_seconds, args.time_scale,
                                        args.max_context, args.max_generated)
    model = ctx["model"] = load_causal_lm(args.model_path, device, dtype, args.random_weights).requires_grad_(False)
    graphs_on = args.graphs == "on" or (args.graphs == "auto" and device_type == "cuda")
    serving = any(m in SERVING_MODES for m in modes)
    ctx["graphs"] = graphs_on and serving
    slots = (model, device, args.max_batch_size, args.max_context, args.max_generated)
    if serving and getattr(args, "kv", "static") == "paged":
        ctx["batch"] = PagedDecodeBatch(*slots, buckets=args.graph_buckets, seed=args.seed, page_size=args.kv_page_size)
    elif graphs_on and serving:
        ctx["batch"] = SlotDecodeBatch(*slots, buckets=args.graph_buckets, seed=args.seed)
    else:
        ctx["batch"] = RaggedDecodeBatch(model, device, seed=args.seed)
    if any(m in TRAINER_MODES for m in modes):
        sizing = None
        if args.trainer_micro_batch is None:  # auto: as a server sizes a job's units (harvest.colocate.assemble)
            sizing = decode_step_sizing(args.unit_step_fraction, args.target_tpot_ms, partitioner.ladder)
        ctx["trainer"] = build_shared_trainer(model, device, lora_rank=args.lora_rank, seq_len=args.trainer_seq_len,
                                              samples_per_step=args.trainer_batch,
                                              micro_batch=args.trainer_micro_batch, seed=args.seed,
                                              **trainer_compile_options(args.trainer_compile), unit_sizing=sizing)
    if any(m != "level-graphs" for m in modes):
        warm_up(ctx["batch"], ctx["trainer"], partitioner, device_type == "cuda")
    if graphs_on and serving:
        print("colocate_gpu: capturing the serving step's graphs ...", file=sys.stderr, flush=True)
        serving_graphs = ctx["serving_graph_set"] = CapturedLevelGraphs(partitioner.ladder.levels)
        ctx["serving_graphs"] = capture_serving_graphs(ctx["batch"], serving_graphs, partitioner.ladder)
        ctx["graph_step"] = GraphStep(ctx["batch"], serving_graphs, partitioner)
        print(f"colocate_gpu: serving graphs: {json.dumps(ctx['serving_graphs'])}", file=sys.stderr, flush=True)
