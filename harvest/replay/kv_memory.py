"""The decode instance's KV pool in the replay: what requests hold, what harvest lends the
trainer, and what decode waits for when it needs lent memory back.

The ``harvest`` policy lends through the server's own code (:mod:`harvest.memory.lending`,
:class:`~harvest.memory.demand.DemandReserve`, :func:`~harvest.memory.demand.free_target`),
called as harvest/sglang/kv_lending.py calls it, with harvest.yaml's ``memory`` settings
(``--memory KEY=VALUE``). With ``reclaim_ahead`` (the default), as in the server: the free
slots kept are the reserve plus what admission set aside for the running requests'
decode (the simulator's admission reserves each request's whole footprint: the set-aside
is that less what its requests hold), and the auto reserve follows the requests arriving
(priced as admission prices them) instead of the allocations. With ``lending_thread``
(auto: on, the replay's servers being GPU servers), lends and reclaims run their driver
calls off the decode thread and delay no step (their driver time is still totalled);
inline, each delays the next step by its time. Tensor-parallel servers keep neither, as
the server's ranks do. Invariants: a step's
allocations that do not fit the free mapped slots are an urgent reclaim the step waits
for; StaticMode lends a fixed 40 % for the whole replay and never reclaims; SeparateMode
and decode-only lend nothing.

Rules: docs/design.md, 'The replay's KV pool (harvest/replay/kv_memory.py)'.
"""

from __future__ import annotations

import dataclasses
import math
from array import array
from typing import Any, Mapping

import numpy as np

from harvest.config import MemoryConfig
from harvest.memory import lend_costs, lending_setup
from harvest.memory.demand import UPDATE_INTERVAL_S, with_free_target
from harvest.memory.lending import plan, reclaim_count
from harvest.settings import from_mapping

MIB = 2**20
DEFAULT_TOKENS_PER_CHUNK = 1024  # Llama-3-8B: 128 MiB chunks (module doc)
DEFAULT_FIGURE_CHUNK_BYTES = lend_costs.DEFAULT_FIGURE_CHUNK_BYTES  # 128 MiB: the chunk the default figures are for
DEFAULT_RECLAIM_MS_PER_CHUNK = lend_costs.DEFAULT_MS_PER_CHUNK  # 7 ms: harvest.yaml's stated default
DEFAULT_LEND_MS_PER_CHUNK = lend_costs.DEFAULT_MS_PER_CHUNK  # the H100 measured both alike (gpu-validation.md)
# One Llama-3-8B decoder layer: q, o 4096x4096; k, v 4096x1024; gate, up, down 4096x14336;
# two norms of 4096: 218,112,000 parameters in bf16.
LLAMA3_8B_LAYER_BYTES = 218_112_000 * 2
LLAMA3_8B_STAGES = 34  # the embedding, 32 decoder layers, the final norm with the LM head
SERIES_INTERVAL_S = 10.0
MAX_SERIES_POINTS = 720  # a longer replay widens the interval (by whole multiples of 10 s)
LENDING, STATIC_SHARE = "lending", "static"


