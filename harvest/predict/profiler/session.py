"""One `harvest profile` run, from parsed arguments to profile + report on disk.

Set-up order matters for resuming: everything that decides what a grid point measures
(the run identity) is known before the engine and the workload are built, so a saved
run made with other settings is refused in seconds, not after loading two models.
"""

from __future__ import annotations

import dataclasses
import sys
from pathlib import Path

from harvest.compute import create_partitioner
from harvest.compute.device import device_identity
from harvest.logs import get_logger
from harvest.predict.buckets import BatchSizeBuckets
from harvest.predict.calibrate import build_profile, describe_fit
from harvest.predict.fit import FitError
from harvest.predict.profiler import provenance
from harvest.predict.profiler.corun import CoRunError
from harvest.predict.profiler.engines import BaseDecodeEngine, EngineConfig, EngineError
from harvest.predict.profiler.measure import MeasureConfig, MeasurementError, timer_for
from harvest.predict.profiler.partial import PartialRun, PartialRunError, grid_key, partial_path
from harvest.predict.profiler.plot import write_plot
from harvest.predict.profiler.runner import plan_points, run_grid
from harvest.predict.profiler.tp_layout import TensorParallelError, check_gpus, cpu_core_groups, format_threads_bind
from harvest.predict.profiler.trainer_alone import measure_section
from harvest.predict.schema import FinetuneIdentity, Grid, MeasurementSettings, MemorySection, ProfileError
from harvest.train import trainer_cpu

logger = get_logger(__name__)


class ProfilingFailed(RuntimeError):
    """The run cannot go on; the message says why and what to do."""


def _device(requested: str) -> str:
    import torch

    if requested == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    if requested.startswith("cuda") and not torch.cuda.is_available():
        raise ProfilingFailed(f"--device {requested}: no CUDA device is available")
    if requested != "cpu" and not requested.startswith("cuda"):
        raise ProfilingFailed(f"--device {requested!r}: one of auto, cpu, cuda, cuda:N")
    return requested


def resolve_dtype(requested: str, device: str) -> str:
    """The dtype ``--dtype`` names (auto: float32 on a CPU, bfloat16 on a GPU)."""
    if requested != "auto":
        return requested
    return "float32" if device == "cpu" else "bfloat16"


def levels_note(requested: int | tuple[int, ...] | None, ladder) -> str | None:
    """Why ``ladder`` does not have the ``--levels`` asked for (a number of levels, or
    decode SM counts); None when it does or none were asked for. The run goes on: a device
    without SM partitioning still profiles."""
    if requested is None:
        return None
    if isinstance(requested, int):
        if ladder.num_levels == requested:
            return None
        asked, realised = str(requested), f"{ladder.num_levels} distinct levels"
    else:
        partial = {level.decode_sms for level in ladder.levels if level.trainer_sms > 0}
        if ladder.spatial and partial == set(requested) - {ladder.total_sms}:
            return None
        asked, realised = ",".join(map(str, requested)), "other levels"
    if not ladder.spatial:
        why = f" ({ladder.note})" if ladder.note else ""
        return (f"--levels {asked} does not apply to this device: no SM partitioning{why}; the profile has one "
                "level, decode and the trainer sharing the whole device")
    return f"--levels {asked}: this device realises {realised} ({ladder.describe()})"


def _workload_identity(args, finetune_model: str) -> dict:
    if args.finetune_job:
        return {"workload": "harvest-trainer", "job": str(Path(args.finetune_job).resolve()), "cpu_threads": args.trainer_cpu_threads,
                "nice": args.trainer_nice}
    return {
        "workload": "peft-lora",
        "cpu_threads": args.trainer_cpu_threads,
        "nice": args.trainer_nice,
        "base_model": finetune_model,
        "lora_rank": args.lora_rank,
        "micro_batch": args.trainer_micro_batch,
        "sequence_length": args.trainer_seq_len,
    }


def _make_workload(args, finetune_model: str, device: str, dtype: str):
    if args.finetune_job:
        from harvest.predict.profiler.trainer_workload import HarvestTrainerWorkload

        return HarvestTrainerWorkload(args.finetune_job, device)
    from harvest.predict.profiler.peft_workload import PeftLoraWorkload

    return PeftLoraWorkload(
        finetune_model, device, dtype, args.random_weights, args.lora_rank, args.trainer_micro_batch, args.trainer_seq_len, args.seed
    )


