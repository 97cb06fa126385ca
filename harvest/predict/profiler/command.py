"""`harvest profile`: offline calibration of the latency predictor (Harli (arXiv:2511.11729) §5, §8.8).

For each ladder level: decode steps of the served model over a grid of batch sizes and
context lengths, alone (stage 1) and with the finetune job running on the trainer's side
of the level (stage 2); then fit, write the profile JSON and a PNG report, and print the
fit quality. Interrupted runs resume from ``<out>.partial.jsonl``.
"""

from __future__ import annotations

import math
import sys
from pathlib import Path

from harvest.compute.ladder_planning import DEFAULT_NUM_LEVELS, MAX_LEVELS, levels_argument
from harvest.settings import argument
from harvest.train.trainer_cpu import TrainerConfig

HELP = "measure decode latencies per SM level (alone and beside the trainer) and fit the latency predictor"

TINY_MODELS = ("tiny-llama", "tiny-qwen2")
DEFAULT_BATCH_SIZES = (4, 16, 64)
DEFAULT_CONTEXT_LENGTHS = (64, 128, 256, 512)
DEFAULT_MAX_BATCH_SIZE = 256  # harvest replay's decode instance (harvest.predict.profiler.trace_grid)
DEFAULT_KV_CAPACITY_TOKENS = 160_000


def _join(values) -> str:
    return ",".join(str(v) for v in values)


def _int_list(text: str) -> tuple[int, ...]:
    import argparse

    try:
        values = tuple(int(v) for v in text.split(",") if v.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r}: expected comma-separated integers, e.g. 4,16,64") from None
    if not values or any(v <= 0 for v in values) or len(set(values)) != len(values):
        raise argparse.ArgumentTypeError(f"{text!r}: expected distinct integers > 0")
    return tuple(sorted(values))