@dataclasses.dataclass(frozen=True)
class MemorySettings:
    """How the replay models the KV pool (module doc). ``reclaim_ms_per_chunk`` and
    ``lend_ms_per_chunk`` are per chunk of ``tokens_per_chunk`` (already scaled);
    ``config``: harvest.yaml's ``memory`` section (its ``reclaim_ms_per_chunk`` is
    replaced by the figure here); ``source``: where the figures come from, in words."""

    tokens_per_chunk: int = DEFAULT_TOKENS_PER_CHUNK
    reclaim_ms_per_chunk: float = DEFAULT_RECLAIM_MS_PER_CHUNK
    lend_ms_per_chunk: float = DEFAULT_LEND_MS_PER_CHUNK
    stage_bytes: int = LLAMA3_8B_LAYER_BYTES
    max_stages: int = LLAMA3_8B_STAGES
    config: MemoryConfig = dataclasses.field(default_factory=MemoryConfig)
    source: str = "defaults"

    def check(self) -> None:
        """ValueError naming the option for anything invalid."""
        for name, flag in (("tokens_per_chunk", "--kv-chunk-tokens"), ("stage_bytes", "--trainer-stage-mib"),
                           ("max_stages", "--trainer-stages")):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{flag}={value!r}: must be {'a number > 0' if name == 'stage_bytes' else 'an integer >= 1'}")
        for name in ("reclaim_ms_per_chunk", "lend_ms_per_chunk"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not (math.isfinite(value) and value >= 0):
                raise ValueError(f"--memory {name}={value!r}: must be a finite number of ms >= 0")

    @property
    def reserve_label(self) -> str:
        fixed = self.config.reserve_tokens
        return "auto" if fixed is None else str(fixed)

    def to_dict(self, kv_bytes_per_token: int) -> dict[str, Any]:
        cfg = self.config
        return {
            "tokens_per_chunk": self.tokens_per_chunk,
            "chunk_mib": self.tokens_per_chunk * kv_bytes_per_token / MIB,
            "reclaim_ms_per_chunk": self.reclaim_ms_per_chunk,
            "lend_ms_per_chunk": self.lend_ms_per_chunk,
            "figures_from": self.source,
            "reserve_tokens": self.reserve_label,
            "reserve_percentile": cfg.reserve_percentile,
            "reserve_window_s": cfg.reserve_window_s,
            "reserve_lower_after_s": cfg.reserve_lower_after_s,
            "hysteresis_chunks": cfg.hysteresis_chunks,
            "max_lend_fraction": cfg.max_lend_fraction,
            "lend_interval_s": cfg.lend_interval_s,
            "trainer_stage_mib": self.stage_bytes / MIB,
            "trainer_stages": self.max_stages,
        }


def resolve(
    profile,
    overrides: Mapping[str, Any] | None = None,
    tokens_per_chunk: int | None = None,
    kv_bytes_per_token: int = 128 * 1024,
    stage_mib: float | None = None,
    max_stages: int | None = None,
) -> tuple[MemorySettings, str | None]:
    """The replay's memory settings from ``profile`` (a ReplayProfile) and the options,
    with the warning to print when the profile has no lend/reclaim figures (else None).
    ValueError naming the option for a bad one (``--memory`` keys are harvest.yaml's
    ``memory`` settings)."""
    overrides = dict(overrides or {})
    config = from_mapping(MemoryConfig, overrides, where="--memory: ")
    tpc = DEFAULT_TOKENS_PER_CHUNK if tokens_per_chunk is None else tokens_per_chunk
    if isinstance(tpc, bool) or not isinstance(tpc, int) or tpc < 1:
        raise ValueError(f"--kv-chunk-tokens={tpc!r}: must be an integer >= 1")
    if stage_mib is not None and not (isinstance(stage_mib, (int, float)) and math.isfinite(stage_mib) and stage_mib > 0):
        raise ValueError(f"--trainer-stage-mib={stage_mib!r}: must be a number of MiB > 0")
    # the replay's chunk is a modelling choice: the default figure is scaled to it, as a measured one is
    costs = lend_costs.resolve(tpc * kv_bytes_per_token, measured=getattr(profile, "memory", None),
                               measured_where=getattr(profile, "label", "the profile"), configured_reclaim_ms=config.reclaim_ms_per_chunk,
                               configured_where="--memory reclaim_ms_per_chunk",
                               default_chunk_bytes=DEFAULT_FIGURE_CHUNK_BYTES)
    reclaim, lend = costs.reclaim_ms_per_chunk, costs.lend_ms_per_chunk
    settings = MemorySettings(
        tokens_per_chunk=tpc,
        reclaim_ms_per_chunk=reclaim,
        lend_ms_per_chunk=lend,
        stage_bytes=LLAMA3_8B_LAYER_BYTES if stage_mib is None else max(1, round(stage_mib * MIB)),
        max_stages=LLAMA3_8B_STAGES if max_stages is None else max_stages,
        config=dataclasses.replace(config, reclaim_ms_per_chunk=reclaim),
        source=costs.detail,
    )
    settings.check()
    return settings, None if costs.warning is None else f"warning: {costs.warning}"


@dataclasses.dataclass(frozen=True)
class MemoryRun:
    """What one simulation did with the KV pool: the chunks lent as a step function
    (``lent_chunks[i]`` from ``event_s[i]`` until the next event), every urgent reclaim,
    and the totals."""

    kind: str  # LENDING (harvest) or STATIC_SHARE (StaticMode's fixed share)
    tokens_per_chunk: int
    num_chunks: int
    event_s: np.ndarray
    lent_chunks: np.ndarray
    urgent_s: np.ndarray
    urgent_chunks: np.ndarray
    urgent_delay_s: np.ndarray
    chunks_lent_total: int = 0
    chunks_reclaimed_total: int = 0  # urgent reclaims' chunks included
    lend_s_total: float = 0.0  # driver time of every lend
    reclaim_s_total: float = 0.0  # driver time of the scheduled reclaims
    scheduled_delay_s_total: float = 0.0  # of those, the time that delayed a step (not absorbed by idling)
    reserve_tokens_final: int | None = None
    reserve_tokens_max: int | None = None
    reserve_reason: str = ""


class LendingModel:
    """harvest's KV lending on one simulated instance of ``capacity_tokens`` slots (module
    doc). The simulator calls :meth:`start`, :meth:`before_step` / :meth:`after_step`
    around every step, :meth:`idle` over every gap and :meth:`finish`."""

    def __init__(self, capacity_tokens: int, memory: MemorySettings, target_tpot_ms: float, max_batch_size: int,
                 kv_bytes_per_token: int, tp_size: int = 1):
        tpc = memory.tokens_per_chunk
        slots = capacity_tokens + 1  # slot 0: SGLang's padding slot, never free
        num_chunks = lending_setup.pool_chunks(capacity_tokens, tpc)
        self.top_size = slots - (num_chunks - 1) * tpc  # the top chunk's slots (fewer: never lendable)
        self.highest_lendable = num_chunks - 1 if self.top_size == tpc else num_chunks - 2
        cfg = memory.config
        self.policy = lending_setup.lending_policy(tokens_per_chunk=tpc, num_chunks=num_chunks, pool_tokens=capacity_tokens,
                                                   max_batch_size=max_batch_size, kv_bytes_per_token=kv_bytes_per_token,
                                                   target_tpot_ms=target_tpot_ms, memory=cfg)
        self.reserve = lending_setup.demand_reserve(self.policy, pool_tokens=capacity_tokens, target_tpot_ms=target_tpot_ms,
                                                    memory=cfg, reclaim_ms_per_chunk=memory.reclaim_ms_per_chunk)
        self._record = None if self.reserve is None else self.reserve.demand.record
        one_rank = tp_size == 1  # a tensor-parallel server's ranks lend inline and watch no admissions
        self.reclaim_ahead = cfg.reclaim_ahead and one_rank
        self.lending_thread = (True if cfg.lending_thread is None else cfg.lending_thread) and one_rank
        self.promised = 0  # admission's set-aside for the running requests' decode (reclaim ahead)
        self.capacity = capacity_tokens
        self.tpc = tpc
        self.lend_interval_s = cfg.lend_interval_s
        self.reclaim_s = memory.reclaim_ms_per_chunk / 1e3
        self.lend_s = memory.lend_ms_per_chunk / 1e3
        self.lent = 0
        self.held = 0
        self._last_pass = -math.inf
        self._reserve_at = -math.inf
        self._reserve_max = self.policy.reserve_tokens
        self._events_s, self._events_lent = array("d"), array("q")
        self._urgent_s, self._urgent_chunks, self._urgent_delay = array("d"), array("q"), array("d")
        self._lent_total = self._reclaimed_total = 0
        self._lend_s_total = self._reclaim_s_total = 0.0
        self._owed_s = 0.0  # the scheduler thread's lending time since the last step: delays the next
        self._scheduled_delay_s = 0.0

    # -- the simulator's calls ------------------------------------------------------------
    def start(self, t: float) -> None:
        """Before the first step: an idle server's lending pass."""
        self._event(t)
        self.lending_pass(t)

    def before_step(self, t: float, held: int) -> float:
        """The step starting at ``t`` holds ``held`` tokens: what it allocated since the last
        step comes out of the free mapped slots. Returns the seconds decode waits for an
        urgent reclaim (0.0 when the allocations fit), plus the lending work the scheduler
        thread did since the last step."""
        owed, self._owed_s = self._owed_s, 0.0
        self._scheduled_delay_s += owed
        allocated = held - self.held
        free = self.capacity - self.lent * self.tpc - self.held
        self.held = held
        if self._record is not None and allocated > 0 and not self.reclaim_ahead:
            self._record(t, allocated)
        if allocated <= free:
            return owed
        chunks = min(self.lent, -(-(allocated - free) // self.tpc))
        delay = chunks * self.reclaim_s
        self.lent -= chunks
        self._reclaimed_total += chunks
        self._urgent_s.append(t)
        self._urgent_chunks.append(chunks)
        self._urgent_delay.append(delay)
        self._event(t)
        return delay + owed

    def arrived(self, t: float, tokens: int) -> None:
        """A request arrived at ``t`` whose admission sets aside ``tokens`` (its prompt and
        its decode): with reclaim ahead, the demand the auto reserve follows."""
        if self._record is not None and self.reclaim_ahead:
            self._record(t, tokens)

    def after_step(self, t: float, held: int, promised: int = 0) -> None:
        """The step ended at ``t`` and its finished requests freed theirs: ``held`` tokens
        remain, and admission has set aside ``promised`` more for the running requests'
        decode. The free-target check, then the lending pass when one is due."""
        self.held = held
        self.promised = max(0, promised) if self.reclaim_ahead else 0
        if self.lent:
            count = reclaim_count(self._target_policy(), self.capacity - self.lent * self.tpc - held, self.lent)
            if count:
                self._reclaim(t, count)
        if t - self._last_pass >= self.lend_interval_s:
            self.lending_pass(t)

    def idle(self, t: float, until: float) -> None:
        """No request runs from ``t`` to ``until`` (the next arrival): of the idle ticks'
        lending passes, those that can change anything: the first due, the first that works
        out the auto reserve again, and one just before the arrival."""
        self.promised = 0  # no running request
        first = max(t, self._last_pass + self.lend_interval_s)
        if first <= until:
            self.lending_pass(first)
        if self.reserve is not None and self._reserve_at + UPDATE_INTERVAL_S < until:
            self.lending_pass(max(self._reserve_at + UPDATE_INTERVAL_S, self._last_pass + self.lend_interval_s))
        if until - self._last_pass >= self.lend_interval_s:
            self.lending_pass(until)
        self._owed_s = 0.0  # done while no request ran

    def finish(self, t: float) -> MemoryRun:
        self.idle(t, t + self.lend_interval_s)  # the server idles after the last step
        reserve = self.policy.reserve_tokens
        reason = self.reserve.current.reason if self.reserve is not None else "memory.reserve_tokens (fixed)"
        return MemoryRun(
            LENDING, self.tpc, self.policy.num_chunks,
            np.frombuffer(self._events_s, dtype=np.float64), np.frombuffer(self._events_lent, dtype=np.int64),
            np.frombuffer(self._urgent_s, dtype=np.float64), np.frombuffer(self._urgent_chunks, dtype=np.int64),
            np.frombuffer(self._urgent_delay, dtype=np.float64),
            self._lent_total, self._reclaimed_total, self._lend_s_total, self._reclaim_s_total,
            self._scheduled_delay_s, reserve, self._reserve_max, reason,
        )

    # -- the lending controller's decisions ----------------------------------------------
    def lending_pass(self, t: float) -> None:
        """``KvLendingController.maybe_lend``: the auto reserve when due, then the plan."""
        self._last_pass = t
        if self.reserve is not None and t - self._reserve_at >= UPDATE_INTERVAL_S:
            self._reserve_at = t
            if self.reclaim_ahead:  # what arrived() records (the server says so at its update too)
                self.reserve.recorded = "tokens arriving (as admission prices them)"
            decision = self.reserve.update(t)
            if decision.tokens != self.policy.reserve_tokens:
                self.policy = dataclasses.replace(self.policy, reserve_tokens=decision.tokens)
                self._reserve_max = max(self._reserve_max, decision.tokens)
        if not self._could_act():
            return
        free_per_chunk, lent = self.chunk_view()
        decision = plan(self._target_policy(), free_per_chunk, lent)
        if decision.reclaim_count:
            self._reclaim(t, decision.reclaim_count)
        elif decision.lend:
            self._lend(t, len(decision.lend))

    def _could_act(self) -> bool:
        """Whether :func:`plan` could lend or reclaim now: a necessary condition of each, in
        O(1) (plan reclaims below the reserve or over the cap, and lends a chunk only if the
        free mapped slots stay at the reserve plus the hysteresis after it). Skipping the
        plan otherwise changes nothing (tests/replay/test_memory.py checks it)."""
        p = self._target_policy()
        free = self.capacity - self.lent * self.tpc - self.held
        if self.lent > p.max_lent_chunks or (free < p.reserve_tokens and self.lent):
            return True
        return self.lent < p.max_lent_chunks and free - self.tpc >= p.reserve_tokens + p.hysteresis_chunks * self.tpc

    def _target_policy(self):
        """The policy with the free target in place of the reserve, as the server plans."""
        return with_free_target(self.policy, promised_tokens=self.promised)

    def chunk_view(self) -> tuple[list[int], list[bool]]:
        """Free slots per chunk and which chunks are lent, as the controller reads them from
        SGLang's free lists: the held tokens (and the padding slot) packed into the lowest
        mapped chunks, the lent chunks the highest lendable ones."""
        tpc, lent = self.tpc, self.lent
        partial_top = self.top_size != tpc
        below = self.highest_lendable - lent + 1  # mapped chunks under the lent ones (chunk 0 among them)
        used = 1 + self.held
        full = min(below, used // tpc)
        free = [0] * full
        if full < below:
            free.append(tpc - (used - full * tpc))
            free += [tpc] * (below - full - 1)
        free += [0] * lent
        flags = [False] * below + [True] * lent
        if partial_top:
            free.append(self.top_size - max(0, used - below * tpc))
            flags.append(False)
        return free, flags

    def _lend(self, t: float, count: int) -> None:
        self.lent += count
        self._lent_total += count
        self._lend_s_total += count * self.lend_s
        if not self.lending_thread:
            self._owed_s += count * self.lend_s
        self._event(t)

    def _reclaim(self, t: float, count: int) -> None:
        self.lent -= count
        self._reclaimed_total += count
        self._reclaim_s_total += count * self.reclaim_s
        if not self.lending_thread:
            self._owed_s += count * self.reclaim_s
        self._event(t)

    def _event(self, t: float) -> None:
        self._events_s.append(t)
        self._events_lent.append(self.lent)


def static_run(capacity_tokens: int, static_tokens: int, memory: MemorySettings) -> MemoryRun:
    """StaticMode: the trainer holds the pool's share decode does not get, as whole chunks,
    from start to end."""
    chunks = (capacity_tokens - static_tokens) // memory.tokens_per_chunk
    empty_f, empty_i = np.zeros(0, dtype=np.float64), np.zeros(0, dtype=np.int64)
    return MemoryRun(STATIC_SHARE, memory.tokens_per_chunk, math.ceil((capacity_tokens + 1) / memory.tokens_per_chunk),
                     np.zeros(1, dtype=np.float64), np.array([chunks], dtype=np.int64), empty_f, empty_i, empty_f,
                     reserve_reason="StaticMode: a fixed share of the pool")


# -- summaries ----------------------------------------------------------------------------

@dataclasses.dataclass
class MemorySummary:
    """One policy's memory over the replay's horizon: scalar ``metrics``, the ``series``
    (per ``interval_s``) and the urgent reclaims' delays (ms; for a fleet's percentiles)."""

    metrics: dict[str, Any]
    series: dict[str, Any]
    urgent_delays_ms: np.ndarray

    def to_dict(self) -> dict[str, Any]:
        return {**self.metrics, "series": self.series}


def series_interval(horizon_s: float) -> float:
    """SERIES_INTERVAL_S, widened by whole multiples so a replay has at most MAX_SERIES_POINTS."""
    if horizon_s <= SERIES_INTERVAL_S * MAX_SERIES_POINTS:
        return SERIES_INTERVAL_S
    return SERIES_INTERVAL_S * math.ceil(horizon_s / (SERIES_INTERVAL_S * MAX_SERIES_POINTS))


def _bucket_means(event_s: np.ndarray, values: np.ndarray, horizon_s: float, interval: float) -> np.ndarray:
    """Time-weighted mean of the step function ``values`` (from ``event_s``) over each
    ``interval`` of ``[0, horizon_s]`` (the last one shorter)."""
    edges = np.append(np.arange(0.0, horizon_s, interval), horizon_s)
    if len(edges) < 2:
        return np.zeros(0)
    values = values.astype(np.float64)
    # the integral at each event time, then at each edge: that before it plus the value since
    cumulative = np.concatenate(([0.0], np.cumsum(values[:-1] * np.diff(event_s))))
    at = np.searchsorted(event_s, edges, side="right") - 1
    before = at < 0  # before the first event: nothing lent
    index = np.maximum(at, 0)
    integral = np.where(before, 0.0, cumulative[index] + values[index] * (edges - event_s[index]))
    return np.diff(integral) / np.diff(edges)


def _last_per_time(run: MemoryRun) -> tuple[np.ndarray, np.ndarray]:
    """The events with several at one instant reduced to the last (the state after them)."""
    t, v = run.event_s, run.lent_chunks
    if len(t) == 0:
        return np.zeros(1), np.zeros(1, dtype=np.int64)
    keep = np.append(t[1:] != t[:-1], True)
    return t[keep], v[keep]


def summarise(run: MemoryRun, horizon_s: float, memory: MemorySettings, kv_bytes_per_token: int, decode_steps: int) -> MemorySummary:
    """The metrics and series of ``run`` over ``[0, horizon_s]``."""
    chunk_bytes = run.tokens_per_chunk * kv_bytes_per_token
    t, lent = _last_per_time(run)
    stages = np.minimum(memory.max_stages, (lent * chunk_bytes) // memory.stage_bytes)
    interval = series_interval(horizon_s)
    within = t <= horizon_s
    seen_lent, seen_stages = lent[within], stages[within]
    horizon = max(horizon_s, 1e-12)
    mean_lent = float(_bucket_means(t, lent, horizon, horizon)[0]) if horizon_s > 0 else float(lent[0])
    mean_stages = float(_bucket_means(t, stages, horizon, horizon)[0]) if horizon_s > 0 else float(stages[0])
    delays_ms = run.urgent_delay_s * 1e3
    buckets = math.ceil(horizon_s / interval) if horizon_s > 0 else 0
    urgent_in_bucket = np.bincount(np.clip(run.urgent_s // interval, 0, max(0, buckets - 1)).astype(np.int64),
                                   minlength=buckets)[:buckets] if buckets else np.zeros(0, dtype=np.int64)
    metrics = {
        "kind": run.kind,
        "num_chunks": run.num_chunks,
        "tokens_per_chunk": run.tokens_per_chunk,
        "chunk_mib": chunk_bytes / MIB,
        "chunks_lent_mean": mean_lent,
        "chunks_lent_min": int(seen_lent.min()) if len(seen_lent) else 0,
        "chunks_lent_max": int(seen_lent.max()) if len(seen_lent) else 0,
        "lent_gib_mean": mean_lent * chunk_bytes / 2**30,
        "window_stages_mean": mean_stages,
        "window_stages_min": int(seen_stages.min()) if len(seen_stages) else 0,
        "window_stages_max": int(seen_stages.max()) if len(seen_stages) else 0,
        "chunks_lent_total": run.chunks_lent_total,
        "chunks_reclaimed_total": run.chunks_reclaimed_total,
        "urgent_reclaims": int(len(run.urgent_s)),
        "urgent_reclaim_chunks": int(run.urgent_chunks.sum()),
        "urgent_reclaims_per_1k_steps": 1e3 * len(run.urgent_s) / decode_steps if decode_steps else 0.0,
        "reclaim_delay_ms_p99": _p99(delays_ms),
        "reclaim_delay_ms_max": float(delays_ms.max()) if len(delays_ms) else 0.0,
        "reclaim_delay_s_total": float(run.urgent_delay_s.sum()),
        "lend_s_total": run.lend_s_total,
        "reclaim_s_total": run.reclaim_s_total,
        "scheduled_delay_s_total": run.scheduled_delay_s_total,
        "reserve_tokens_final": run.reserve_tokens_final,
        "reserve_tokens_max": run.reserve_tokens_max,
        "reserve_reason": run.reserve_reason,
    }
    series = {
        "interval_s": interval,
        "chunks_lent_mean": [round(float(v), 2) for v in _bucket_means(t, lent, horizon_s, interval)],
        "window_stages_mean": [round(float(v), 2) for v in _bucket_means(t, stages, horizon_s, interval)],
        "urgent_reclaims": [int(v) for v in urgent_in_bucket],
    }
    return MemorySummary(metrics, series, delays_ms)


def _p99(values: np.ndarray) -> float:
    """The nearest-rank 99th percentile (0.0 with no value: no urgent reclaim, no delay)."""
    if not len(values):
        return 0.0
    ordered = np.sort(values)
    return float(ordered[min(len(ordered) - 1, max(0, math.ceil(0.99 * len(ordered)) - 1))])


def fleet_summary(summaries: list[MemorySummary]) -> dict[str, Any]:
    """A fleet's memory for one policy from its servers' (same horizon, same series
    interval): totals summed, the window per server, delays over every server's urgent
    reclaims."""
    metrics = [s.metrics for s in summaries]
    delays = np.concatenate([s.urgent_delays_ms for s in summaries]) if summaries else np.zeros(0)
    series = [s.series for s in summaries]

    def total(key: str):
        return sum(m[key] for m in metrics)

    return {
        "kind": metrics[0]["kind"],
        "tokens_per_chunk": metrics[0]["tokens_per_chunk"],
        "chunk_mib": metrics[0]["chunk_mib"],
        "chunks_lent_mean": total("chunks_lent_mean"),
        "lent_gib_mean": total("lent_gib_mean"),
        "window_stages_mean_per_server": total("window_stages_mean") / len(metrics),
        "window_stages_min": min(m["window_stages_min"] for m in metrics),
        "chunks_lent_total": total("chunks_lent_total"),
        "chunks_reclaimed_total": total("chunks_reclaimed_total"),
        "urgent_reclaims": total("urgent_reclaims"),
        "urgent_reclaim_chunks": total("urgent_reclaim_chunks"),
        "urgent_reclaims_per_server": [m["urgent_reclaims"] for m in metrics],
        "reclaim_delay_ms_p99": _p99(delays),
        "reclaim_delay_ms_max": float(delays.max()) if len(delays) else 0.0,
        "reclaim_delay_s_total": total("reclaim_delay_s_total"),
        "lend_s_total": total("lend_s_total"),
        "reclaim_s_total": total("reclaim_s_total"),
        "scheduled_delay_s_total": total("scheduled_delay_s_total"),
        "series": {
            "interval_s": series[0]["interval_s"],
            "chunks_lent_mean": [round(sum(v), 2) for v in zip(*(s["chunks_lent_mean"] for s in series))],
            "window_stages_mean_per_server": [round(sum(v) / len(series), 2) for v in zip(*(s["window_stages_mean"] for s in series))],
            "urgent_reclaims": [sum(v) for v in zip(*(s["urgent_reclaims"] for s in series))],
        },
    }
