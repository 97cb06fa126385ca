"""Trace requests served through a decode batch in wall-clock time, and the TPOT/ITL
summary of what was served: the serving loop of the GPU co-location experiment.

Requests follow harvest.replay's model: a window of the trace, arrival times scaled by
``time_scale``; a request joins the batch at the first step boundary after its arrival
and leaves after ``generated - 1`` decode steps (its prefill ran elsewhere), its KV cache
random values (a step's cost does not depend on them). TPOT is a step's latency from the
mode's step timer, as the scheduler sees it; ITL the wall time between a request's tokens.
The stream is synchronised after each step, as a serving loop reading its tokens does.
"""

from __future__ import annotations

import collections
import dataclasses
import time

from harvest.engines.transformers.model import on_stream


@dataclasses.dataclass(frozen=True)
class Request:
    request_id: int
    arrival_s: float
    context_tokens: int
    decode_steps: int


def load_requests(trace, start_s, duration_s, time_scale, max_context, max_generated) -> list[Request]:
    """The trace window as decode work; requests with one output token never reach decode."""
    from harvest.replay.trace import SAMPLE_TRACE, read_trace
    from harvest.replay.workload import TraceWindow, prepare

    window = TraceWindow(start_s=start_s, duration_s=duration_s, time_scale=time_scale)
    chosen = prepare(read_trace(trace or SAMPLE_TRACE), window)
    return [Request(i, r.arrival_s, max(1, min(r.context_tokens, max_context)), min(r.generated_tokens, max_generated) - 1)
            for i, r in enumerate(chosen) if min(r.generated_tokens, max_generated) > 1]


def serve(requests, batch, policy, max_batch_size, steps=None, on_progress=None, progress_every_s=2.0,
          step=None) -> dict:
    """Replay ``requests`` in wall-clock time through ``batch`` under ``policy``; a decode
    step is ``step()`` (graphs on: a :class:`~.graph_step.GraphStep`), by default
    ``batch.step``. Every change to the batch runs on the decode stream in force and is
    synchronised, so the next step may run on another level's stream. Measured steps are appended to
    ``steps`` (the caller's list: what was measured survives an interrupt);
    ``on_progress(steps, wall_s)`` is called every ``progress_every_s`` seconds."""
    from harvest.colocate import StepLoad

    arrivals, queue = collections.deque(requests), collections.deque()
    left: dict[int, int] = {}
    steps = [] if steps is None else steps
    unmeasured: dict[int, tuple] = {}  # steps whose latency has not arrived yet, by measurement tag

    def record(measurement) -> None:
        # Paired by tag: a measurement the timer dropped leaves its step out, never shifts the others.
        entry = unmeasured.pop(measurement.tag, None)
        if entry is not None:
            step_start, itl_s, batch_size, real_sum, padded_sum, level_index, trainer_ran = entry
            steps.append((step_start, measurement.seconds, itl_s, batch_size, real_sum, padded_sum, level_index,
                          trainer_ran))

    start = time.perf_counter()
    next_progress = progress_every_s
    last_token = None  # when the batch last produced tokens (or stopped being empty)
    while arrivals or queue or batch.num_requests:
        now = time.perf_counter() - start
        if on_progress is not None and now >= next_progress:
            on_progress(steps, now)
            next_progress = now + progress_every_s
        while arrivals and arrivals[0].arrival_s <= now:
            queue.append(arrivals.popleft())
        joining = [queue.popleft() for _ in range(min(len(queue), max_batch_size - batch.num_requests))]
        if joining:
            if not batch.num_requests:
                last_token = now
            stream = policy.level.decode_stream  # the level in force (a new one is chosen per step)
            with on_stream(stream):
                batch.join([r.request_id for r in joining], [r.context_tokens for r in joining])
            if stream is not None:
                stream.synchronize()
            left.update((r.request_id, r.decode_steps) for r in joining)
        if not batch.num_requests:
            last_token = None
            policy.idle()
            time.sleep(min(0.005, max(0.0, arrivals[0].arrival_s - now)))
            continue
        # The load the scheduler sees is the work the step computes (a slot batch: its bucket).
        load = StepLoad(batch.computed_rows, batch.padded_sum_context(), True)
        real_sum, num_requests = batch.sum_context(), batch.num_requests
        step_start = time.perf_counter() - start
        policy.run_step(load, batch.step if step is None else step)
        level = policy.level
        if level.decode_stream is not None:
            level.decode_stream.synchronize()
        step_end = time.perf_counter() - start
        tag, level_index, trainer_ran = policy.last_step()
        unmeasured[tag] = (step_start, step_end - last_token, num_requests, real_sum, load.sum_context,
                           level_index, trainer_ran)
        for measured in policy.completed():
            record(measured)
        last_token = step_end
        done = []
        for rid in batch.request_ids:
            left[rid] -= 1
            if left[rid] == 0:
                done.append(rid)
        if done:
            with on_stream(level.decode_stream):
                batch.leave(done)
            if level.decode_stream is not None:
                level.decode_stream.synchronize()
    wall_s = time.perf_counter() - start
    for measured in policy.flush():  # a late timer's last step
        record(measured)
    return {"wall_s": wall_s, "steps": steps, "unmeasured_steps": len(unmeasured)}


def summarize(served: dict, target_ms: float, num_requests: int, targets: dict | None = None) -> dict:
    """TPOT = a decode step's latency (CUDA events on the decode stream), as Harli and the
    scheduler measure it. ITL = the inter-token latency the batch's requests see: wall time
    from the previous step's end (or the batch's first join) to this step's end, so it adds
    the control decision, joins and leaves between steps. ``targets`` (name -> ms): the
    violation rate at each of them too (``violation_rate_at``)."""
    import numpy as np

    steps = served["steps"]
    if not steps:
        return {"steps": 0, "requests": num_requests, "wall_s": round(served["wall_s"], 2)}
    tpot_ms, itl_ms = np.array([s[1] for s in steps]) * 1e3, np.array([s[2] for s in steps]) * 1e3
    sizes = [s[3] for s in steps]

    def ms(values, q):
        return round(float(np.percentile(values, q)), 3)

    result = {
        "tpot_ms_p50": ms(tpot_ms, 50), "tpot_ms_p99": ms(tpot_ms, 99), "tpot_ms_max": round(float(tpot_ms.max()), 3),
        "violation_rate": round(float(np.mean(tpot_ms > target_ms)), 5),
        "itl_ms_p50": ms(itl_ms, 50), "itl_ms_p99": ms(itl_ms, 99),
        "itl_violation_rate": round(float(np.mean(itl_ms > target_ms)), 5),
        "steps": len(steps), "requests": num_requests, "decode_tokens": sum(sizes),
        "decode_tokens_per_s": round(sum(sizes) / served["wall_s"], 1),
        "batch_size_mean": round(float(np.mean(sizes)), 2),
        "padded_over_real_context": round(sum(s[5] for s in steps) / max(1, sum(s[4] for s in steps)), 3),
        "trainer_step_fraction": round(float(np.mean([s[7] for s in steps])), 4),
        "steps_by_level": {str(k): v for k, v in sorted(collections.Counter(s[6] for s in steps).items())},
        "wall_s": round(served["wall_s"], 2),
        "unmeasured_steps": served.get("unmeasured_steps"),  # None: cut short before the count
    }
    if targets:
        result["violation_rate_at"] = {name: {"target_ms": round(value, 3),
                                              "violation_rate": round(float(np.mean(tpot_ms > value)), 5)}
                                       for name, value in targets.items()}
    return result
