#!/usr/bin/env python
"""Benchmark `harvest replay`: wall time to replay the one-hour Azure conversation trace
through every policy, and the finetune gains and QoS the replay predicts.

- ``replay_wall_s``: median over ``--repeats`` of the wall time of one whole comparison
  (all four policies; separate shares decode-only's decode run), trace reading excluded;
  ``policy_wall_s``: the same per policy (median).
- ``simulated_s``: the simulated horizon; ``trace_requests``: requests replayed.
- ``ft_gain_vs_separate`` / ``ft_gain_vs_static``: harvest's per-GPU finetune throughput
  over each baseline's, minus 1; ``qos_violation_rate``: fraction of harvest's output
  tokens decoded by a step over the target.
- ``profile``: the profile used: a measured GPU profile in profiles/ if there is one,
  else the committed CPU profile, else the labelled synthetic Harli-shaped A100 profile
  (``profile_kind`` says which). ``synthetic_a100`` repeats the gains with that synthetic
  profile for reference when the main profile is not it.
- ``steps_outside_profile_fraction``: the largest fraction of one policy's decode steps
  outside the profile's measured range (``steps_outside_profile_policy``: whose), where the
  replay extrapolates the profile; `harvest replay` warns over 5 %.
- The KV pool is modelled (harvest/replay/kv_memory.py: harvest's lending by the server's
  code, the profile's lend/reclaim figures or the 7 ms default): ``urgent_reclaims``, how
  often harvest's decode waited for lent memory, ``reclaim_delay_ms_p99`` the delay one
  such wait added (p99 over them; 0 with none), ``memory`` each lending policy's summary
  (series left out); ``realtime_factor`` = ``simulated_s`` / ``replay_wall_s``.
- ``servers_auto``: what `harvest replay --servers auto` picks for the trace (the smallest
  fleet whose harvest servers hold the target, both routers), ``servers_auto_probes`` the
  fleets it replayed, ``servers_auto_policies`` every policy on that fleet (round-robin):
  per-GPU finetune throughput, the fleet's violation rate, urgent reclaims;
  ``servers_auto_wall_s`` the search's wall time.
- ``robustness_synthetic_a100``: harvest's violations and gains when the true co-located
  latency is 10 % over the prediction plus 5 % noise, with the scheduler's feedback
  margin and with the margin fixed (synthetic A100 profile); ``beyond_margin``: 2.5x
  over the prediction, more than the margin's maximum (0.5) can absorb, with the
  scheduler's backoff and without it.

The last stdout line is the JSON object.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def _choose_profile(spec: str | None):
    from harvest.replay import profile_source, synthetic
    from harvest.replay.command import SYNTHETIC_A100, resolve_profile

    if spec is not None:
        return resolve_profile(spec)
    found = profile_source.committed_profiles(ROOT / "profiles")
    if found and not found[0].synthetic:
        return found[0]
    return profile_source.from_profile(synthetic.harli_a100_llama3_8b(), SYNTHETIC_A100)


def _kind(profile) -> str:
    return "synthetic" if profile.synthetic else ("gpu" if profile.device_kind == "cuda" else "cpu")


def _replay(requests, profile, settings, repeats: int):
    from harvest.replay import comparison, trainer_model

    trainer = trainer_model.build(profile)
    walls, per_policy, result = [], {}, None
    for _ in range(repeats):
        start = time.perf_counter()
        result = comparison.run(requests, profile, trainer, settings)
        walls.append(time.perf_counter() - start)
        for name, seconds in result.wall_s.items():
            per_policy.setdefault(name, []).append(seconds)
    return result, statistics.median(walls), {name: statistics.median(v) for name, v in per_policy.items()}


def _robustness(requests, settings) -> dict:
    """Harvest under a 10 % stage-2 under-prediction plus 5 % noise, with the feedback
    margin and with it fixed, and under a 2.5x one with and without the backoff, on the
    synthetic A100 profile (the CPU profile's one level never comes near a 40 ms target,
    so it would show nothing)."""
    import dataclasses

    from harvest.replay import profile_source, synthetic
    from harvest.replay.command import SYNTHETIC_A100

    profile = profile_source.from_profile(synthetic.harli_a100_llama3_8b(), SYNTHETIC_A100)

    def harvest_with(errors: dict, overrides: dict) -> dict:
        varied = dataclasses.replace(settings, **errors, scheduler_overrides=overrides, policies=("harvest", "static", "separate"))
        result, _, _ = _replay(requests, profile, varied, 1)
        harvest = result.results["harvest"]
        return {
            "qos_violation_rate": harvest.metrics["violation_rate"],
            "tpot_p99_ms": harvest.metrics["tpot_p99_ms"],
            "ft_gain_vs_static": harvest.gain_vs["static"],
            "ft_gain_vs_separate": harvest.gain_vs["separate"],
        }

    within = {"error_scale": 1.1, "error_noise": 0.05}
    beyond = {"error_scale": 2.5, "error_noise": 0.05}
    return {
        **within,
        "note": "synthetic Harli-shaped A100 profile, not measured",
        "feedback_margin": harvest_with(within, {}),
        "fixed_margin": harvest_with(within, {"margin_growth": 0.0}),
        "beyond_margin": {
            **beyond,
            "backoff": harvest_with(beyond, {}),
            "no_backoff": harvest_with(beyond, {"backoff_steps": None}),
        },
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--trace", type=Path, default=None, help="trace CSV (default: the bundled sample; the benchmark is meant for the full Azure trace: "
                        "download data/AzureLLMInferenceTrace_conv.csv of github.com/Azure/AzurePublicDataset)")
    parser.add_argument("--profile", default=None, help="profile JSON or 'synthetic-a100' (default: see the module doc)")
    parser.add_argument("--repeats", type=int, default=3, help="timed repeats (default 3)")
    parser.add_argument("--target-tpot-ms", type=float, default=40.0)
    parser.add_argument("--json", action="store_true", help="print only the JSON line")
    args = parser.parse_args()

    from harvest.replay import comparison, fleet, fleet_size, kv_memory, synthetic, profile_source, trainer_model
    from harvest.replay.command import SYNTHETIC_A100
    from harvest.replay.router import ALL_ROUTERS
    from harvest.replay.report import headline, outside_of
    from harvest.replay.simulator import DecodeLimits
    from harvest.replay.trace import SAMPLE_TRACE, read_trace

    trace = args.trace or SAMPLE_TRACE
    requests = read_trace(trace)
    profile = _choose_profile(args.profile)
    memory, memory_warning = kv_memory.resolve(profile)
    if memory_warning is not None and not args.json:
        print(f"bench_replay: {memory_warning}", file=sys.stderr)
    settings = comparison.ReplaySettings(limits=DecodeLimits(256, 160_000), target_tpot_ms=args.target_tpot_ms, memory=memory)
    result, wall, policy_wall = _replay(requests, profile, settings, max(1, args.repeats))
    numbers = headline(result)
    harvest = result.results["harvest"]
    outside = outside_of([result])
    out = {
        "trace_requests": len(requests),
        "replay_wall_s": wall,
        "simulated_s": result.horizon_s,
        "ft_gain_vs_separate": numbers["ft_gain_vs_separate"],
        "ft_gain_vs_static": numbers["ft_gain_vs_static"],
        "qos_violation_rate": numbers["harvest_violation_rate"],
        "profile": profile.label,
        "profile_kind": _kind(profile),
        "profile_description": profile.description,
        "steps_outside_profile_fraction": outside.fraction,
        "steps_outside_profile_policy": outside.policy,
        "trace": str(trace),
        "target_tpot_ms": args.target_tpot_ms,
        "policy_wall_s": policy_wall,
        "harvest_steps": None if harvest.refused else harvest.metrics["decode_steps"],
        "harvest_us_per_step": None if harvest.refused else 1e6 * policy_wall["harvest"] / harvest.metrics["decode_steps"],
        "finetune_per_gpu": {n: (None if r.refused else r.metrics["finetune_per_gpu"]) for n, r in result.results.items()},
        "finetune_tokens_per_s_per_gpu": {
            n: (None if r.refused else r.metrics["finetune_tokens_per_s_per_gpu"]) for n, r in result.results.items()
        },
        "trainer_rates": "measured (profile trainer section)" if profile.trainer_alone is not None else "SM-share model (no trainer section)",
        "tpot_p99_ms": {n: (None if r.refused else r.metrics["tpot_p99_ms"]) for n, r in result.results.items()},
        "repeats": max(1, args.repeats),
        "realtime_factor": result.horizon_s / wall if wall > 0 else None,
        "urgent_reclaims": None if harvest.refused else harvest.memory.metrics["urgent_reclaims"],
        "reclaim_delay_ms_p99": None if harvest.refused else harvest.memory.metrics["reclaim_delay_ms_p99"],
        "memory": {n: r.memory.metrics for n, r in result.results.items() if r.refused is None and r.memory is not None},
        "memory_figures": memory.source,
    }
    start = time.perf_counter()
    trainer = trainer_model.build(profile)
    sized = fleet_size.size(requests, profile, trainer, settings, ALL_ROUTERS)
    out["servers_auto"] = sized.num_servers
    out["servers_auto_wall_s"] = time.perf_counter() - start
    out["servers_auto_probes"] = [p.to_dict() for p in sorted(sized.probes, key=lambda p: p.num_servers)]
    if sized.num_servers is not None:
        on_fleet = fleet.run(requests, profile, trainer, settings, fleet.FleetSettings(sized.num_servers, ALL_ROUTERS))
        out["servers_auto_policies"] = {
            name: None if r.refused else {
                "finetune_per_gpu": r.metrics["finetune_per_gpu"],
                "violation_rate": r.metrics["violation_rate"],
                "servers_violating": r.metrics["servers_violating"],
                "urgent_reclaims": None if r.memory is None else r.memory["urgent_reclaims"],
            }
            for name, r in on_fleet.routers[ALL_ROUTERS[0]].results.items()
        }
    if not profile.synthetic:
        reference = profile_source.from_profile(synthetic.harli_a100_llama3_8b(), SYNTHETIC_A100)
        ref_result, _, _ = _replay(requests, reference, settings, 1)
        ref = headline(ref_result)
        out["synthetic_a100"] = {
            "ft_gain_vs_separate": ref["ft_gain_vs_separate"],
            "ft_gain_vs_static": ref["ft_gain_vs_static"],
            "qos_violation_rate": ref["harvest_violation_rate"],
            "note": "synthetic Harli-shaped A100 profile, not measured",
        }
    out["robustness_synthetic_a100"] = _robustness(requests, settings)
    if not args.json:
        note = {
            "gpu": "a measured GPU profile",
            "cpu": "the CPU profile (no GPU profile in profiles/ yet): one shared level, so harvest and static share their only level",
            "synthetic": "a SYNTHETIC Harli-shaped A100 profile (no measured profile in profiles/)",
        }[out["profile_kind"]]
        print(f"bench_replay: {len(requests)} requests from {trace}; profile {profile.label}: {note}", file=sys.stderr)
        print(f"  replay of all policies: {wall:.2f} s (median of {out['repeats']}); per policy {policy_wall}", file=sys.stderr)
        print(f"  steps outside the profiled range: {100 * outside.fraction:.1f} % ({outside.policy}'s)", file=sys.stderr)
        print(f"  harvest's urgent reclaims: {out['urgent_reclaims']} (p99 {out['reclaim_delay_ms_p99']} ms); servers auto: "
              f"{out['servers_auto']}", file=sys.stderr)
    print(json.dumps(out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
