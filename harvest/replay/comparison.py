"""One replay: the same requests through every requested policy, summarised over a
common horizon, with gains over the baselines.

``separate`` and ``decode-only`` decode identically (same profile level, same error
draws), so their decode GPU is simulated once and shared; their results differ only in
the trainer accounting.
"""

from __future__ import annotations

import dataclasses
import math
import time
from typing import Any, Mapping, Sequence

from harvest.replay import kv_memory
from harvest.replay import policies as policy_mod
from harvest.replay.policies import ALL_POLICIES, DECODE_ONLY, HARVEST, SEPARATE, STATIC, LatencyErrors, PolicyRefused
from harvest.replay.profile_source import ReplayProfile
from harvest.replay.results import PolicyResult, add_gains, summarise
from harvest.replay.simulator import MAX_STEP_S, DecodeLimits, DecodeRun, simulate
from harvest.replay.trace import TraceRequest
from harvest.replay.trainer_model import TrainerModel
from harvest.schedule import SchedulerConfig

LLAMA3_8B_KV_BYTES_PER_TOKEN = 2 * 32 * 8 * 128 * 2  # K and V × 32 layers × 8 KV heads × 128 dims × bf16 = 128 KiB
_SHARED_DECODE = frozenset({DECODE_ONLY, SEPARATE})


@dataclasses.dataclass(frozen=True)
class ReplaySettings:
    limits: DecodeLimits
    target_tpot_ms: float = 40.0
    scheduler_overrides: Mapping[str, Any] = dataclasses.field(default_factory=dict)
    error_scale: float = 1.0
    error_noise: float = 0.0
    kv_bytes_per_token: int = LLAMA3_8B_KV_BYTES_PER_TOKEN
    policies: tuple[str, ...] = ALL_POLICIES
    tp_size: int | None = None  # the decode instance's tensor-parallel degree; None: the profile's
    # The KV pool's lending (harvest) and StaticMode's fixed share, modelled and reported
    # (harvest.replay.kv_memory); None: not modelled, decode never waits for memory.
    memory: kv_memory.MemorySettings | None = None

    def scheduler_config(self) -> SchedulerConfig:
        """The harvest policy's scheduler configuration (validated; ValueError names the key)."""
        return SchedulerConfig.from_mapping({**self.scheduler_overrides, "target_tpot_ms": self.target_tpot_ms}, "--scheduler")

    def check(self) -> None:
        """Raise ValueError naming the option for anything invalid, before any replay."""
        unknown = [p for p in self.policies if p not in ALL_POLICIES]
        if unknown or not self.policies or len(set(self.policies)) != len(self.policies):
            raise ValueError(f"--policies {','.join(self.policies)!r}: choose distinct ones of {', '.join(ALL_POLICIES)}")
        target = self.target_tpot_ms
        if isinstance(target, bool) or not isinstance(target, (int, float)) or not 0 < target < math.inf:
            raise ValueError(f"--target-tpot-ms={target!r}: must be a finite number of ms > 0, e.g. 40")
        if isinstance(self.kv_bytes_per_token, bool) or not isinstance(self.kv_bytes_per_token, int) or self.kv_bytes_per_token < 1:
            raise ValueError(f"--kv-bytes-per-token={self.kv_bytes_per_token!r}: must be an integer >= 1")
        tp = self.tp_size
        if tp is not None and (isinstance(tp, bool) or not isinstance(tp, int) or tp < 1):
            raise ValueError(f"--tp={tp!r}: must be an integer >= 1 (tensor-parallel ranks of the decode instance)")
        self.scheduler_config()
        LatencyErrors(self.error_scale, self.error_noise)
        if self.memory is not None:
            self.memory.check()


def check_tp(profile: ReplayProfile, tp_size: int | None) -> None:
    """ValueError naming both degrees when the replay asks for another tensor-parallel
    degree than the profile was measured at (``None``: the profile's, nothing to check).
    A step's latency depends on it (all-reduces, each rank's share of the model), so a
    profile describes one degree only."""
    if tp_size is None or tp_size == profile.tp_size:
        return
    raise ValueError(
        f"--tp {tp_size}: {profile.label} was measured at tp={profile.tp_size} (provenance.tp_size), and step "
        f"latencies depend on the TP degree; replay it with --tp {profile.tp_size}, or give a profile measured with "
        f"`harvest profile --tp {tp_size}`"
    )


def check_largest_step(profile: ReplayProfile, limits: DecodeLimits) -> None:
    """ValueError naming the profile and level if any level predicts a step over
    MAX_STEP_S for the largest batch the replay can form (``max_batch_size`` requests
    holding the whole KV capacity). The profile's checks make both stages grow with batch
    size and context, so that batch is where each level's prediction is largest."""
    batch, tokens = limits.max_batch_size, limits.kv_capacity_tokens
    padded = profile.buckets.padded(batch)
    predictor = profile.predictor
    for level, solo in enumerate(profile.solo):
        predictions = [(f"profile.stage1[{level}]", solo.predict(padded, tokens))]
        if predictor is not None:
            predictions += [
                (f"profile.stage2 ({name}) at level {level}", predictor.evaluate(level, batch, tokens, phase))
                for phase, name in enumerate(predictor.phase_names)
            ]
        for field, seconds in predictions:
            if not seconds <= MAX_STEP_S:
                raise ValueError(
                    f"{profile.label}: {field} predicts {seconds:.3g} s for one decode step of {batch} requests holding "
                    f"{tokens} tokens (--max-batch-size, --kv-capacity-tokens); no decode step takes over {MAX_STEP_S:g} s, "
                    "so the profile's coefficients are broken"
                )