def add_arguments(parser) -> None:
    parser.add_argument("--model-path", required=True, help=f"served model directory (or {' / '.join(TINY_MODELS)}: harvest's tiny local models)")
    parser.add_argument("--engine", choices=["auto", "sglang", "transformers"], default="auto", help="decode engine (auto: sglang when installed)")
    parser.add_argument("--graphs", choices=["auto", "on", "off"], default="auto", help="transformers engine: time each decode step as a CUDA graph replayed on the level's stream, as a server runs it (auto: on with CUDA; SGLang's engine uses its own graphs)")
    parser.add_argument("--kv", choices=["static", "paged"], default="static", help="transformers engine: the decode step's KV cache. static (default): a StaticCache with --graphs, else a DynamicCache; a step attends over the whole cache. paged: pages of --kv-page-size tokens with a page table per request (FlexAttention, compiled on CUDA); a step's attention reads only each request's pages")
    parser.add_argument("--kv-page-size", type=int, default=16, help="--kv paged: tokens per KV page (a power of two; at least 16 on CUDA; default 16)")
    parser.add_argument("--tp", type=int, default=1, help="tensor-parallel ranks of the decode instance, as the server's --tp-size (sglang engine; default 1): GPUs 0..N-1, or on a CPU N groups of cores (SGLANG_CPU_OMP_THREADS_BIND, else harvest splits the usable cores)")
    parser.add_argument("--device", default="auto", help="cpu, cuda or cuda:N (auto: cuda when available)")
    parser.add_argument("--dtype", choices=["auto", "float32", "bfloat16", "float16"], default="auto", help="auto: float32 on CPU, bfloat16 on GPU")
    parser.add_argument("--random-weights", action="store_true", help="build the model from config.json with random weights (latency does not depend on them)")
    parser.add_argument("--batch-sizes", type=_int_list, default=None, help=f"decode batch sizes (default {_join(DEFAULT_BATCH_SIZES)}, or chosen by --grid-from-trace)")
    parser.add_argument("--context-lengths", type=_int_list, default=None, help=f"tokens per request (default {_join(DEFAULT_CONTEXT_LENGTHS)}, or chosen by --grid-from-trace)")
    parser.add_argument("--grid-from-trace", type=Path, default=None, metavar="TRACE", help="choose the grid from the decode steps this Azure-format trace produces on one decode instance, as `harvest replay` simulates it (its recorded rate, every policy): batch sizes at the steps' quantiles 0, 1/3, 2/3, 1; context lengths from the smallest and largest step's Σctx and the steps' median tokens per request (at most 12 points); prints the grid and why. --batch-sizes or --context-lengths given with it are kept and the other axis chosen around them; --max-batch-size and --kv-capacity-tokens are the simulated instance's, so no point exceeds them")
    parser.add_argument("--grid-profile", default=None, metavar="PROFILE", help="with --grid-from-trace: the latency profile (JSON, or synthetic-a100) that times the trace's steps (default: the one `harvest replay` picks, else synthetic-a100)")
    parser.add_argument("--max-batch-size", type=int, default=None, help=f"the decode instance's most requests per batch, as `harvest replay --max-batch-size` (with --grid-from-trace default {DEFAULT_MAX_BATCH_SIZE}); a grid with a larger batch size is refused")
    parser.add_argument("--kv-capacity-tokens", type=int, default=None, help=f"the decode instance's KV cache in tokens, as `harvest replay --kv-capacity-tokens` (with --grid-from-trace default {DEFAULT_KV_CAPACITY_TOKENS}); a grid whose largest point (largest batch size x largest context length) holds more is refused")
    parser.add_argument("--warmup", type=int, default=3, help="untimed decode steps per grid point (default 3)")
    parser.add_argument("--repeats", type=int, default=10, help="timed decode steps per grid point (default 10)")
    parser.add_argument("--trim", type=float, default=0.2, help="fraction of slowest and of fastest steps dropped per grid point (default 0.2)")
    parser.add_argument("--levels", type=levels_argument, default=None, help=f"SM ladder levels to ask the partitioner for, 2 to {MAX_LEVELS}, the whole-device level included (default {DEFAULT_NUM_LEVELS}), or the ladder's decode SM counts, comma-separated, as harvest.yaml's `ladder` gives them (e.g. 24,40,56,80,104); a device without SM partitioning (CPU, no green contexts) has one level whatever this says")
    parser.add_argument("--finetune-model", default=None, help="base model of the finetune job (default: the served model)")
    parser.add_argument("--finetune-job", default=None, help="harvest trainer job YAML: co-run with harvest's layer-split trainer instead of plain PEFT")
    parser.add_argument("--lora-rank", type=int, default=8, help="PEFT co-run workload: LoRA rank (default 8)")
    parser.add_argument("--trainer-micro-batch", type=int, default=2, help="PEFT co-run workload: sequences per unit (default 2)")
    parser.add_argument("--trainer-seq-len", type=int, default=128, help="PEFT co-run workload: tokens per sequence (default 128)")
    parser.add_argument("--trainer-alone-s", type=float, default=3.0, help="seconds the finetune workload runs alone per trainer level and phase, after the grid (default 3; re-measured on resume)")
    parser.add_argument("--switch-interval-ms", type=float, default=None, help="Python GIL switch interval during the run (default: unchanged)")
    parser.add_argument("--torch-threads", type=int, default=None, help="decode's torch intra-op threads (default on a CPU: the cores the co-run trainer leaves, as the server runs decode beside a job; on a GPU: torch's)")
    # The co-run trainer's thread gets the CPU share the server will give it: the same
    # setting, declared once in harvest.config (default, bounds, help).
    parser.add_argument("--trainer-cpu-threads", **argument(TrainerConfig, "cpu_threads", yaml_path="trainer.cpu_threads"))
    parser.add_argument("--trainer-nice", **argument(TrainerConfig, "nice", yaml_path="trainer.nice"))
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path, default=None, help="profile JSON (default profiles/<device>-<model>-<engine>.json, -tpN before .json when --tp N > 1)")
    parser.add_argument("--report", type=Path, default=None, help="PNG report (default: the profile path with .png)")
    parser.add_argument("--restart", action="store_true", help="discard an interrupted run's saved grid points instead of resuming")


