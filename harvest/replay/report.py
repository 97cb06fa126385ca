"""The replay's text report and its machine-readable form."""

from __future__ import annotations

import math
import statistics
from typing import Any, Sequence

from harvest.replay.comparison import Comparison, ReplaySettings
from harvest.replay.profile_source import ReplayProfile
from harvest.replay.results import BASELINES, OUTSIDE_PROFILE_WARN_FRACTION, OutsideProfile, jsonable, steps_outside_profile
from harvest.replay.trainer_model import TrainerModel
from harvest.replay.workload import TraceWindow

SUMMARY_KEYS = ("ft_gain_vs_separate", "ft_gain_vs_static", "harvest_violation_rate", "harvest_finetune_per_gpu")


def normalisation(tp_size: int) -> str:
    """How the finetune figures are normalised, for a decode instance of ``tp_size`` ranks."""
    if tp_size == 1:
        return (
            "finetune throughput is per GPU: every policy serves the whole trace on one decode instance; separate uses 2 "
            "GPUs (decode alone + trainer alone = 1.0), the co-located policies 1 (Harli, arXiv:2511.11729, §8.1-8.2, compares on equal GPU counts)"
        )
    return (
        f"finetune throughput is per GPU: every policy serves the whole trace on one decode instance of tp={tp_size} "
        f"({tp_size} GPUs, every rank co-running as the profile's rank 0 did); separate uses {2 * tp_size} GPUs ({tp_size} "
        f"decoding alone + {tp_size} training alone = {tp_size}.0), the co-located policies {tp_size} (Harli, arXiv:2511.11729, §8.1-8.2, "
        "compares on equal GPU counts); per instance, multiply by the GPUs"
    )


def fmt(value: float | None, spec: str, scale: float = 1.0, suffix: str = "") -> str:
    if value is None or (isinstance(value, float) and not math.isfinite(value)):
        return "-"
    return f"{value * scale:{spec}}{suffix}"


def headline(comparison: Comparison) -> dict[str, float | None]:
    """The numbers a benchmark or a seed sweep tracks."""
    harvest = comparison.result("harvest")
    ran = harvest is not None and harvest.refused is None
    return {
        "ft_gain_vs_separate": harvest.gain_vs.get("separate") if ran else None,
        "ft_gain_vs_static": harvest.gain_vs.get("static") if ran else None,
        "harvest_violation_rate": harvest.metrics["violation_rate"] if ran else None,
        "harvest_finetune_per_gpu": harvest.metrics["finetune_per_gpu"] if ran else None,
    }


def profiled_range_text(profile: ReplayProfile) -> str:
    r = profile.profiled_range
    return f"batch sizes {r.min_batch_size}..{r.max_batch_size}, Σctx {r.min_sum_context:.0f}..{r.max_sum_context:.0f} tokens"


def outside_summary(outside: OutsideProfile) -> str:
    """For the report's first line: how many steps the profile did not measure."""
    if outside.policy is None:
        return "no decode step replayed"
    share = f"{100 * outside.fraction:.1f} %"
    if outside.warns:
        return (f"WARNING: {share} of {outside.policy}'s steps outside the profiled range (over "
                f"{100 * OUTSIDE_PROFILE_WARN_FRACTION:g} %): their latencies are extrapolated")
    return f"{share} of steps outside the profiled range"


def outside_warning(outside: OutsideProfile, profile: ReplayProfile, trace_label: str) -> str | None:
    """The warning for stderr when too many steps lie outside the profiled range, else None."""
    if not outside.warns:
        return None
    return (
        f"warning: {100 * outside.fraction:.1f} % of {outside.policy}'s decode steps lie outside the range {profile.label} "
        f"measured ({profiled_range_text(profile)}): the replay extrapolates their latencies, so its QoS and gains describe the "
        f"profile's extrapolation, not the device; profile a grid that covers the trace: "
        f"harvest profile --grid-from-trace {trace_label} ..."
    )


def setup_lines(profile: ReplayProfile, trainer: TrainerModel, settings: ReplaySettings) -> list[str]:
    """The report's lines on the profile, the decode instance and the trainer model."""
    limits = settings.limits
    kv_gib = limits.kv_capacity_tokens * settings.kv_bytes_per_token / 2**30
    tp = f"tp={profile.tp_size} ({profile.tp_size} GPUs), " if profile.tp_size > 1 else ""
    return [
        f"profile: {profile.label}: {profile.description}" + ("  [SYNTHETIC, not measured]" if profile.synthetic else ""),
        f"  ladder: {profile.ladder.describe()}; stage 2: " + ("present" if profile.has_stage2 else f"MISSING ({profile.stage2_missing})"),
        f"  profiled range: {profiled_range_text(profile)}",
        f"decode instance: {tp}max batch {limits.max_batch_size}, KV capacity {limits.kv_capacity_tokens} tokens "
        f"({kv_gib:.1f} GiB at {settings.kv_bytes_per_token} B/token); TPOT target {settings.target_tpot_ms:g} ms",
        *(
            ["  one shared level (no SM partitioning): harvest can only run or pause the trainer, and static co-runs on that level"]
            if profile.ladder.num_levels == 1
            else []
        ),
        f"trainer throughput: {trainer.model}",
        f"  solo rate: {trainer.rate_source}",
        f"  profile: {trainer.profile_note}",
        f"predictor error injected: co-located steps x{settings.error_scale:g}, noise {100 * settings.error_noise:g} % per step",
        *memory_setup_lines(settings),
    ]