@dataclasses.dataclass
class Comparison:
    seed: int
    num_requests: int
    horizon_s: float
    results: dict[str, PolicyResult]
    wall_s: dict[str, float]  # simulation + summary time per policy (0 for a shared decode run)

    def result(self, name: str) -> PolicyResult | None:
        return self.results.get(name)

    def to_dict(self) -> dict:
        return {
            "seed": self.seed,
            "num_requests": self.num_requests,
            "horizon_s": self.horizon_s,
            "wall_s": self.wall_s,
            "policies": {name: result.to_dict() for name, result in self.results.items()},
        }


@dataclasses.dataclass
class Simulated:
    """Every requested policy's decode run over one decode instance's requests, before
    the summary (which needs the horizon: the latest end of every instance replayed)."""

    num_requests: int
    built: dict[str, policy_mod.BasePolicy]
    runs: dict[str, DecodeRun]
    refused: dict[str, PolicyResult]
    wall_s: dict[str, float]

    @property
    def end_s(self) -> float:
        return max((r.end_s for r in self.runs.values()), default=0.0)


def simulate_policies(
    requests: Sequence[TraceRequest],
    profile: ReplayProfile,
    trainer: TrainerModel,
    settings: ReplaySettings,
    seed: int = 0,
    show_progress: bool = False,
) -> Simulated:
    """Simulate ``requests`` under ``settings.policies``; refused policies are recorded
    as such and the others still run."""
    settings.check()
    check_tp(profile, settings.tp_size)
    check_largest_step(profile, settings.limits)
    built: dict[str, policy_mod.BasePolicy] = {}
    refused: dict[str, PolicyResult] = {}
    for name in settings.policies:
        try:
            built[name] = policy_mod.make_policy(
                name, profile, trainer, LatencyErrors(settings.error_scale, settings.error_noise, seed), settings.scheduler_config()
            )
        except PolicyRefused as exc:
            refused[name] = PolicyResult(name, policy_mod.num_gpus(name, profile.tp_size), "", None, refused=str(exc))

    runs: dict[str, DecodeRun] = {}
    wall: dict[str, float] = {}
    for name, policy in built.items():
        shared = next((other for other in runs if name in _SHARED_DECODE and other in _SHARED_DECODE), None)
        if shared is not None:
            runs[name], wall[name] = runs[shared], 0.0
            continue
        start = time.perf_counter()
        runs[name] = _simulate(requests, policy, settings.limits, show_progress,
                               lending_model(policy, settings, profile.tp_size))
        wall[name] = time.perf_counter() - start
    return Simulated(len(requests), built, runs, refused, wall)


def summarise_policies(
    simulated: Simulated, horizon_s: float, profile: ReplayProfile, settings: ReplaySettings, seed: int = 0
) -> Comparison:
    """Every policy's metrics over ``horizon_s`` (at least ``simulated.end_s``), with gains."""
    results = dict(simulated.refused)
    wall = dict(simulated.wall_s)
    for name, policy in simulated.built.items():
        start = time.perf_counter()
        run = simulated.runs[name]
        results[name] = summarise(policy, run, horizon_s, settings.target_tpot_ms, profile, settings.kv_bytes_per_token)
        results[name].memory = memory_summary(policy, run, horizon_s, settings)
        wall[name] += time.perf_counter() - start
    ordered = {name: results[name] for name in settings.policies}
    add_gains(ordered)
    return Comparison(seed, simulated.num_requests, horizon_s, ordered, wall)


def run(
    requests: Sequence[TraceRequest],
    profile: ReplayProfile,
    trainer: TrainerModel,
    settings: ReplaySettings,
    seed: int = 0,
    show_progress: bool = False,
) -> Comparison:
    """Replay ``requests`` through ``settings.policies`` on one decode instance, all
    summarised over the latest policy's end; refused policies are reported as such and
    the others still run."""
    simulated = simulate_policies(requests, profile, trainer, settings, seed, show_progress)
    return summarise_policies(simulated, simulated.end_s, profile, settings, seed)


def lending_model(policy: policy_mod.BasePolicy, settings: ReplaySettings,
                  tp_size: int = 1) -> kv_memory.LendingModel | None:
    """harvest's KV lending on its instance (of ``tp_size`` ranks) when the memory is
    modelled, else None."""
    if settings.memory is None or policy.name != HARVEST:
        return None
    limits = settings.limits
    capacity = max(1, int(limits.kv_capacity_tokens * policy.kv_fraction))  # as the simulator's
    return kv_memory.LendingModel(capacity, settings.memory, settings.target_tpot_ms, limits.max_batch_size,
                                  settings.kv_bytes_per_token, tp_size)


def memory_summary(policy: policy_mod.BasePolicy, run: DecodeRun, horizon_s: float, settings: ReplaySettings):
    """The policy's KV memory over the horizon (harvest's lending, StaticMode's fixed
    share), or None (not modelled; separate and decode-only lend nothing)."""
    memory = settings.memory
    if memory is None:
        return None
    if run.memory is not None:
        lent = run.memory
    elif policy.name == STATIC:
        lent = kv_memory.static_run(settings.limits.kv_capacity_tokens, run.kv_capacity_tokens, memory)
    else:
        return None
    return kv_memory.summarise(lent, horizon_s, memory, settings.kv_bytes_per_token, run.num_steps)


def _simulate(requests, policy, limits: DecodeLimits, show_progress: bool, memory=None) -> DecodeRun:
    if not show_progress:
        return simulate(requests, policy, limits, memory=memory)
    from tqdm import tqdm

    with tqdm(total=len(requests), desc=f"replay {policy.name}", unit="req", dynamic_ncols=True, mininterval=0.5) as bar:

        def progress(arrived: int) -> None:
            bar.update(arrived - bar.n)

        return simulate(requests, policy, limits, progress, memory)
