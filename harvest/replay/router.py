"""The fleet's request router: which of N decode servers serves each request of a trace.

Pure policy over the requests' arrivals and sizes (numpy only), decided once per router
before any server is simulated, so every replay policy sees the same requests per server:

- ``round-robin``: request i (in arrival order) goes to server ``i mod N``.
- ``least-loaded``: each request goes to the server with the least estimated decode load
  (``Σ (b0 + k0·held_i)`` over its requests estimated still decoding) at its arrival;
  ties go to the lowest server index.

Rules and limitations: docs/fleet.md, 'The router (harvest/replay/router.py)'.
"""

from __future__ import annotations

import dataclasses
import heapq
import math
from typing import Sequence

import numpy as np

from harvest.replay.profile_source import ReplayProfile
from harvest.replay.simulator import DecodeLimits
from harvest.replay.trace import TraceRequest

ROUND_ROBIN, LEAST_LOADED = "round-robin", "least-loaded"
ALL_ROUTERS = (ROUND_ROBIN, LEAST_LOADED)
BISECTION_STEPS = 60


@dataclasses.dataclass(frozen=True)
class DecodeLoadModel:
    """What the least-loaded router knows of a decode step: ``step_s`` (its estimated
    latency: a request needing d steps decodes for d·step_s), and the seconds a running
    request adds to a step, ``per_request_s`` plus ``per_token_s`` per token it holds."""

    step_s: float
    per_request_s: float
    per_token_s: float

    def __post_init__(self) -> None:
        if not (math.isfinite(self.step_s) and self.step_s > 0):
            raise ValueError(f"least-loaded router: estimated step latency {self.step_s!r} s must be a finite number > 0")
        for name in ("per_request_s", "per_token_s"):
            value = getattr(self, name)
            if not (math.isfinite(value) and value >= 0):
                raise ValueError(f"least-loaded router: {name}={value!r} must be a finite number >= 0")
        if self.per_request_s == 0 and self.per_token_s == 0:
            raise ValueError("least-loaded router: a load model with per_request_s = per_token_s = 0 sees every server idle")

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


def decode_steps(request: TraceRequest) -> int:
    """Decode steps ``request`` needs: prefill made its first token (simulator module doc)."""
    return max(0, request.generated_tokens - 1)


def round_robin(num_requests: int, num_servers: int) -> np.ndarray:
    """Server index per request: ``i mod num_servers``."""
    return np.arange(num_requests, dtype=np.int64) % num_servers


def least_loaded(requests: Sequence[TraceRequest], num_servers: int, model: DecodeLoadModel) -> np.ndarray:
    """Server index per request of ``requests`` (sorted by arrival): the least estimated
    decode load at its arrival (module doc)."""
    assignment = np.empty(len(requests), dtype=np.int64)
    num_running = np.zeros(num_servers)
    held_at_zero = np.zeros(num_servers)  # Σ (c_i − a_i/ℓ): held tokens are this + n·t/ℓ
    ends: list[tuple[float, int, float]] = []
    pop, push, argmin = heapq.heappop, heapq.heappush, np.argmin
    step_s, per_request_s, per_token_s = model.step_s, model.per_request_s, model.per_token_s
    for index, request in enumerate(requests):
        t = request.arrival_s
        while ends and ends[0][0] <= t:
            _, server, held = pop(ends)
            num_running[server] -= 1
            # an idle server's sum is exactly 0, not the rounding its adds and subtracts left
            held_at_zero[server] = held_at_zero[server] - held if num_running[server] else 0.0
        if num_servers > 1:
            server = int(argmin(num_running * (per_request_s + per_token_s * t / step_s) + per_token_s * held_at_zero))
        else:
            server = 0
        assignment[index] = server
        steps = decode_steps(request)
        if steps:
            held = request.context_tokens - t / step_s
            num_running[server] += 1
            held_at_zero[server] += held
            push(ends, (t + steps * step_s, server, held))
    return assignment


