"""A fleet of N decode servers behind a router (`harvest replay --servers N`): the
requests split by each router (:mod:`harvest.replay.router`), every server's share
replayed through every policy as one decode instance is (:mod:`harvest.replay.comparison`),
and the fleet's figures per router and policy.

Invariants: every server, router and policy is accounted over one horizon, so the fleet's
figures are sums (throughput) or worst cases (TPOT p99) of its servers'; a fleet of one is
exactly the single-server replay.

Rules: docs/fleet.md, 'The fleet's accounting (harvest/replay/fleet.py)'.
"""

from __future__ import annotations

import dataclasses
import hashlib
import math
import statistics
import time
from typing import Sequence

import numpy as np

from harvest.replay import comparison, kv_memory, router
from harvest.replay.comparison import Comparison, ReplaySettings, Simulated
from harvest.replay.profile_source import ReplayProfile
from harvest.replay.results import add_gains, jsonable
from harvest.replay.router import ALL_ROUTERS, DecodeLoadModel
from harvest.replay.trace import TraceRequest
from harvest.replay.trainer_model import TrainerModel

# Per server in the JSON, one list per metric indexed by server (the full metrics of 64
# servers × policies × routers would make a megabyte line of --json).
PER_SERVER_KEYS = ("finetune_gpu_equivalents", "tpot_p99_ms", "step_violation_rate", "violation_rate", "queue_delay_p99_s")


@dataclasses.dataclass(frozen=True)
class FleetSettings:
    num_servers: int = 1
    routers: tuple[str, ...] = ALL_ROUTERS

    def check(self) -> None:
        """Raise ValueError naming the option for anything invalid, before any replay."""
        n = self.num_servers
        if isinstance(n, bool) or not isinstance(n, int) or n < 1:
            raise ValueError(f"--servers={n!r}: must be an integer >= 1 (decode servers behind the router)")
        unknown = [r for r in self.routers if r not in ALL_ROUTERS]
        if unknown or not self.routers or len(set(self.routers)) != len(self.routers):
            raise ValueError(f"--router {','.join(self.routers)!r}: choose distinct ones of {', '.join(ALL_ROUTERS)}")


@dataclasses.dataclass
class FleetPolicyResult:
    """One policy over the fleet; ``server_metrics[s]`` is server ``s``'s PolicyResult
    metrics (empty when refused: a refusal is the profile's, the same on every server)."""

    name: str
    num_gpus: int  # the fleet's: servers × the policy's GPUs per instance
    refused: str | None
    metrics: dict = dataclasses.field(default_factory=dict)
    server_metrics: list[dict] = dataclasses.field(default_factory=list)
    gain_vs: dict[str, float | None] = dataclasses.field(default_factory=dict)
    memory: dict | None = None  # kv_memory.fleet_summary when the KV pool is modelled and the policy holds some

    def to_dict(self) -> dict:
        out = {"name": self.name, "num_gpus": self.num_gpus, "refused": self.refused}
        if self.refused is None:
            per_server = {key: [m[key] for m in self.server_metrics] for key in PER_SERVER_KEYS}
            out.update(metrics=jsonable(self.metrics), gain_vs=jsonable(self.gain_vs), per_server=jsonable(per_server))
            if self.memory is not None:
                out["memory"] = jsonable(self.memory)
        return out


@dataclasses.dataclass
class RoutedFleet:
    """One router's split of the requests and every policy over the fleet."""

    router: str
    requests_per_server: list[int]
    results: dict[str, FleetPolicyResult]
    wall_s: dict[str, float]  # "routing", then simulation + summary per policy over all servers

    def result(self, name: str) -> FleetPolicyResult | None:
        return self.results.get(name)

    def to_dict(self) -> dict:
        return {
            "router": self.router,
            "requests_per_server": self.requests_per_server,
            "wall_s": self.wall_s,
            "policies": {name: result.to_dict() for name, result in self.results.items()},
        }


@dataclasses.dataclass
class FleetComparison:
    seed: int
    num_servers: int
    num_requests: int
    horizon_s: float
    load_model: DecodeLoadModel  # what the least-loaded router knows (router module doc)
    routers: dict[str, RoutedFleet]

    def to_dict(self) -> dict:
        return {
            "seed": self.seed,
            "num_servers": self.num_servers,
            "num_requests": self.num_requests,
            "horizon_s": self.horizon_s,
            "router_load_model": self.load_model.to_dict(),
            "routers": {name: routed.to_dict() for name, routed in self.routers.items()},
        }


def server_seed(seed: int, server: int) -> int:
    """The noise seed of ``server`` in a replay seeded ``seed`` (module doc)."""
    if server == 0:
        return seed
    return int.from_bytes(hashlib.blake2b(f"{seed}/{server}".encode(), digest_size=8).digest(), "little")


