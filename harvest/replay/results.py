"""From simulations to the numbers the replay reports: per-policy metrics and the gains
of each policy over the baselines.

Every policy is accounted over one horizon; TPOT samples are per output token; finetune
throughput is reported per instance and per GPU (``separate`` counts its training GPUs,
a tensor-parallel instance its N GPUs), and ``gain_vs[b]`` compares per-GPU figures. The
steps outside the profile's measured range are counted and warned about.

Definitions: docs/design.md, 'The replay's results (harvest/replay/results.py)'.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, Iterable, Mapping

import numpy as np

from harvest.replay.policies import SEPARATE, STATIC, BasePolicy
from harvest.replay.profile_source import ReplayProfile
from harvest.replay.simulator import DecodeRun

BASELINES = (SEPARATE, STATIC)
# Over this fraction of a policy's steps outside the profile's measured range, the replay
# warns: those steps' latencies are the profile's extrapolations, not measurements.
OUTSIDE_PROFILE_WARN_FRACTION = 0.05


@dataclasses.dataclass(frozen=True)
class OutsideProfile:
    """The largest fraction of a policy's decode steps outside the profiled range (over
    the policies that ran, every seed and router), and whose."""

    fraction: float
    policy: str | None

    @property
    def warns(self) -> bool:
        return self.fraction > OUTSIDE_PROFILE_WARN_FRACTION


def steps_outside_profile(results_per_run: Iterable[Mapping[str, Any]]) -> OutsideProfile:
    """From PolicyResults (or a fleet's FleetPolicyResults), one mapping per replay."""
    worst = OutsideProfile(0.0, None)
    for results in results_per_run:
        for name, result in results.items():
            if result.refused is None and (worst.policy is None or result.metrics["steps_outside_profile_fraction"] > worst.fraction):
                worst = OutsideProfile(result.metrics["steps_outside_profile_fraction"], name)
    return worst


def weighted_percentile(values: np.ndarray, weights: np.ndarray, q: float) -> float:
    """The smallest value with at least fraction ``q`` of the total weight at or below it."""
    if len(values) == 0:
        return math.nan
    order = np.argsort(values, kind="stable")
    cumulative = np.cumsum(weights[order], dtype=float)
    index = int(np.searchsorted(cumulative, q * cumulative[-1], side="left"))
    return float(values[order][min(index, len(values) - 1)])


def _percentiles(values: np.ndarray) -> tuple[float, float]:
    values = values[np.isfinite(values)]
    if len(values) == 0:
        return math.nan, math.nan
    p50, p99 = np.percentile(values, [50, 99])
    return float(p50), float(p99)


@dataclasses.dataclass
class PolicyResult:
    name: str
    num_gpus: int
    level: str
    run: DecodeRun | None  # None when refused
    refused: str | None = None
    metrics: dict[str, Any] = dataclasses.field(default_factory=dict)
    gain_vs: dict[str, float | None] = dataclasses.field(default_factory=dict)
    extra: dict[str, Any] = dataclasses.field(default_factory=dict)
    memory: Any = None  # harvest.replay.kv_memory.MemorySummary when the KV pool is modelled and the policy holds some

    def to_dict(self) -> dict:
        out = {"name": self.name, "num_gpus": self.num_gpus, "refused": self.refused, "level": self.level}
        if self.refused is None:
            out.update(metrics=jsonable(self.metrics), gain_vs=jsonable(self.gain_vs), **jsonable(self.extra))
            if self.memory is not None:
                out["memory"] = jsonable(self.memory.to_dict())
        return out


def summarise(
    policy: BasePolicy,
    run: DecodeRun,
    horizon_s: float,
    target_ms: float,
    profile: ReplayProfile,
    kv_bytes_per_token: int,
) -> PolicyResult:
    lat_ms = run.step_latency_s * 1e3
    tokens = run.step_batch_size
    over = lat_ms > target_ms
    num_tokens = int(tokens.sum())
    tail_idle = max(0.0, horizon_s - run.end_s)
    step_work = float(np.dot(run.step_trainer_share, run.step_latency_s))  # one GPU's (module doc)
    idle_work = policy.idle_share * (run.idle_s + tail_idle)
    colocated_work = profile.tp_size * (step_work + idle_work)  # every rank's GPU alike
    dedicated_work = policy.dedicated_trainer_gpus * horizon_s
    ft = (colocated_work + dedicated_work) / horizon_s if horizon_s > 0 else 0.0
    trainer_tokens = policy.trainer.to_tokens(ft)

    finished = np.isfinite(run.finished_s) & (run.decode_steps > 0)
    queue_delay = run.admitted_s - run.arrival_s
    per_request_tpot = (run.finished_s[finished] - run.admitted_s[finished]) / run.decode_steps[finished]
    queue_p50, queue_p99 = _percentiles(queue_delay[run.decode_steps > 0])  # NaN (dropped) filtered there
    req_p50, req_p99 = _percentiles(per_request_tpot * 1e3)

    held_time = float(np.dot(run.step_sum_context, run.step_latency_s))
    r = profile.profiled_range
    inside = (
        (run.step_batch_size >= r.min_batch_size)
        & (run.step_batch_size <= r.max_batch_size)
        & (run.step_sum_context >= r.min_sum_context)
        & (run.step_sum_context <= r.max_sum_context)
    )
    levels, counts = np.unique(run.step_level, return_counts=True)
    metrics = {
        "finetune_gpu_equivalents": ft,
        "finetune_per_gpu": ft / policy.num_gpus,
        "finetune_tokens_per_s": trainer_tokens,
        "finetune_tokens_per_s_per_gpu": None if trainer_tokens is None else trainer_tokens / policy.num_gpus,
        "tpot_p50_ms": weighted_percentile(lat_ms, tokens, 0.50),
        "tpot_p99_ms": weighted_percentile(lat_ms, tokens, 0.99),
        "tpot_max_ms": float(lat_ms.max()) if len(lat_ms) else math.nan,
        "violation_rate": float(tokens[over].sum() / num_tokens) if num_tokens else 0.0,
        "step_violation_rate": float(over.mean()) if len(over) else 0.0,
        "request_tpot_p50_ms": req_p50,
        "request_tpot_p99_ms": req_p99,
        "queue_delay_p50_s": queue_p50,
        "queue_delay_p99_s": queue_p99,
        "decode_steps": run.num_steps,
        "decode_tokens": num_tokens,
        "batch_size_mean": float(np.dot(tokens, run.step_latency_s) / horizon_s) if horizon_s > 0 else 0.0,
        "batch_size_max": int(tokens.max()) if len(tokens) else 0,
        "busy_fraction": float(run.step_latency_s.sum() / horizon_s) if horizon_s > 0 else 0.0,
        "requests_finished": int(finished.sum()),
        "requests_dropped": run.num_dropped,
        "requests_prefill_only": run.num_prefill_only,
        "kv_capacity_tokens": run.kv_capacity_tokens,
        "kv_held_mean_tokens": held_time / horizon_s if horizon_s > 0 else 0.0,
        "kv_held_peak_tokens": int(run.step_sum_context.max()) if run.num_steps else 0,
        "kv_reserved_peak_tokens": int(run.step_reserved_tokens.max()) if run.num_steps else 0,
        "kv_capacity_gib": run.kv_capacity_tokens * kv_bytes_per_token / 2**30,
        "kv_held_mean_gib": held_time / horizon_s * kv_bytes_per_token / 2**30 if horizon_s > 0 else 0.0,
        "kv_held_peak_gib": (int(run.step_sum_context.max()) if run.num_steps else 0) * kv_bytes_per_token / 2**30,
        "steps_by_level": {str(int(lv)): int(c) for lv, c in zip(levels, counts)},
        "steps_outside_profile_fraction": float(1.0 - inside.mean()) if run.num_steps else 0.0,
        "trainer_idle_share": policy.idle_share,
        "end_s": run.end_s,
    }
    return PolicyResult(policy.name, policy.num_gpus, policy.level_label(), run, None, metrics, {}, policy.extra())


def add_gains(results: Mapping[str, PolicyResult]) -> None:
    """Fill every result's ``gain_vs`` for the baselines that ran (one instance's
    PolicyResults, or a fleet's FleetPolicyResults: the same fields)."""
    for result in results.values():
        if result.refused is not None:
            continue
        for baseline in BASELINES:
            base = results.get(baseline)
            if base is None or base.refused is not None or baseline == result.name:
                continue
            denominator = base.metrics["finetune_per_gpu"]
            result.gain_vs[baseline] = result.metrics["finetune_per_gpu"] / denominator - 1.0 if denominator > 0 else None


def jsonable(value):
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, dict):
        return {str(k): jsonable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [jsonable(v) for v in value]
    if isinstance(value, (np.integer,)):
        return int(value)
    if isinstance(value, (np.floating,)):
        return jsonable(float(value))
    return value