def memory_setup_lines(settings: ReplaySettings) -> list[str]:
    """The report's line on the KV memory model (none when it is not modelled)."""
    memory = settings.memory
    if memory is None:
        return []
    cfg = memory.config
    chunk_mib = memory.tokens_per_chunk * settings.kv_bytes_per_token / 2**20
    return [
        f"KV memory: chunks of {memory.tokens_per_chunk} tokens ({chunk_mib:g} MiB); a reclaim {memory.reclaim_ms_per_chunk:.3g} ms "
        f"and a lend {memory.lend_ms_per_chunk:.3g} ms per chunk ({memory.source}); reserve {memory.reserve_label}, hysteresis "
        f"{cfg.hysteresis_chunks} chunk(s), at most {100 * cfg.max_lend_fraction:g} % lent, a lending pass every "
        f"{1e3 * cfg.lend_interval_s:g} ms; trainer stages of {memory.stage_bytes / 2**20:.0f} MiB, {memory.max_stages} at most",
    ]


def memory_line(name: str, memory: dict) -> str:
    """One policy's KV memory over the replay, in words (``memory``: its summary's metrics)."""
    if memory["kind"] == "static":
        return (f"  {name}: {memory['chunks_lent_mean']:.0f} chunks ({memory['lent_gib_mean']:.2f} GiB) the trainer's from start "
                f"to end (the share decode does not get), window {memory['window_stages_mean']:.0f} stages; no reclaim")
    urgent = memory["urgent_reclaims"]
    waited = (f"decode waited {memory['reclaim_delay_ms_p99']:.1f} ms p99, {memory['reclaim_delay_ms_max']:.1f} ms max, "
              f"{memory['reclaim_delay_s_total']:.3g} s in all" if urgent else "decode never waited for memory")
    return (
        f"  {name}: {memory['chunks_lent_mean']:.1f} chunks lent on average ({memory['chunks_lent_min']} .. "
        f"{memory['chunks_lent_max']} of {memory['num_chunks']}), window {memory['window_stages_mean']:.1f} stages "
        f"({memory['window_stages_min']} .. {memory['window_stages_max']}); {memory['chunks_lent_total']} chunks lent and "
        f"{memory['chunks_reclaimed_total']} reclaimed in all; {urgent} urgent reclaim(s) ({waited}); reserve "
        f"{memory['reserve_tokens_final']} tokens at the end, {memory['reserve_tokens_max']} at most ({memory['reserve_reason']})"
    )


def text(
    comparisons: Sequence[Comparison],
    profile: ReplayProfile,
    trainer: TrainerModel,
    settings: ReplaySettings,
    window: TraceWindow,
    trace_label: str,
    plots: Sequence[str] = (),
) -> str:
    first = comparisons[0]
    outside = outside_of(comparisons)
    lines = [
        f"harvest replay: {first.num_requests} requests from {trace_label} ({window.describe()}); "
        f"{first.horizon_s:.1f} s simulated; seed {first.seed}; {outside_summary(outside)}",
        *setup_lines(profile, trainer, settings),
        "",
        f"{'policy':<12}{'GPUs':>5}{'finetune/GPU':>14}{'vs separate':>13}{'vs static':>11}"
        f"{'TPOT p50':>10}{'p99 ms':>8}{'viol %':>8}{'KV peak':>9}{'queue p99':>11}",
    ]
    for name, result in first.results.items():
        if result.refused is not None:
            lines.append(f"{name:<12}{result.num_gpus:>5}  REFUSED: {result.refused}")
            continue
        m = result.metrics
        ft = m["finetune_per_gpu"] if trainer.tokens_per_gpu_s is None else m["finetune_tokens_per_s_per_gpu"]
        lines.append(
            f"{name:<12}{result.num_gpus:>5}{fmt(ft, '.4g'):>14}"
            + "".join(f"{fmt(result.gain_vs.get(b), '+.1f', 100, '%'):>{w}}" for b, w in zip(BASELINES, (13, 11)))
            + f"{fmt(m['tpot_p50_ms'], '.1f'):>10}{fmt(m['tpot_p99_ms'], '.1f'):>8}"
            f"{fmt(m['violation_rate'], '.2f', 100):>8}{m['kv_held_peak_tokens'] / m['kv_capacity_tokens']:>8.0%} "
            f"{fmt(m['queue_delay_p99_s'], '.3f', 1, ' s'):>10}"
        )
    lines += ["", f"finetune/GPU unit: {trainer.unit}; {normalisation(profile.tp_size)}."]
    lines.append("TPOT and violations are per output token (viol %: tokens from steps over the target); KV peak: most KV held / the policy's KV capacity.")
    lines.append("")
    for name, result in first.results.items():
        if result.refused is not None:
            continue
        m = result.metrics
        lines.append(
            f"{name}: {result.level}; {m['decode_steps']} steps, mean batch {m['batch_size_mean']:.1f} (max {m['batch_size_max']}), "
            f"busy {100 * m['busy_fraction']:.0f} %; KV held mean {m['kv_held_mean_gib']:.2f} GiB, peak {m['kv_held_peak_gib']:.2f} "
            f"of {m['kv_capacity_gib']:.2f} GiB; {m['requests_finished']} requests finished, {m['requests_dropped']} dropped "
            f"(larger than the KV capacity); steps outside the profiled range: {100 * m['steps_outside_profile_fraction']:.1f} %"
        )
        scheduler = result.extra.get("scheduler")
        if scheduler:
            reasons = ", ".join(f"{k} {v}" for k, v in scheduler["decisions_by_reason"].items() if v)
            lines.append(
                f"  scheduler: {reasons}; steps by level {m['steps_by_level']}; final margin {scheduler['margin']:.3f}; "
                f"step violations {100 * m['step_violation_rate']:.2f} %"
            )
    memories = [(name, r.memory.metrics) for name, r in first.results.items() if r.refused is None and r.memory is not None]
    if memories:
        interval = next(r.memory.series["interval_s"] for r in first.results.values() if r.memory is not None)
        lines += ["", f"KV memory (series per {interval:g} s in the JSON: chunks lent, window stages, urgent reclaims; "
                      "separate and decode-only lend nothing):"]
        lines += [memory_line(name, memory) for name, memory in memories]
    if len(comparisons) > 1:
        lines += ["", f"across {len(comparisons)} seeds (mean, min .. max):"]
        for key, values in _across(comparisons).items():
            if values:
                lines.append(f"  {key}: {statistics.fmean(values):.4g} ({min(values):.4g} .. {max(values):.4g})")
    if plots:
        lines += ["", "plots: " + ", ".join(plots)]
    return "\n".join(lines)