def _fail(message: str, code: int = 2) -> int:
    print(f"harvest profile: {message}", file=sys.stderr)
    return code


def run(args) -> int:
    from harvest.predict.profiler.measure import MeasureConfig

    try:
        measure = MeasureConfig(args.warmup, args.repeats, args.trim)
    except ValueError as exc:
        return _fail(str(exc))
    if any(given is not None and len(given) < 2 for given in (args.batch_sizes, args.context_lengths)):
        return _fail("stage 1 has three coefficients per level: give at least 2 --batch-sizes and 2 --context-lengths")
    for flag, value in (("--max-batch-size", args.max_batch_size), ("--kv-capacity-tokens", args.kv_capacity_tokens)):
        if value is not None and value < 1:
            return _fail(f"{flag}={value}: must be an integer >= 1")
    if args.grid_profile is not None and args.grid_from_trace is None:
        return _fail(f"--grid-profile {args.grid_profile}: times the steps of --grid-from-trace; give --grid-from-trace TRACE with it")
    if args.switch_interval_ms is not None and args.switch_interval_ms <= 0:
        return _fail(f"--switch-interval-ms={args.switch_interval_ms}: must be > 0")
    if not (math.isfinite(args.trainer_alone_s) and args.trainer_alone_s > 0):
        return _fail(f"--trainer-alone-s={args.trainer_alone_s}: must be a finite number of seconds > 0")
    if args.torch_threads is not None and args.torch_threads <= 0:
        return _fail(f"--torch-threads={args.torch_threads}: must be > 0")
    from harvest.predict.profiler import session
    from harvest.predict.profiler.tp_layout import TensorParallelError, check_engine

    engine = session.resolve_engine(args.engine)
    try:
        check_engine(args.tp, engine)
    except TensorParallelError as exc:
        return _fail(str(exc))
    if args.graphs == "on" and engine != "transformers":
        return _fail(f"--graphs on: the {engine} engine captures its own decode graphs; --graphs is for --engine transformers")
    if args.graphs == "on" and (args.device == "cpu" or not _cuda_available()):
        return _fail(f"--graphs on: decode CUDA graphs need a CUDA device (--device {args.device}: none here)")
    if args.kv == "paged":
        from harvest.engines.transformers.page_table import check_page_size

        if engine != "transformers":
            return _fail(f"--kv paged: for --engine transformers (the {engine} engine pages its own KV cache)")
        try:
            check_page_size(args.kv_page_size, "cpu" if args.device == "cpu" or not _cuda_available() else "cuda")
        except ValueError as exc:
            return _fail(f"--kv-page-size: {exc}")
    model_path = _resolve_model(args.model_path)
    if not (Path(model_path) / "config.json").is_file():
        return _fail(f"--model-path {args.model_path}: no config.json there")
    if args.grid_from_trace is not None:
        from harvest.predict.profiler.trace_grid import TraceGridError

        try:
            what = _grid_from_trace(args, measure)
        except TraceGridError as exc:
            return _fail(str(exc))
    else:
        what = _grid_source(args)
    problem = _check_before_loading(args) or _grid_problem(args, model_path, measure, engine, what)
    if problem is not None:
        return _fail(problem)

    try:
        return session.profile(args, model_path, measure)
    except session.ProfilingFailed as exc:
        return _fail(str(exc), 1)


def _grid_source(args) -> str:
    """Fill the grid axes not given with the defaults; return how a problem with the grid
    names it (the flags and their values)."""
    named = []
    for flag, attr, default in (("--batch-sizes", "batch_sizes", DEFAULT_BATCH_SIZES),
                                ("--context-lengths", "context_lengths", DEFAULT_CONTEXT_LENGTHS)):
        given = getattr(args, attr)
        setattr(args, attr, given or default)
        named.append(f"{flag} {_join(given or default)}" + ("" if given else " (default)"))
    return " x ".join(named)


