"""`harvest replay`: replay a request trace through one simulated decode instance under
harvest's scheduler and the Harli baselines, from a latency profile (capacity planning);
with ``--servers N``, through a fleet of N instances behind a router (:mod:`fleet`); with
``--servers auto``, through the smallest fleet that holds the target (:mod:`fleet_size`).
The KV pool is modelled: harvest's lending, StaticMode's fixed share (:mod:`kv_memory`).

Cheap to import (the CLI imports every command to build its parser): numpy, matplotlib
and the simulator load inside :func:`run`.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from pathlib import Path

HELP = "simulate a decode instance under a request trace: harvest vs SeparateMode, StaticMode and decode-only"
SYNTHETIC_A100 = "synthetic-a100"
DEFAULT_OUT_DIR = Path("out") / "replay"  # out/ is git-ignored in a checkout


def _csv(text: str) -> tuple[str, ...]:
    return tuple(part.strip() for part in text.split(",") if part.strip())


def _seeds(text: str) -> tuple[int, ...]:
    try:
        seeds = tuple(int(part) for part in _csv(text))
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r}: expected comma-separated integers, e.g. 0,1,2") from None
    if not seeds or len(set(seeds)) != len(seeds):
        raise argparse.ArgumentTypeError(f"{text!r}: expected distinct integers")
    return seeds


def _key_value(text: str) -> tuple[str, object]:
    key, sep, value = text.partition("=")
    if not sep or not key:
        raise argparse.ArgumentTypeError(f"{text!r}: expected KEY=VALUE, e.g. hysteresis_steps=1")
    try:
        parsed = json.loads(value)
    except ValueError:
        parsed = value
    return key.strip(), parsed


def _servers(text: str):
    if text.strip() == "auto":
        return "auto"
    try:
        return int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r}: expected a number of servers or auto") from None


def add_arguments(parser) -> None:
    from harvest.replay.trace import TRACE_HELP  # standard library only: cheap

    g = parser.add_argument_group("input")
    g.add_argument("--trace", type=Path, default=None, help=TRACE_HELP)
    g.add_argument("--profile", default=None, help=f"latency profile JSON (default: a GPU profile in profiles/, else a CPU one); '{SYNTHETIC_A100}': the labelled synthetic Harli-shaped A100 profile")
    g.add_argument("--start-s", type=float, default=0.0, help="window start, seconds into the trace (default 0)")
    g.add_argument("--duration-s", type=float, default=None, help="window length in trace seconds (default: to the end)")
    g.add_argument("--max-requests", type=int, default=None, help="at most this many requests of the window")
    g.add_argument("--time-scale", type=float, default=1.0, help="multiply arrival times (2 = same requests at half the rate; default 1)")
    g.add_argument("--rate-scale", type=float, default=1.0, help="thin (<1) or multiply (>1) the requests, keeping the time base (seeded; default 1)")
    g.add_argument("--rate-scale-sizes", choices=("copy", "resample"), default="copy", help="sizes of the extra requests --rate-scale > 1 adds: copy the request they repeat (default), or resample: those of a random request arriving within a minute of it; use resample with --servers N --rate-scale N, where copies hand every round-robin server the same requests")
    g.add_argument("--seeds", type=_seeds, default=(0,), help="comma-separated seeds for rate scaling and noise; one replay per seed (default 0)")
    d = parser.add_argument_group("decode instance and policies")
    d.add_argument("--policies", type=_csv, default=None, help="comma-separated subset of harvest,separate,static,decode-only (default: all)")
    d.add_argument("--tp", type=int, default=None, help="tensor-parallel ranks of the decode instance, one GPU each (default: the profile's tp_size, which must match: `harvest profile --tp N`); figures are per instance and per GPU")
    d.add_argument("--target-tpot-ms", type=float, default=40.0, help="TPOT QoS target in ms (default 40, as Harli)")
    d.add_argument("--scheduler", type=_key_value, action="append", default=[], metavar="KEY=VALUE", help="override a scheduler setting (SchedulerConfig field), repeatable")
    d.add_argument("--max-batch-size", type=int, default=256, help="most requests in a decode batch (default 256)")
    d.add_argument("--kv-capacity-tokens", type=int, default=160_000, help="KV cache capacity of the decode instance (all its TP ranks) in tokens (default 160000: Llama-3-8B bf16 on a 40 GB A100)")
    d.add_argument("--kv-bytes-per-token", type=int, default=None, help="KV bytes per token, for GiB figures (default 131072: Llama-3-8B)")
    d.add_argument("--trainer-tokens-per-s", type=float, default=None, help="the finetune job's throughput alone on a whole GPU in tokens/s (default: the profile's measured trainer section, if it has one; else results are in whole-GPU trainer equivalents)")
    d.add_argument("--error-scale", type=float, default=1.0, help="true co-located latency = predicted x this (stage-2 error the scheduler does not know; default 1)")
    d.add_argument("--error-noise", type=float, default=0.0, help="relative std. dev. of per-step noise on every true latency (default 0)")
    m = parser.add_argument_group("KV memory (harvest's lending, StaticMode's fixed share)")
    m.add_argument("--memory", type=_key_value, action="append", default=[], metavar="KEY=VALUE", help="a harvest.yaml memory setting for harvest's KV lending, repeatable: reserve_tokens (auto or tokens), reserve_percentile, reserve_window_s, reserve_lower_after_s, reclaim_ms_per_chunk (default: the profile's memory section, else 7 ms per 128 MiB chunk, with a warning), hysteresis_chunks, max_lend_fraction, lend_interval_s, reclaim_ahead, lending_thread (auto: on; false: lending delays decode steps) (default: harvest.yaml's defaults; its other memory keys have no effect here)")
    m.add_argument("--kv-chunk-tokens", type=int, default=None, help="KV slots per chunk lent and reclaimed as a unit (default 1024: Llama-3-8B's 128 MiB chunk)")
    m.add_argument("--trainer-stage-mib", type=float, default=None, help="bytes of one trainer stage in MiB, for the window (stages resident in the lent memory; default 416: a Llama-3-8B decoder layer in bf16)")
    m.add_argument("--trainer-stages", type=int, default=None, help="the trainer's stages, the most its window holds (default 34: Llama-3-8B's embedding, 32 layers, norm and head)")
    f = parser.add_argument_group("fleet")
    f.add_argument("--servers", type=_servers, default=None, help="decode servers behind a router, each replayed as the instance above; they share the trace's requests, so each gets 1/N of its rate: add --rate-scale N --rate-scale-sizes resample for a fleet sized to N times the trace (default 1: the single-instance report); auto: the smallest fleet that holds the target (harvest's servers within --target-tpot-ms at p99 and --max-queue-delay-s), and every policy on it")
    f.add_argument("--max-servers", type=int, default=None, help="with --servers auto: the largest fleet tried (default 64)")
    f.add_argument("--max-queue-delay-s", type=float, default=None, help="with --servers auto: a server holds the target only if its queue delay p99 is at most this (default 1 s)")
    f.add_argument("--router", type=_csv, default=None, help="with --servers > 1: comma-separated subset of round-robin,least-loaded (default: both)")
    o = parser.add_argument_group("output")
    o.add_argument("--out-dir", type=Path, default=DEFAULT_OUT_DIR, help=f"where the PNG plots and replay.json go (default ./{DEFAULT_OUT_DIR})")
    o.add_argument("--no-plots", action="store_true", help="write no PNG plots and no replay.json")
    o.add_argument("--json", action="store_true", help="print the result as one JSON object instead of the text report")
    o.add_argument("--progress", action=argparse.BooleanOptionalAction, default=None, help="progress bars (default: when stderr is a terminal)")


def _fail(message: str, code: int = 2) -> int:
    print(f"harvest replay: {message}", file=sys.stderr)
    return code


def check_out_dir(out_dir: Path) -> None:
    """ValueError if ``out_dir`` cannot take the plots and replay.json, before minutes of
    replay are spent (harvest.output_paths; it is created only when there is something to
    write)."""
    from harvest.output_paths import folder_problem

    problem = folder_problem(out_dir)
    if problem is not None:
        raise ValueError(f"--out-dir {out_dir} {problem}")


def resolve_profile(spec: str | None):
    """The profile ``spec`` names (a path, or SYNTHETIC_A100), or the project's best one."""
    from harvest.config_env import PROJECT_ROOT
    from harvest.replay import profile_source, synthetic

    if spec == SYNTHETIC_A100:
        return profile_source.from_profile(synthetic.harli_a100_llama3_8b(), SYNTHETIC_A100)
    if spec is not None:
        return profile_source.load(spec)
    found = profile_source.committed_profiles(PROJECT_ROOT / "profiles")
    if not found:
        raise FileNotFoundError(
            f"no loadable profile in {PROJECT_ROOT / 'profiles'}; pass --profile PATH (`harvest profile` makes one) "
            f"or --profile {SYNTHETIC_A100}"
        )
    return found[0]


