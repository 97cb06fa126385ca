"""The fleet replay's text report and its machine-readable form (`harvest replay --servers N`)."""

from __future__ import annotations

import statistics
from typing import Any, Sequence

from harvest.replay.comparison import ReplaySettings
from harvest.replay.fleet import FleetComparison, RoutedFleet
from harvest.replay.profile_source import ReplayProfile
from harvest.replay.report import fmt, outside_dict, outside_summary, setup_dict, setup_lines
from harvest.replay.results import BASELINES, OutsideProfile, jsonable, steps_outside_profile
from harvest.replay.trainer_model import TrainerModel
from harvest.replay.workload import TraceWindow


def load_note(num_servers: int, window: TraceWindow) -> str:
    """What each server's load is against the trace's, and how to give it the trace's own."""
    per_server = window.rate_scale / (window.time_scale * num_servers)
    return (
        f"each server gets 1/{num_servers} of the requests: x{per_server:.3g} the trace window's request rate "
        f"(--rate-scale {num_servers} gives each about the trace's own, a fleet sized to {num_servers}x the trace)"
    )


def _finetune(trainer: TrainerModel, gpu_equivalents: float) -> str:
    """A finetune figure in the report's unit: tokens/s when known (a fleet's run to
    hundreds of thousands: whole tokens), else whole-GPU trainer equivalents."""
    value = gpu_equivalents if trainer.tokens_per_gpu_s is None else trainer.to_tokens(gpu_equivalents)
    return fmt(value, ",.0f") if abs(value) >= 1000 else fmt(value, ".4g")


def _router_lines(routed: RoutedFleet, trainer: TrainerModel) -> list[str]:
    shares = routed.requests_per_server
    lines = [
        f"{routed.router}: requests per server {min(shares)} .. {max(shares)} (median {statistics.median(shares):g})",
        f"{'policy':<12}{'GPUs':>6}{'finetune':>12}{'per GPU':>9}{'server min':>12}{'median':>9}{'max':>9}"
        f"{'vs separate':>13}{'vs static':>11}{'p99 worst ms':>14}{'median':>8}{'steps over %':>14}{'servers over':>14}",
    ]
    for name, result in routed.results.items():
        if result.refused is not None:
            lines.append(f"{name:<12}{result.num_gpus:>6}  REFUSED: {result.refused}")
            continue
        m = result.metrics
        spread = m["server_finetune_gpu_equivalents"]
        lines.append(
            f"{name:<12}{result.num_gpus:>6}{_finetune(trainer, m['finetune_gpu_equivalents']):>12}"
            f"{_finetune(trainer, m['finetune_per_gpu']):>9}"
            + "".join(f"{_finetune(trainer, spread[k]):>{w}}" for k, w in (("min", 12), ("median", 9), ("max", 9)))
            + "".join(f"{fmt(result.gain_vs.get(b), '+.1f', 100, '%'):>{w}}" for b, w in zip(BASELINES, (13, 11)))
            + f"{fmt(m['tpot_p99_worst_ms'], '.1f'):>14}{fmt(m['tpot_p99_median_ms'], '.1f'):>8}"
            f"{fmt(m['step_violation_rate'], '.2f', 100):>14}{m['servers_violating']:>14}"
        )
    for name, result in routed.results.items():
        memory = result.memory if result.refused is None else None
        if memory is None:
            continue
        if memory["kind"] == "static":
            lines.append(f"  {name} memory: {memory['chunks_lent_mean']:.0f} chunks the trainers' throughout, window "
                         f"{memory['window_stages_mean_per_server']:.0f} stages per server; no reclaim")
            continue
        lines.append(
            f"  {name} memory: {memory['urgent_reclaims']} urgent reclaim(s) (decode waited {memory['reclaim_delay_ms_p99']:.1f} ms "
            f"p99, {memory['reclaim_delay_s_total']:.3g} s in all), {memory['chunks_lent_mean']:.1f} chunks lent on average over "
            f"the fleet, window {memory['window_stages_mean_per_server']:.1f} stages per server"
        )
    return lines