def _grid_from_trace(args, measure) -> str:
    """Fill ``args``' missing grid axes from the trace's steps (TraceGridError naming the
    file or flag); print the grid and why; return how a problem names it."""
    from harvest.predict.profiler.trace_grid import choose_grid, trace_steps

    # the simulated instance's limits, then the bounds every axis is checked against (a given one too)
    args.max_batch_size = max_batch = args.max_batch_size or DEFAULT_MAX_BATCH_SIZE
    args.kv_capacity_tokens = kv_capacity = args.kv_capacity_tokens or DEFAULT_KV_CAPACITY_TOKENS
    steps = trace_steps(args.grid_from_trace, args.grid_profile, max_batch, kv_capacity)
    choice = choose_grid(steps, measure.warmup_steps + measure.timed_steps + 1, args.batch_sizes, args.context_lengths, kv_capacity)
    args.batch_sizes, args.context_lengths = choice.batch_sizes, choice.context_lengths
    lines = choice.lines(steps)
    print(f"harvest profile: {lines[0]}")
    print("\n".join(lines[1:]))
    return (f"the grid from --grid-from-trace {args.grid_from_trace} (batch sizes {_join(choice.batch_sizes)} x context "
            f"lengths {_join(choice.context_lengths)}; bound it with --max-batch-size/--kv-capacity-tokens)")


def _grid_problem(args, model_path: str, measure, engine: str, what: str) -> str | None:
    """The grid's largest point against --max-batch-size/--kv-capacity-tokens, the model's
    positions and the device's free memory; None when it fits. Loads nothing."""
    from harvest.predict.profiler import grid_capacity
    from harvest.predict.profiler.session import _device, resolve_dtype

    problem = grid_capacity.bounds_problem(args.batch_sizes, args.context_lengths, args.max_batch_size, args.kv_capacity_tokens, what)
    if problem is not None:
        return problem
    config = grid_capacity.read_config(model_path)
    steps = measure.warmup_steps + measure.timed_steps + 1
    problem = grid_capacity.positions_problem(config, args.context_lengths, steps, what)
    if problem is not None:
        return problem
    device = _device(args.device)  # checked by _check_before_loading
    return grid_capacity.memory_problem(
        config, resolve_dtype(args.dtype, device), engine, args.tp, args.batch_sizes, args.context_lengths, steps, device,
        grid_capacity.device_free_bytes(device), what,
    )


def _check_before_loading(args) -> str | None:
    """What would otherwise fail after the model loaded (the co-run workload) or after the
    whole grid ran (writing --out, --report): the device, the workload's flags or job file,
    and the output files. Writes nothing."""
    from harvest.output_paths import file_problem
    from harvest.predict.profiler.corun import CoRunError
    from harvest.predict.profiler.session import ProfilingFailed, _device

    try:
        device = _device(args.device)
    except ProfilingFailed as exc:
        return str(exc)
    for flag, path in (("--out", args.out), ("--report", args.report)):
        problem = None if path is None else file_problem(path)
        if problem is not None:
            return f"{flag} {path} {problem}"
    if args.finetune_job:
        import tempfile

        from harvest.predict.profiler.trainer_workload import load_finetune_job

        try:  # as the workload will load it; its scratch output_dir is not made here
            load_finetune_job(args.finetune_job, device, str(Path(tempfile.gettempdir()) / "harvest-profile-check"))
        except CoRunError as exc:
            return str(exc)
        return None
    if args.finetune_model is not None:
        finetune_model = _resolve_model(args.finetune_model)
        if not (Path(finetune_model) / "config.json").is_file():
            return f"--finetune-model {args.finetune_model}: no config.json there"
    from harvest.predict.profiler.peft_workload import shape_problem

    return shape_problem(args.lora_rank, args.trainer_micro_batch, args.trainer_seq_len)


def _cuda_available() -> bool:
    import torch

    return torch.cuda.is_available()


def _resolve_model(name: str) -> str:
    if name in TINY_MODELS:
        from harvest.tiny_model import TINY_LLAMA, TINY_QWEN2, ensure_tiny_model

        return str(ensure_tiny_model(TINY_LLAMA if name == "tiny-llama" else TINY_QWEN2))
    return name