def run(args) -> int:
    from harvest.predict.schema import ProfileError
    from harvest.replay import comparison, fleet, fleet_report, fleet_size, kv_memory, plots, report, router, trainer_model, workload
    from harvest.replay.simulator import DecodeLimits
    from harvest.replay.trace import SAMPLE_TRACE, TraceError, read_trace

    trace_path = args.trace or SAMPLE_TRACE
    auto = args.servers == "auto"
    try:
        window = workload.TraceWindow(
            args.start_s, args.duration_s, args.max_requests, args.time_scale, args.rate_scale, args.rate_scale_sizes == "resample"
        )
        limits = DecodeLimits(args.max_batch_size, args.kv_capacity_tokens)
        settings = comparison.ReplaySettings(
            limits=limits,
            target_tpot_ms=args.target_tpot_ms,
            scheduler_overrides=dict(args.scheduler),
            error_scale=args.error_scale,
            error_noise=args.error_noise,
            policies=comparison.ALL_POLICIES if args.policies is None else args.policies,  # "" is refused
            tp_size=args.tp,
            **({} if args.kv_bytes_per_token is None else {"kv_bytes_per_token": args.kv_bytes_per_token}),
        )
        settings.check()
        fleet_settings = fleet.FleetSettings(1 if args.servers is None or auto else args.servers,
                                             router.ALL_ROUTERS if args.router is None else args.router)
        fleet_settings.check()
        if args.router is not None and args.servers is None:
            # Said, not ignored; `--servers 1 --router R` is a fleet of one (the single report).
            raise ValueError(f"--router {','.join(args.router)!r}: routes requests between servers; give --servers N "
                             "with it")
        auto_settings = fleet_size.AutoSettings(
            fleet_size.DEFAULT_MAX_SERVERS if args.max_servers is None else args.max_servers,
            fleet_size.DEFAULT_MAX_QUEUE_DELAY_S if args.max_queue_delay_s is None else args.max_queue_delay_s,
        )
        for flag, value in (("--max-servers", args.max_servers), ("--max-queue-delay-s", args.max_queue_delay_s)):
            if value is not None and not auto:
                raise ValueError(f"{flag} {value:g}: sizes a fleet; give --servers auto with it")
        auto_settings.check()
        one_instance = fleet_settings.num_servers == 1 and not auto
        if not args.no_plots:
            check_out_dir(args.out_dir)
        profile = resolve_profile(args.profile)
        comparison.check_tp(profile, settings.tp_size)
        trainer = trainer_model.build(profile, args.trainer_tokens_per_s)
        memory, memory_warning = kv_memory.resolve(profile, dict(args.memory), args.kv_chunk_tokens, settings.kv_bytes_per_token,
                                                   args.trainer_stage_mib, args.trainer_stages)
        settings = dataclasses.replace(settings, memory=memory)
    except (ValueError, FileNotFoundError) as exc:  # ProfileError and SettingError are ValueErrors
        return _fail(str(exc))
    try:
        requests = read_trace(trace_path)
        check_request_sizes(workload.window_requests(requests, window), trace_path, limits)
    except (TraceError, ValueError) as exc:
        return _fail(str(exc))

    random_inputs = window.is_random or settings.error_noise > 0
    seeds = args.seeds if random_inputs else args.seeds[:1]
    show_progress = sys.stderr.isatty() if args.progress is None else args.progress
    replays = []  # one Comparison (one instance) or FleetComparison per seed
    sized = None
    try:
        if auto:
            sized = fleet_size.size(workload.prepare(requests, window, seeds[0]), profile, trainer, settings,
                                    fleet_settings.routers, auto_settings, seeds[0])
            if sized.num_servers is None:
                print(f"harvest replay: {sized.describe()}; raise --max-servers or --target-tpot-ms", file=sys.stderr)
                return 1
            fleet_settings = fleet.FleetSettings(sized.num_servers, fleet_settings.routers)
        for seed in seeds:
            prepared = workload.prepare(requests, window, seed)
            if one_instance:
                replays.append(comparison.run(prepared, profile, trainer, settings, seed, show_progress))
            else:
                replays.append(fleet.run(prepared, profile, trainer, settings, fleet_settings, seed, show_progress))
    except (ValueError, ProfileError) as exc:
        return _fail(str(exc))

    written: list[str] = []
    trace_label = str(trace_path)
    output = report if one_instance else fleet_report
    extra = {} if one_instance else {"auto": sized}
    try:
        if not args.no_plots and one_instance:
            written = plots.write_all(replays[0], profile, settings.target_tpot_ms, args.out_dir)
        elif not args.no_plots:
            written = plots.write_fleet(replays[0], trainer, settings.target_tpot_ms, args.out_dir)
        data = output.as_dict(replays, profile, trainer, settings, window, trace_label, written, **extra)
        if not random_inputs and len(args.seeds) > 1:
            data["note"] = "seeds ignored: no rate scaling or noise, so every seed replays the same thing"
        if not args.no_plots:
            (args.out_dir / "replay.json").write_text(json.dumps(data, indent=1) + "\n")
    except OSError as exc:  # the disk filled, or --out-dir changed under the replay
        return _fail(f"--out-dir {args.out_dir}: cannot write {exc.filename or ''}: {exc.strerror or exc}")
    if memory_warning is not None and comparison.HARVEST in settings.policies:  # only harvest reclaims
        print(f"harvest replay: {memory_warning}", file=sys.stderr)
    warning = report.outside_warning(output.outside_of(replays), profile, trace_label)
    if warning is not None:
        print(f"harvest replay: {warning}", file=sys.stderr)
    if args.json:
        print(json.dumps(data))
    else:
        print(output.text(replays, profile, trainer, settings, window, trace_label, written, **extra))
        if "note" in data:
            print(data["note"])
    first = replays[0]
    results = first.results if one_instance else next(iter(first.routers.values())).results
    return 0 if any(r.refused is None for r in results.values()) else 1


def check_request_sizes(requests, trace_path, limits) -> None:
    """ValueError naming the trace file and line of the first request (of those replayed)
    that needs more KV than the decode instance has: it could never be admitted."""
    capacity = limits.kv_capacity_tokens
    for request in requests:
        size = request.context_tokens + request.generated_tokens
        if size > capacity and request.generated_tokens > 1:  # one output token: prefill only, never decoded
            raise ValueError(
                f"{trace_path}:{request.line}: a request of {request.context_tokens} prompt + {request.generated_tokens} "
                f"output tokens needs {size} tokens of KV, more than the decode instance's KV pool "
                f"(--kv-capacity-tokens {capacity}): it could never run; raise --kv-capacity-tokens or leave it out of "
                "the window (--start-s, --duration-s, --max-requests)"
            )