def resolve_engine(requested: str) -> str:
    """The engine ``--engine`` names (auto: sglang when installed)."""
    if requested != "auto":
        return requested
    return "sglang" if sglang_available() else "transformers"


def _rank_cores(tp_size: int, device: str) -> tuple[tuple[int, ...], ...]:
    """On a CPU with ``--tp`` > 1, each rank's cores (harvest.predict.profiler.tp_layout);
    else () (GPUs: rank r on GPU r, checked to be there)."""
    import torch

    try:
        if device != "cpu":
            check_gpus(tp_size, device, torch.cuda.device_count())
            return ()
        return cpu_core_groups(tp_size) if tp_size > 1 else ()
    except TensorParallelError as exc:
        raise ProfilingFailed(str(exc)) from None


def _decode_threads(args, device: str, rank_cores: tuple[tuple[int, ...], ...]) -> int:
    """Decode's torch intra-op threads for the run (rank 0's with --tp): ``--torch-threads``,
    else on a CPU the cores the co-run trainer leaves of rank 0's (as the server runs decode
    beside a job), else torch's."""
    import torch

    if args.torch_threads is not None:
        return args.torch_threads
    if device == "cpu":
        cores = len(rank_cores[0]) if rank_cores else None  # rank 0's group; one rank: every usable core
        return trainer_cpu.decode_threads_beside_trainer(args.trainer_cpu_threads, torch.get_num_threads(), cores)
    return torch.get_num_threads()


def default_profile_path(device_kind: str, model_name: str, engine_name: str, tp_size: int) -> Path:
    """profiles/<device>-<model>-<engine>[-tpN].json: a profile per TP degree."""
    tp = f"-tp{tp_size}" if tp_size > 1 else ""
    return Path("profiles") / f"{device_kind}-{model_name}-{engine_name}{tp}.json"


