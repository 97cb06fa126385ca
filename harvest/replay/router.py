"""The fleet's request router: which of N decode servers serves each request of a trace.

Pure policy over the requests' arrivals and sizes (numpy only), decided once per router
before any server is simulated:

- ``round-robin``: request i (in arrival order) goes to server ``i mod N``.
- ``least-loaded``: each request goes to the server with the least outstanding decode
  load at its arrival; ties (idle servers, all at zero) go to the lowest server index.

Decode load is the router's own estimate of what a server's running requests add to its
next decode step, from the profile's decode-alone stage 1 (``b0`` seconds per request,
``k0`` per token of context held; its constant ``c0`` is every server's alike):
``Σ (b0 + k0·held_i)`` over the requests it estimates still decoding. A request needing
``d`` decode steps runs from its arrival ``a`` for ``d`` steps of an estimated latency
``ℓ`` (:func:`estimated_step_s`), holding ``c + (t − a)/ℓ`` tokens at ``t`` as a decode
batch grows every request by one token a step. Over the requests not yet estimated done
(``a_i + d_i·ℓ > t``) a server's load is ``n·(b0 + k0·t/ℓ) + k0·Σ(c_i − a_i/ℓ)``: two
sums per server, updated when a request is assigned and when its estimated end passes
(one heap over every request's end).

Why that load and not the decode tokens left (Σ remaining tokens, the other reading of
"outstanding work"): a step's latency, the TPOT, grows with the context the batch holds
(``k0``), and a server that took a long request and a few short ones holds far less than
one that took many long-context ones with little left to say. (On the Azure trace, 8
servers at ``--rate-scale 2 --rate-scale-sizes resample``, static's worst server TPOT p99
is 36.8 ms with round-robin and 33.6 ms with this load; a router on the tokens left,
tried while writing this one, did worse than round-robin.)

Why an estimate and not the simulated servers' state at each arrival:

- it is what a router has: it sees requests arrive and leave, not decode steps;
- one assignment per router serves every replay policy, so the policies are compared on
  the same requests per server, as the single-server replay compares them on the same
  trace; routing on the live state would let harvest's slower co-located steps move
  requests elsewhere, mixing a routing difference into the policy comparison;
- the live state of N simulations at every arrival costs N Python calls per request.

Cost: a heap push and pop per request and one vectorised argmin over the N servers'
sums, O(requests · (log requests + N)) with the N term in numpy: about 5 µs a request at
N = 64 (1.24 M requests, the full trace at ``--rate-scale 64``, in 6 s).

Limitations: the estimate ignores queueing (a server past its batch or KV limit holds
more than it says) and the batch-size dependence of a step's latency (one ``ℓ`` for the
fleet, that of the mean batch an even split gives each server), and batch-size padding.
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