def text(
    fleets: Sequence[FleetComparison],
    profile: ReplayProfile,
    trainer: TrainerModel,
    settings: ReplaySettings,
    window: TraceWindow,
    trace_label: str,
    plots: Sequence[str] = (),
    auto=None,
) -> str:
    """``auto``: the fleet_size.AutoSize that chose the servers (``--servers auto``)."""
    first = fleets[0]
    lines = [
        f"harvest replay: a fleet of {first.num_servers} decode servers, {first.num_requests} requests from {trace_label} "
        f"({window.describe()}); {first.horizon_s:.1f} s simulated; seed {first.seed}; {outside_summary(outside_of(fleets))}",
        f"  {load_note(first.num_servers, window)}",
        *([f"  {auto.describe()}"] if auto is not None else []),
        *setup_lines(profile, trainer, settings),
        f"router: least-loaded estimates each server's decode load, what its running requests add to a step "
        f"({1e3 * first.load_model.per_request_s:.3g} ms each + {1e6 * first.load_model.per_token_s:.3g} us per token held), "
        f"each decoding a token per {1e3 * first.load_model.step_s:.1f} ms step (decode alone at the mean batch an even split gives a server)",
    ]
    for routed in first.routers.values():
        lines += ["", *_router_lines(routed, trainer)]
    lines += [
        "",
        f"finetune unit: {trainer.unit}; finetune: the fleet's, the sum over its servers; per GPU: over the servers x the "
        "policy's GPUs per instance (separate: decode + trainer GPUs); server min/median/max: one instance's.",
        f"TPOT p99 per output token on each server: the worst server's and the median server's; steps over %: the fleet's "
        f"decode steps over the {settings.target_tpot_ms:g} ms target; servers over: servers whose TPOT p99 is over it.",
    ]
    if len(fleets) > 1:
        lines += ["", f"across {len(fleets)} seeds (harvest; mean, min .. max):"]
        for router, values in _across(fleets).items():
            for key, series in values.items():
                if series:
                    lines.append(f"  {router} {key}: {statistics.fmean(series):.4g} ({min(series):.4g} .. {max(series):.4g})")
    if plots:
        lines += ["", "plots: " + ", ".join(plots)]
    return "\n".join(lines)


def _across(fleets: Sequence[FleetComparison]) -> dict[str, dict[str, list[float]]]:
    out: dict[str, dict[str, list[float]]] = {}
    for fleet in fleets:
        for router, routed in fleet.routers.items():
            series = out.setdefault(router, {"finetune_per_gpu": [], "tpot_p99_worst_ms": [], "step_violation_rate": []})
            harvest = routed.result("harvest")
            if harvest is not None and harvest.refused is None:
                for key, values in series.items():
                    values.append(harvest.metrics[key])
    return out


def outside_of(fleets: Sequence[FleetComparison]) -> OutsideProfile:
    """The steps outside the profiled range over every seed's and router's fleet (each
    policy's fraction over all its servers' steps)."""
    return steps_outside_profile(routed.results for fleet in fleets for routed in fleet.routers.values())


def as_dict(
    fleets: Sequence[FleetComparison],
    profile: ReplayProfile,
    trainer: TrainerModel,
    settings: ReplaySettings,
    window: TraceWindow,
    trace_label: str,
    plots: Sequence[str] = (),
    auto=None,
) -> dict[str, Any]:
    first = fleets[0]
    data = jsonable(
        {
            **setup_dict(profile, trainer, settings, window, trace_label),
            **outside_dict(outside_of(fleets)),
            "fleet": {
                "num_servers": first.num_servers,
                "routers": list(first.routers),
                "load": load_note(first.num_servers, window),
                "runs": [f.to_dict() for f in fleets],
            },
            "plots": list(plots),
        }
    )
    if auto is not None:
        data["fleet"]["auto"] = jsonable(auto.to_dict())
    return data