def profile(args, model_path: str, measure: MeasureConfig) -> int:
    import torch
    from tqdm import tqdm

    device = _device(args.device)
    dtype = resolve_dtype(args.dtype, device)
    engine_name = resolve_engine(args.engine)
    try:
        graphs = decode_graphs(getattr(args, "graphs", "auto"), engine_name, device)
    except EngineError as exc:
        raise ProfilingFailed(str(exc)) from exc
    if engine_name == "transformers" and getattr(args, "graphs", None) == "auto":
        args.graphs = "on" if graphs else "off"  # the provenance's command line says what ran
    rank_cores = _rank_cores(args.tp, device)
    if args.switch_interval_ms is not None:
        sys.setswitchinterval(args.switch_interval_ms / 1e3)
    decode_threads = _decode_threads(args, device, rank_cores)
    torch.manual_seed(args.seed)
    finetune_model = args.finetune_model or model_path
    device_id = device_identity(device)
    model = provenance.model_identity(model_path, dtype, args.random_weights)
    grid = Grid(tuple(args.batch_sizes), tuple(args.context_lengths))
    out = args.out or default_profile_path(device_id.kind, model.name, engine_name, args.tp)
    report_path = args.report or out.with_suffix(".png")

    partitioner = create_partitioner(device, **({} if args.levels is None else {"levels": args.levels}))
    ladder = partitioner.ladder  # its levels carry the streams each grid point runs on
    note = levels_note(args.levels, ladder)
    if note is not None:
        print(f"harvest profile: {note}", file=sys.stderr)
    try:
        workload_identity = _workload_identity(args, finetune_model)
        identity = {
            "device": device_id.name, "model_config_hash": model.config_hash, "dtype": dtype, "engine": engine_name,
            "random_weights": args.random_weights, "ladder": ladder.to_dict(), "grid": [grid.batch_sizes, grid.context_lengths],
            "warmup": measure.warmup_steps, "repeats": measure.timed_steps, "trim": measure.trim_fraction,
            "switch_interval_s": sys.getswitchinterval(), "torch_threads": decode_threads, "workload": workload_identity, "seed": args.seed,
            "tp_size": args.tp, "rank_cores": [list(group) for group in rank_cores], "graphs": graphs,
        }
        if getattr(args, "kv", "static") == "paged":  # a static run's identity is the one before --kv existed
            identity["kv"] = {"layout": "paged", "page_size": args.kv_page_size}
        partial = PartialRun(partial_path(out), identity)
        try:
            done = partial.open(restart=args.restart)
        except PartialRunError as exc:
            raise ProfilingFailed(str(exc)) from exc
        threads = f"; decode on {decode_threads} torch thread(s), the co-run trainer on {args.trainer_cpu_threads}" if device == "cpu" else ""
        print(f"harvest profile: {model.name} ({dtype}) on {device_id.name}, {engine_name} engine{' (decode steps as CUDA graph replays)' if graphs else ''}; {partitioner.description}{threads}")
        if args.tp > 1:
            where = f"GPUs 0..{args.tp - 1}" if not rank_cores else f"cores {format_threads_bind(rank_cores)} (SGLANG_CPU_OMP_THREADS_BIND)"
            print(f"tensor parallel: {args.tp} ranks on {where}; rank 0 times the steps beside the co-run trainer")
        torch.set_num_threads(decode_threads)
        try:
            records, buckets, finetune, trainer = _measure(
                args, engine_name, model_path, device, dtype, measure, grid, ladder, finetune_model, done, partial, tqdm, rank_cores,
                graphs,
            )
        except KeyboardInterrupt:
            partial.close()
            print(f"\ninterrupted: measured grid points are kept in {partial.path}; run the same command again to resume", file=sys.stderr)
            return 130
        finally:
            partial.close()
    finally:
        partitioner.close()
    memory = lend_costs_section(model_path, device, dtype, args.tp)

    measurement = MeasurementSettings(
        timer_for_name(device), measure.warmup_steps, measure.timed_steps, measure.trim_fraction, sys.getswitchinterval(), torch.get_num_threads()
    )
    prov = provenance.collect(device_id, ladder, engine_name, model, finetune, measurement, command_line(args), args.tp)
    try:
        result = build_profile(prov, ladder, buckets, grid, records, trainer)
    except FitError as exc:
        raise ProfilingFailed(f"cannot fit the measured grid points: {exc}") from exc
    except ProfileError as exc:  # a fit no decode step can have (e.g. co-location speeding decode up)
        raise ProfilingFailed(f"the fit of the measured grid points is not a usable profile: {exc}") from exc
    if memory is not None:
        result = dataclasses.replace(result, memory=memory)
    result.save(out)
    write_plot(result, report_path)
    partial.finish()
    print(describe_fit(result))
    print(f"wrote {out} and {report_path}")
    return 0


def lend_costs_section(model_path: str, device: str, dtype: str, tp_size: int) -> MemorySection | None:
    """The profile's ``memory`` section: a lend and a reclaim of one chunk of the served
    geometry (one rank's), timed through the unified allocator under decode-like load
    (harvest.memory.lend_timing), after the grid. None, with a warning, when it cannot be
    measured: the server then counts the stated default (harvest.memory.lend_costs)."""
    from harvest.memory.lend_timing import KvShape, measure
    from harvest.predict.profiler.grid_capacity import DTYPE_BYTES, read_config
    from harvest.sglang.kv_backing import HOST_PAGE_BYTES

    on_cuda = device.startswith("cuda")
    if on_cuda:
        import torch

        torch.cuda.empty_cache()  # the closed engine's blocks, cached by torch: the pool's pages need the room
    try:
        shape = KvShape.of_model(read_config(model_path), DTYPE_BYTES[dtype], tp_size)
        timing = measure(shape, backend="cuda" if on_cuda else "host", device=int(device.partition(":")[2] or 0),
                         page_bytes=0 if on_cuda else HOST_PAGE_BYTES)
    except (RuntimeError, OSError) as exc:  # the allocator's and the measurement's errors, the library missing
        print(f"harvest profile: warning: lend/reclaim not timed ({exc}); the profile has no memory section, and a "
              "server counts the default reclaim cost (harvest.yaml's memory.reclaim_ms_per_chunk)", file=sys.stderr)
        return None
    print(f"lend/reclaim under decode-like load: {timing.describe()}")
    return MemorySection(**timing.section_fields())