def _across(comparisons: Sequence[Comparison]) -> dict[str, list[float]]:
    out: dict[str, list[float]] = {key: [] for key in SUMMARY_KEYS}
    for comparison in comparisons:
        for key, value in headline(comparison).items():
            if value is not None:
                out[key].append(value)
    return out


def setup_dict(
    profile: ReplayProfile, trainer: TrainerModel, settings: ReplaySettings, window: TraceWindow, trace_label: str
) -> dict[str, Any]:
    """The JSON form's keys on the input, the profile, the decode instance and the trainer model."""
    limits = settings.limits
    return {
        "trace": trace_label,
        "window": window.describe(),
        "tp_size": profile.tp_size,  # the decode instance's ranks, one GPU each (the profile's)
        "profile": {
            "label": profile.label,
            "description": profile.description,
            "synthetic": profile.synthetic,
            "device_kind": profile.device_kind,
            "ladder": profile.ladder.to_dict(),
            "profiled_range": profile.profiled_range.to_dict(),
            "stage2_missing": profile.stage2_missing,
            "corun_trainer_units": [
                {"level": r.level, "points": r.num_points, "units": r.trainer_units, "units_per_s": r.units_per_s}
                for r in profile.trainer_records
            ],
        },
        "settings": {
            "target_tpot_ms": settings.target_tpot_ms,
            "max_batch_size": limits.max_batch_size,
            "kv_capacity_tokens": limits.kv_capacity_tokens,
            "kv_bytes_per_token": settings.kv_bytes_per_token,
            "error_scale": settings.error_scale,
            "error_noise": settings.error_noise,
            "scheduler_overrides": dict(settings.scheduler_overrides),
            "policies": list(settings.policies),
            "memory": None if settings.memory is None else settings.memory.to_dict(settings.kv_bytes_per_token),
        },
        "trainer_model": trainer.to_dict(),
        "normalisation": normalisation(profile.tp_size),
    }


def outside_of(comparisons: Sequence[Comparison]) -> OutsideProfile:
    """The steps outside the profiled range over every seed's replay."""
    return steps_outside_profile(c.results for c in comparisons)


def outside_dict(outside: OutsideProfile) -> dict[str, Any]:
    """The JSON form's keys on the steps outside the profiled range."""
    return {
        "steps_outside_profile_fraction": outside.fraction,
        "steps_outside_profile_policy": outside.policy,
        "steps_outside_profile_warning": outside.warns,
    }


def as_dict(
    comparisons: Sequence[Comparison],
    profile: ReplayProfile,
    trainer: TrainerModel,
    settings: ReplaySettings,
    window: TraceWindow,
    trace_label: str,
    plots: Sequence[str] = (),
) -> dict[str, Any]:
    summary = {
        key: {"mean": statistics.fmean(v), "min": min(v), "max": max(v)} if v else None
        for key, v in _across(comparisons).items()
    }
    return jsonable(
        {
            **setup_dict(profile, trainer, settings, window, trace_label),
            **outside_dict(outside_of(comparisons)),
            "headline": headline(comparisons[0]),
            "across_seeds": summary,
            "runs": [c.to_dict() for c in comparisons],
            "plots": list(plots),
        }
    )
