"""`harvest replay --servers auto`: the smallest fleet that holds the target.

A fleet of N servers *holds* the target when, under every router replayed, every server
running the sizing policy (harvest, when replayed) has its TPOT p99 within
``--target-tpot-ms`` and its queue delay p99 within ``--max-queue-delay-s``. The search
replays only that policy, splitting the trace as ``--servers N`` does: N = 1, 2, 4, ...
until one holds (at most ``--max-servers``), then bisection; it assumes a fleet that holds
still holds with a server more, and lists every fleet replayed (``probes``) so a reader
can check. Deterministic: the same trace, seed and options give the same N.

Rules: docs/fleet.md, 'Capacity planning: the simulated fleet' ('Sizing the fleet').
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, Sequence

from harvest.replay import fleet as fleet_mod
from harvest.replay import policies as policy_mod
from harvest.replay.comparison import ReplaySettings
from harvest.replay.policies import DECODE_ONLY, HARVEST, SEPARATE, STATIC, LatencyErrors, PolicyRefused
from harvest.replay.profile_source import ReplayProfile
from harvest.replay.trace import TraceRequest
from harvest.replay.trainer_model import TrainerModel

SIZING_ORDER = (HARVEST, DECODE_ONLY, SEPARATE, STATIC)
DEFAULT_MAX_SERVERS = 64
DEFAULT_MAX_QUEUE_DELAY_S = 1.0


@dataclasses.dataclass(frozen=True)
class AutoSettings:
    max_servers: int = DEFAULT_MAX_SERVERS
    max_queue_delay_s: float = DEFAULT_MAX_QUEUE_DELAY_S

    def check(self) -> None:
        n = self.max_servers
        if isinstance(n, bool) or not isinstance(n, int) or n < 1:
            raise ValueError(f"--max-servers={n!r}: must be an integer >= 1 (the largest fleet --servers auto tries)")
        q = self.max_queue_delay_s
        if isinstance(q, bool) or not isinstance(q, (int, float)) or not (math.isfinite(q) and q >= 0):
            raise ValueError(f"--max-queue-delay-s={q!r}: must be a finite number of seconds >= 0")


@dataclasses.dataclass(frozen=True)
class Probe:
    """One fleet replayed by the search: the sizing policy's worst server over the routers."""

    num_servers: int
    holds: bool
    tpot_p99_worst_ms: float
    queue_delay_p99_worst_s: float
    violation_rate: float  # the fleet's tokens over the target, the worst router's
    servers_violating: int  # servers over the target or the queue bound, the worst router's

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


@dataclasses.dataclass(frozen=True)
class AutoSize:
    num_servers: int | None  # None: no fleet up to max_servers holds the target
    policy: str
    target_tpot_ms: float
    routers: tuple[str, ...]
    auto: AutoSettings
    probes: tuple[Probe, ...]  # in the order replayed

    def to_dict(self) -> dict[str, Any]:
        return {
            "num_servers": self.num_servers,
            "policy": self.policy,
            "target_tpot_ms": self.target_tpot_ms,
            "max_queue_delay_s": self.auto.max_queue_delay_s,
            "max_servers": self.auto.max_servers,
            "routers": list(self.routers),
            "probes": [p.to_dict() for p in self.probes],
        }

    def describe(self) -> str:
        """One line: what was chosen and why."""
        held = (f"every {self.policy} server within the {self.target_tpot_ms:g} ms target (TPOT p99) and a queue delay p99 "
                f"of at most {self.auto.max_queue_delay_s:g} s under {', '.join(self.routers)}")
        tried = "; ".join(
            f"{p.num_servers}: {'holds' if p.holds else 'not held'} (worst p99 {p.tpot_p99_worst_ms:.1f} ms, queue "
            f"{p.queue_delay_p99_worst_s:.2f} s)"
            for p in sorted(self.probes, key=lambda p: p.num_servers)
        )
        if self.num_servers is None:
            return f"servers auto: no fleet of 1 .. {self.auto.max_servers} servers holds {held}; replayed {tried}"
        return f"servers auto: {self.num_servers}, the smallest fleet with {held}; replayed {tried}"


def sizing_policy(profile: ReplayProfile, trainer: TrainerModel, settings: ReplaySettings) -> str:
    """The policy that must hold the target (module doc); ValueError if none can run."""
    for name in SIZING_ORDER:
        if name not in settings.policies:
            continue
        try:
            policy_mod.make_policy(name, profile, trainer, LatencyErrors(), settings.scheduler_config())
        except PolicyRefused:
            continue
        return name
    raise ValueError(f"--servers auto: none of the policies replayed ({', '.join(settings.policies)}) runs with "
                     f"{profile.label}, so no fleet can be sized")


def size(
    requests: Sequence[TraceRequest],
    profile: ReplayProfile,
    trainer: TrainerModel,
    settings: ReplaySettings,
    routers: tuple[str, ...],
    auto: AutoSettings = AutoSettings(),
    seed: int = 0,
) -> AutoSize:
    """The smallest fleet of 1 .. ``auto.max_servers`` that holds the target (module doc)."""
    auto.check()
    policy = sizing_policy(profile, trainer, settings)
    probe_settings = dataclasses.replace(settings, policies=(policy,))
    probes: dict[int, Probe] = {}

    def holds(n: int) -> bool:
        if n not in probes:
            fleet = fleet_mod.run(requests, profile, trainer, probe_settings, fleet_mod.FleetSettings(n, routers), seed)
            probes[n] = _probe(n, fleet, policy, settings.target_tpot_ms, auto.max_queue_delay_s)
        return probes[n].holds

    low, n = 0, 1  # the largest fleet found not to hold, the next to try
    while not holds(n):
        low = n
        if n >= auto.max_servers:
            return AutoSize(None, policy, settings.target_tpot_ms, routers, auto, tuple(probes.values()))
        n = min(2 * n, auto.max_servers)
    high = n
    while high - low > 1:
        middle = (low + high) // 2
        if holds(middle):
            high = middle
        else:
            low = middle
    return AutoSize(high, policy, settings.target_tpot_ms, routers, auto, tuple(probes.values()))


def _probe(n: int, fleet: fleet_mod.FleetComparison, policy: str, target_ms: float, max_queue_s: float) -> Probe:
    worst_p99 = worst_queue = worst_rate = 0.0
    worst_servers = 0
    for routed in fleet.routers.values():
        result = routed.results[policy]
        over = 0
        for metrics in result.server_metrics:
            p99, queue = metrics["tpot_p99_ms"], metrics["queue_delay_p99_s"]
            p99 = 0.0 if math.isnan(p99) else p99  # a server that decoded nothing
            queue = 0.0 if math.isnan(queue) else queue
            worst_p99, worst_queue = max(worst_p99, p99), max(worst_queue, queue)
            over += p99 > target_ms or queue > max_queue_s
        worst_servers = max(worst_servers, over)
        worst_rate = max(worst_rate, result.metrics["violation_rate"])
    return Probe(n, worst_servers == 0, worst_p99, worst_queue, worst_rate, worst_servers)