def command_line(args) -> list[str]:
    """The command as parsed (defaults included), whoever called it."""
    argv = ["harvest", "profile"]
    for key, value in sorted(vars(args).items()):
        if key.startswith("_") or key == "command" or value is None or value is False:
            continue
        flag = "--" + key.replace("_", "-")
        if value is True:
            argv.append(flag)
        else:
            argv += [flag, ",".join(map(str, value)) if isinstance(value, (tuple, list)) else str(value)]
    return argv


def timer_for_name(device: str) -> str:
    return "cuda-events" if device.startswith("cuda") else "perf_counter_ns"


def _measure(args, engine_name, model_path, device, dtype, measure, grid, ladder, finetune_model, done, partial, tqdm, rank_cores,
             graphs=False):
    """Measure what ``done`` lacks, then the trainer alone; returns (records, buckets,
    finetune identity, trainer section)."""
    engine = workload = None
    try:
        max_context = max(grid.context_lengths) + measure.warmup_steps + measure.timed_steps + 1
        config = EngineConfig(
            model_path, device, dtype, args.random_weights, max(grid.batch_sizes), max_context, args.seed, args.tp, rank_cores,
            graphs=graphs,
            steps_per_point=measure.warmup_steps + measure.timed_steps + 1,
            kv=getattr(args, "kv", "static"), page_size=getattr(args, "kv_page_size", 16),
        )
        engine = make_engine(engine_name, config)
        workload = _make_workload(args, finetune_model, device, dtype)
        workload.cpu_threads = args.trainer_cpu_threads
        workload.nice = args.trainer_nice
        done_keys = {grid_key(r) for r in done}
        todo = [p for p in plan_points(ladder, grid, workload.phases) if grid_key(p) not in done_keys]
        if done:
            print(f"resuming: {len(done)} grid points already measured in {partial.path}, {len(todo)} to go")
        with tqdm(total=len(todo), unit="point", dynamic_ncols=True, mininterval=1.0) as progress:
            records = run_grid(engine, workload, ladder, grid, measure, timer_for(device.split(":")[0]), done, partial.append, progress)
        print(f"trainer alone: {args.trainer_alone_s:g} s per trainer level and phase")
        trainer = measure_section(workload, ladder, args.trainer_alone_s, _print_alone)
        finetune = FinetuneIdentity(
            workload=workload.name,
            base_model=workload.base_model,
            description=f"{workload.description}; its thread on {args.trainer_cpu_threads} torch CPU thread(s), nice +{args.trainer_nice}",
            config_hash=_config_hash_or_none(workload.base_model),
            micro_batch_tokens=workload.micro_batch_tokens,
        )
        return records, BatchSizeBuckets(engine.batch_size_buckets), finetune, trainer
    except (EngineError, CoRunError, MeasurementError) as exc:
        raise ProfilingFailed(str(exc)) from exc
    finally:
        if workload is not None:
            workload.close()
        if engine is not None:
            engine.close()


def _print_alone(record) -> None:
    where = "whole device" if record.level is None else f"level {record.level}"
    print(f"  {where} {record.phase}: {record.units} units in {record.seconds:.2f} s ({record.units_per_s:.3g} units/s)")


def _config_hash_or_none(model_path: str) -> str | None:
    from harvest.predict.compat import model_config_hash_of_path

    try:
        return model_config_hash_of_path(model_path)
    except ValueError:
        return None


def decode_graphs(requested: str, engine_name: str, device: str) -> bool:
    """Whether the transformers engine replays each step as a CUDA graph (--graphs):
    auto = on a CUDA device. SGLang's engine captures its own graphs whatever is asked."""
    if engine_name != "transformers" or requested == "off":
        return False
    on_cuda = device.startswith("cuda")
    if requested == "on" and not on_cuda:
        raise EngineError(f"--graphs on: decode CUDA graphs need a CUDA device, not {device!r}")
    return on_cuda


def make_engine(name: str, config: EngineConfig) -> BaseDecodeEngine:
    """The decode engine named by --engine (each imported only when chosen)."""
    if name == "sglang":
        from harvest.predict.profiler.sglang_engine import SglangDecodeEngine

        return SglangDecodeEngine(config)
    if name == "transformers":
        from harvest.predict.profiler.hf_engine import TransformersDecodeEngine

        return TransformersDecodeEngine(config)
    raise EngineError(f"--engine={name!r}: one of sglang, transformers")


def sglang_available() -> bool:
    import importlib.util

    return importlib.util.find_spec("sglang") is not None