def run(
    requests: Sequence[TraceRequest],
    profile: ReplayProfile,
    trainer: TrainerModel,
    settings: ReplaySettings,
    fleet: FleetSettings,
    seed: int = 0,
    show_progress: bool = False,
) -> FleetComparison:
    """Replay ``requests`` (sorted by arrival) over ``fleet.num_servers`` servers behind
    each of ``fleet.routers``, every policy of ``settings`` on every server."""
    fleet.check()
    settings.check()
    num_servers = fleet.num_servers
    load_model = router.load_model(requests, num_servers, profile, settings.limits)
    simulated: dict[str, list[Simulated]] = {}
    shares: dict[str, list[int]] = {}
    routing_s: dict[str, float] = {}
    bar = _progress(len(fleet.routers) * num_servers, show_progress)
    try:
        for name in fleet.routers:
            start = time.perf_counter()
            split = router.split(requests, router.assign(name, requests, num_servers, load_model), num_servers)
            routing_s[name] = time.perf_counter() - start
            shares[name] = [len(share) for share in split]
            simulated[name] = []
            for server, share in enumerate(split):
                simulated[name].append(comparison.simulate_policies(share, profile, trainer, settings, server_seed(seed, server)))
                if bar is not None:
                    bar.update(1)
    finally:
        if bar is not None:
            bar.close()
    horizon = max(s.end_s for sims in simulated.values() for s in sims)
    routed = {}
    for name, sims in simulated.items():
        servers = [comparison.summarise_policies(s, horizon, profile, settings, seed) for s in sims]
        routed[name] = _routed(name, servers, shares[name], routing_s[name], settings, trainer)
    return FleetComparison(seed, num_servers, len(requests), horizon, load_model, routed)


def _routed(name: str, servers: list[Comparison], shares: list[int], routing_s: float, settings: ReplaySettings, trainer: TrainerModel) -> RoutedFleet:
    results = {policy: fleet_result(policy, servers, settings.target_tpot_ms, trainer) for policy in settings.policies}
    add_gains(results)
    wall = {"routing": routing_s}
    for policy in settings.policies:
        wall[policy] = sum(c.wall_s.get(policy, 0.0) for c in servers)
    return RoutedFleet(name, shares, results, wall)


def fleet_result(name: str, servers: Sequence[Comparison], target_ms: float, trainer: TrainerModel) -> FleetPolicyResult:
    """Policy ``name`` over ``servers`` (each one server's replay over the fleet's horizon)."""
    results = [c.results[name] for c in servers]
    num_gpus = results[0].num_gpus * len(results)
    if results[0].refused is not None:
        return FleetPolicyResult(name, num_gpus, results[0].refused)
    metrics = [r.metrics for r in results]
    finetune = [m["finetune_gpu_equivalents"] for m in metrics]
    total = math.fsum(finetune)
    p99 = np.array([m["tpot_p99_ms"] for m in metrics], dtype=float)
    measured = np.isfinite(p99)  # a server that decoded nothing has no TPOT
    worst = int(np.argmax(np.where(measured, p99, -np.inf))) if measured.any() else None
    steps = sum(m["decode_steps"] for m in metrics)
    tokens = sum(m["decode_tokens"] for m in metrics)
    # the rates are counts over the server's steps or tokens: the products are those counts
    steps_over = sum(round(m["step_violation_rate"] * m["decode_steps"]) for m in metrics)
    steps_outside = sum(round(m["steps_outside_profile_fraction"] * m["decode_steps"]) for m in metrics)
    tokens_over = sum(round(m["violation_rate"] * m["decode_tokens"]) for m in metrics)
    spread = {"min": min(finetune), "median": statistics.median(finetune), "max": max(finetune)}
    tokens_per_s = trainer.to_tokens(total)
    fleet_metrics = {
        "finetune_gpu_equivalents": total,
        "finetune_per_gpu": total / num_gpus,
        "finetune_tokens_per_s": tokens_per_s,
        "finetune_tokens_per_s_per_gpu": None if tokens_per_s is None else tokens_per_s / num_gpus,
        "server_finetune_gpu_equivalents": spread,
        "server_finetune_tokens_per_s": None if trainer.tokens_per_gpu_s is None else {k: trainer.to_tokens(v) for k, v in spread.items()},
        "tpot_p99_worst_ms": math.nan if worst is None else float(p99[worst]),
        "tpot_p99_worst_server": worst,
        "tpot_p99_median_ms": float(np.median(p99[measured])) if measured.any() else math.nan,
        "step_violation_rate": steps_over / steps if steps else 0.0,
        "violation_rate": tokens_over / tokens if tokens else 0.0,
        "servers_violating": int((p99[measured] > target_ms).sum()),
        "steps_outside_profile_fraction": steps_outside / steps if steps else 0.0,
        "decode_steps": steps,
        "decode_tokens": tokens,
        "requests_finished": sum(m["requests_finished"] for m in metrics),
        "requests_dropped": sum(m["requests_dropped"] for m in metrics),
        "requests_prefill_only": sum(m["requests_prefill_only"] for m in metrics),
    }
    memories = [r.memory for r in results]
    memory = kv_memory.fleet_summary(memories) if all(m is not None for m in memories) else None
    return FleetPolicyResult(name, num_gpus, None, fleet_metrics, metrics, memory=memory)


def _progress(total: int, show: bool):
    if not show:
        return None
    from tqdm import tqdm

    return tqdm(total=total, desc="replay fleet", unit="server", dynamic_ncols=True, mininterval=0.5)