def assign(router: str, requests: Sequence[TraceRequest], num_servers: int, model: DecodeLoadModel) -> np.ndarray:
    """Server index per request under ``router`` (one of ALL_ROUTERS)."""
    if isinstance(num_servers, bool) or not isinstance(num_servers, int) or num_servers < 1:
        raise ValueError(f"--servers={num_servers!r}: must be an integer >= 1 (decode servers behind the router)")
    if router == ROUND_ROBIN:
        return round_robin(len(requests), num_servers)
    if router == LEAST_LOADED:
        return least_loaded(requests, num_servers, model)
    raise ValueError(f"--router {router!r}: one of {', '.join(ALL_ROUTERS)}")


def split(requests: Sequence[TraceRequest], assignment: np.ndarray, num_servers: int) -> list[list[TraceRequest]]:
    """Each server's requests, in arrival order (a sub-sequence of ``requests``)."""
    order = np.argsort(assignment, kind="stable")
    bounds = np.searchsorted(assignment[order], np.arange(num_servers + 1))
    return [[requests[i] for i in order[bounds[s] : bounds[s + 1]]] for s in range(num_servers)]


def load_model(requests: Sequence[TraceRequest], num_servers: int, profile: ReplayProfile, limits: DecodeLimits) -> DecodeLoadModel:
    """The least-loaded router's model for ``requests`` over ``num_servers`` servers: the
    profile's decode-alone (whole-device) stage-1 slopes and :func:`estimated_step_s`.
    A profile whose step does not grow with the batch at all (b0 = k0 = 0) gives no load
    to compare: the router then counts running requests."""
    solo = profile.solo[profile.ladder.whole_device_index]
    per_request_s = solo.b0 if solo.b0 > 0 or solo.k0 > 0 else 1.0
    return DecodeLoadModel(estimated_step_s(requests, num_servers, profile, limits), per_request_s, solo.k0)


def estimated_step_s(requests: Sequence[TraceRequest], num_servers: int, profile: ReplayProfile, limits: DecodeLimits) -> float:
    """The decode-alone step latency (whole-device level, stage 1) at the mean batch each
    server holds when it gets 1/``num_servers`` of ``requests``: Little's law, mean batch
    ``b`` = per-server arrival rate of decoding requests × their mean decode steps × the
    step latency at ``b`` (holding ``b`` times the mean tokens a decoding request holds),
    a fixed point found by bisection. Under 1 the step of a lone request; past the largest
    batch the limits admit (``max_batch_size``, or as many mean requests as the KV
    capacity reserves: the load outruns the server) that batch's step."""
    solo = profile.solo[profile.ladder.whole_device_index]
    padded = profile.buckets.padded
    decoding = [(r.context_tokens, decode_steps(r)) for r in requests if decode_steps(r) > 0]
    total_steps = sum(m for _, m in decoding)
    # a request of context c decoding m tokens holds c+1 .. c+m tokens over its m steps and
    # reserves its final c+m+1 (simulator module doc); means over a batch's requests, per step
    mean_held = sum(m * (c + (m + 1) / 2) for c, m in decoding) / total_steps if decoding else 0.0
    mean_reserved = sum(m * (c + m + 1) for c, m in decoding) / total_steps if decoding else 0.0

    def step_s(batch: float) -> float:
        return solo.predict(padded(max(1, round(batch))), batch * mean_held)

    if not decoding:
        return step_s(1.0)
    largest = float(max(1, min(limits.max_batch_size, int(limits.kv_capacity_tokens / mean_reserved))))
    span_s = requests[-1].arrival_s - requests[0].arrival_s
    if span_s <= 0:  # a burst: every request at once, the batch as large as it gets
        return step_s(min(largest, max(1.0, len(decoding) / num_servers)))
    step_work = total_steps / span_s / num_servers  # decode steps arriving per second, per server

    def excess(batch: float) -> float:
        return step_work * step_s(batch) - batch

    if excess(1.0) <= 0:
        return step_s(1.0)
    if excess(largest) >= 0:
        return step_s(largest)
    low, high = 1.0, largest
    for _ in range(BISECTION_STEPS):
        middle = (low + high) / 2
        low, high = (middle, high) if excess(middle) > 0 else (low, middle)
    return step_s(high)
