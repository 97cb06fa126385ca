"""The discrete-event simulation of one decode instance under a request trace.

One event per decode step; time jumps over idle gaps. Requests arrive prefilled (PD
disaggregation), wait in a FIFO queue, and join the batch at a step boundary while the
batch size and KV capacity allow (a request reserves its final size, so none is ever
preempted); a step decodes one token per request at the policy's latency; finetune work
accrues at the policy's trainer share per step and its idle share over idle gaps. An
optional KV memory model (:class:`harvest.replay.kv_memory.LendingModel`) runs around
every step and idle gap.

Rules: docs/design.md, 'The replay's decode instance (harvest/replay/simulator.py)'.
"""

from __future__ import annotations

import collections
import dataclasses
import heapq
import math
from array import array
from typing import TYPE_CHECKING, Callable, Sequence

import numpy as np

from harvest.replay.policies import MAX_STEP_S, BasePolicy, step_too_long  # noqa: F401  (MAX_STEP_S: its users import it here)
from harvest.replay.trace import TraceRequest

if TYPE_CHECKING:
    from harvest.replay.kv_memory import LendingModel, MemoryRun

PROGRESS_EVERY_STEPS = 4096


@dataclasses.dataclass(frozen=True)
class DecodeLimits:
    max_batch_size: int
    kv_capacity_tokens: int

    def __post_init__(self) -> None:
        for name, flag in (("max_batch_size", "--max-batch-size"), ("kv_capacity_tokens", "--kv-capacity-tokens")):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{flag}={value!r}: must be an integer >= 1")


@dataclasses.dataclass(frozen=True)
class DecodeRun:
    """Everything one simulation produced. Per-step arrays share one index; per-request
    arrays are indexed like the input requests (NaN: never admitted / finished)."""

    step_start_s: np.ndarray
    step_latency_s: np.ndarray
    step_batch_size: np.ndarray
    step_sum_context: np.ndarray  # tokens held in KV during the step
    step_reserved_tokens: np.ndarray
    step_level: np.ndarray  # ladder level index (the whole-device level when harvest paused the trainer)
    step_trainer_share: np.ndarray
    arrival_s: np.ndarray
    admitted_s: np.ndarray
    finished_s: np.ndarray
    decode_steps: np.ndarray  # steps each request needs (generated − 1)
    kv_capacity_tokens: int
    end_s: float  # when the last step ended (or the last arrival, if later)
    idle_s: float  # time with an empty batch before end_s
    num_dropped: int
    num_prefill_only: int
    memory: "MemoryRun | None" = None  # the KV pool's lending, when modelled

    @property
    def num_steps(self) -> int:
        return len(self.step_latency_s)


def simulate(
    requests: Sequence[TraceRequest],
    policy: BasePolicy,
    limits: DecodeLimits,
    progress: Callable[[int], None] | None = None,
    memory: "LendingModel | None" = None,
) -> DecodeRun:
    """Replay ``requests`` (sorted by arrival) through ``policy``; ``progress(n)`` is
    called now and then with the number of requests arrived so far; ``memory``: the KV
    pool's lending model (module doc), None for none."""
    capacity = max(1, int(limits.kv_capacity_tokens * policy.kv_fraction))
    max_batch = limits.max_batch_size
    num = len(requests)
    arrival = [r.arrival_s for r in requests]
    context = [r.context_tokens for r in requests]
    steps_needed = [max(0, r.generated_tokens - 1) for r in requests]
    footprint = [r.context_tokens + r.generated_tokens for r in requests]
    admitted = [math.nan] * num
    finished = [math.nan] * num
    admit_step = [0] * num

    # array, not list: 8 bytes per value instead of a 32-byte float object and pointer
    # (a million steps per policy for a fast model over the hour-long trace).
    starts, latencies, shares = array("d"), array("d"), array("d")
    sizes, sums, reserved_log, levels = array("q"), array("q"), array("q"), array("q")
    log_start, log_latency, log_share = starts.append, latencies.append, shares.append
    log_size, log_sum, log_reserved, log_level = sizes.append, sums.append, reserved_log.append, levels.append
    queue: collections.deque[int] = collections.deque()
    heap: list[tuple[int, int]] = []
    step_fn = policy.step
    t = idle = 0.0
    k = n = sum_context0 = sum_admit = reserved = 0
    nxt = dropped = prefill_only = 0
    before_step = after_step = arrived = None
    if memory is not None:
        before_step, after_step, arrived = memory.before_step, memory.after_step, memory.arrived
        memory.start(t)

    while True:
        while nxt < num and arrival[nxt] <= t:
            i = nxt
            nxt += 1
            if footprint[i] > capacity:
                dropped += 1
            elif steps_needed[i] == 0:
                prefill_only += 1
                admitted[i] = finished[i] = arrival[i]
            else:
                queue.append(i)
                if arrived is not None:
                    arrived(arrival[i], footprint[i])  # admission prices its prompt and its decode
        while queue and n < max_batch and reserved + footprint[queue[0]] <= capacity:
            i = queue.popleft()
            n += 1
            sum_context0 += context[i]
            sum_admit += k
            reserved += footprint[i]
            admitted[i] = t
            admit_step[i] = k
            heapq.heappush(heap, (k + steps_needed[i] - 1, i))
        if n == 0:
            if nxt >= num:
                break
            if memory is not None:
                memory.idle(t, arrival[nxt])
            idle += arrival[nxt] - t
            t = arrival[nxt]
            continue

        sum_context = sum_context0 - sum_admit + n * (k + 1)
        latency, level, share = step_fn(n, sum_context)
        if before_step is not None:
            latency += before_step(t, sum_context)  # an urgent reclaim, and lending work since the last step: decode waits
        log_start(t)
        log_latency(latency)
        log_size(n)
        log_sum(sum_context)
        log_reserved(reserved)
        log_level(level)
        log_share(share)
        t += latency
        while heap and heap[0][0] == k:
            i = heapq.heappop(heap)[1]
            finished[i] = t
            n -= 1
            sum_context0 -= context[i]
            sum_admit -= admit_step[i]
            reserved -= footprint[i]
        if after_step is not None:
            held = sum_context0 - sum_admit + n * (k + 1)  # the tokens the requests left hold
            after_step(t, held, reserved - held)  # and what admission set aside for their decode
        k += 1
        if progress is not None and k % PROGRESS_EVERY_STEPS == 0:
            progress(nxt)
    if progress is not None:
        progress(nxt)
    memory_run = None if memory is None else memory.finish(t)
    longest = max(latencies, default=0.0)
    if not longest <= MAX_STEP_S:
        raise step_too_long(longest)

    return DecodeRun(
        step_start_s=np.frombuffer(starts, dtype=np.float64),
        step_latency_s=np.frombuffer(latencies, dtype=np.float64),
        step_batch_size=np.frombuffer(sizes, dtype=np.int64),
        step_sum_context=np.frombuffer(sums, dtype=np.int64),
        step_reserved_tokens=np.frombuffer(reserved_log, dtype=np.int64),
        step_level=np.frombuffer(levels, dtype=np.int64),
        step_trainer_share=np.frombuffer(shares, dtype=np.float64),
        arrival_s=np.asarray(arrival, dtype=float),
        admitted_s=np.asarray(admitted, dtype=float),
        finished_s=np.asarray(finished, dtype=float),
        decode_steps=np.asarray(steps_needed, dtype=np.int64),
        kv_capacity_tokens=capacity,
        end_s=t,
        idle_s=idle,
        num_dropped=dropped,
        num_prefill_only=prefill_only,
        memory=memory_run,
    )
