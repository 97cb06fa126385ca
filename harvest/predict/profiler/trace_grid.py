"""`harvest profile --grid-from-trace TRACE`: a grid chosen from the decode steps a trace
produces on one decode instance.

The steps come from the replay's own model of a decode instance (harvest.replay), timed by
a profile already there (``--grid-profile``), so a profile made on this grid covers what
`harvest replay` of the same trace asks of it. The grid is a product of batch sizes (the
steps' quantiles, rounded to CUDA-graph capture sizes) and context lengths (chosen so the
box in (batch size, Σctx) spans the steps' and no further): twelve points at most, as the
default grid. Everything here but :func:`trace_steps` is pure (numpy only).

Rules: profiles/README.md, 'The grid'.
"""

from __future__ import annotations

import dataclasses
import math
from pathlib import Path
from typing import Sequence

import numpy as np

BATCH_QUANTILES = (0.0, 1 / 3, 2 / 3, 1.0)
CONTEXT_STEP = 16  # context lengths are multiples of this (once past it)
DEFAULT_MAX_BATCH_SIZE = 256  # harvest replay's defaults for the decode instance
DEFAULT_KV_CAPACITY_TOKENS = 160_000


class TraceGridError(ValueError):
    """The trace (or the profile its steps are timed with) gives no grid; says why."""


@dataclasses.dataclass(frozen=True)
class TraceSteps:
    """The decode steps one instance runs for a trace, pooled over the policies replayed."""

    trace: str
    num_requests: int
    batch_sizes: np.ndarray  # one per step
    sum_contexts: np.ndarray  # Σctx per step, the token being decoded included
    policies: tuple[str, ...]  # whose steps these are
    profile_label: str  # the profile the steps' latencies came from
    max_batch_size: int
    kv_capacity_tokens: int

    @property
    def num_steps(self) -> int:
        return len(self.batch_sizes)


@dataclasses.dataclass(frozen=True)
class GridChoice:
    batch_sizes: tuple[int, ...]
    context_lengths: tuple[int, ...]
    batch_why: str
    context_why: str
    covered_fraction: float  # of the steps, inside the range the grid is expected to measure

    def lines(self, steps: TraceSteps) -> list[str]:
        """What was chosen and why: a header, then one line per axis."""
        return [
            f"grid from {steps.trace}: its {steps.num_requests} requests at their recorded rate through one decode instance "
            f"(max batch {steps.max_batch_size}, KV {steps.kv_capacity_tokens} tokens; step latencies from {steps.profile_label}): "
            f"{steps.num_steps} steps of {', '.join(steps.policies)}, {math.floor(1000 * self.covered_fraction) / 10:.1f} % of "
            "them inside the range this grid measures",
            f"  batch sizes {_join(self.batch_sizes)}: {self.batch_why}",
            f"  context lengths {_join(self.context_lengths)} (tokens per request): {self.context_why}",
        ]


def _join(values: Sequence[int]) -> str:
    return ",".join(str(v) for v in values)


def trace_steps(trace_path: str | Path, profile_spec: str | None, max_batch_size: int, kv_capacity_tokens: int) -> TraceSteps:
    """The steps ``trace_path`` produces on one decode instance (harvest.replay's model),
    timed with the profile ``profile_spec`` names (None: `harvest replay`'s default, else
    the synthetic A100 one). TraceGridError naming the file or flag for anything wrong."""
    from harvest.replay import comparison, kv_memory, profile_source, synthetic, trainer_model
    from harvest.replay.command import SYNTHETIC_A100, resolve_profile
    from harvest.replay.simulator import DecodeLimits
    from harvest.replay.trace import TraceError, read_trace

    try:
        requests = read_trace(trace_path)
    except TraceError as exc:
        raise TraceGridError(f"--grid-from-trace: {exc}") from None
    try:
        profile = resolve_profile(profile_spec)
    except FileNotFoundError:  # no profile in profiles/ yet: the labelled stand-in
        profile = profile_source.from_profile(synthetic.harli_a100_llama3_8b(), SYNTHETIC_A100)
    except ValueError as exc:  # ProfileError, naming the file and the JSON path
        raise TraceGridError(f"--grid-profile: {exc}") from None
    try:
        limits = DecodeLimits(max_batch_size, kv_capacity_tokens)
        memory, _ = kv_memory.resolve(profile)  # as `harvest replay` models it by default (urgent reclaims delay steps)
        settings = comparison.ReplaySettings(limits=limits, tp_size=profile.tp_size, memory=memory)
        simulated = comparison.simulate_policies(requests, profile, trainer_model.build(profile), settings)
    except ValueError as exc:
        raise TraceGridError(f"--grid-profile {profile.label}: {exc}") from None
    runs = []
    for run in simulated.runs.values():
        if not any(run is other for other in runs):  # separate decodes as decode-only: one run, counted once
            runs.append(run)
    names = list(simulated.runs)
    batch = np.concatenate([r.step_batch_size for r in runs]) if runs else np.zeros(0, dtype=np.int64)
    sums = np.concatenate([r.step_sum_context for r in runs]) if runs else np.zeros(0, dtype=np.int64)
    if len(batch) == 0:
        raise TraceGridError(
            f"--grid-from-trace {trace_path}: no decode step on one instance (every request prefill-only or larger than "
            f"--kv-capacity-tokens {kv_capacity_tokens}); give --batch-sizes and --context-lengths"
        )
    return TraceSteps(str(trace_path), len(requests), batch, sums, tuple(names), profile.label, max_batch_size, kv_capacity_tokens)


def capture_size(batch_size: float, how: str) -> int:
    """``batch_size`` rounded to a CUDA-graph capture size (1, 2, 4, 8, then multiples of
    8): ``how`` is "down", "up" or "nearest" (ties up)."""
    if batch_size <= 8:
        sizes = (1, 2, 4, 8)
        if how == "down":
            return max([s for s in sizes if s <= batch_size], default=1)
        if how == "up":
            return min(s for s in sizes if s >= batch_size)
        return min(sizes, key=lambda s: (abs(s - batch_size), -s))
    rounding = {"down": math.floor, "up": math.ceil, "nearest": lambda x: math.floor(x + 0.5)}[how]
    return 8 * rounding(batch_size / 8)


def context_multiple(tokens: float, how: str) -> int:
    """``tokens`` rounded to a multiple of CONTEXT_STEP (below it, to a whole token, >= 1)."""
    rounding = {"down": math.floor, "up": math.ceil, "nearest": lambda x: math.floor(x + 0.5)}[how]
    if tokens < CONTEXT_STEP:
        return max(1, rounding(tokens))
    return max(CONTEXT_STEP, CONTEXT_STEP * rounding(tokens / CONTEXT_STEP))


def _quantile(values: np.ndarray, q: float) -> int:
    return int(np.quantile(values, q, method="nearest"))


def choose_batch_sizes(steps: TraceSteps) -> tuple[tuple[int, ...], str]:
    """The batch-size axis from the steps' batch sizes (module doc), and why."""
    b = steps.batch_sizes
    raw = [_quantile(b, q) for q in BATCH_QUANTILES]
    chosen = [capture_size(raw[0], "down")]
    chosen += [capture_size(v, "nearest") for v in raw[1:-1]]
    chosen.append(min(capture_size(raw[-1], "up"), steps.max_batch_size))
    sizes = sorted(set(min(max(v, chosen[0]), chosen[-1]) for v in chosen))
    note = ""
    if len(sizes) < 2:  # every step the same size: a second point, or stage 1 cannot separate b0 from c0
        larger = capture_size(sizes[0] + 1, "up")
        if larger > steps.max_batch_size:
            raise TraceGridError(
                f"--grid-from-trace {steps.trace}: every step has batch size {sizes[0]} and --max-batch-size "
                f"{steps.max_batch_size} allows no larger one; give --batch-sizes (at least 2)"
            )
        sizes.append(larger)
        note = f"; {larger} added: stage 1 needs two batch sizes"
    why = (f"the steps' batch sizes at quantiles 0, 1/3, 2/3, 1 are {_join(raw)}, rounded to CUDA-graph capture sizes "
           f"(1, 2, 4, 8, then multiples of 8; the smallest down, the largest up to at most --max-batch-size "
           f"{steps.max_batch_size}){note}")
    return tuple(sizes), why


def choose_context_lengths(steps: TraceSteps, batch_sizes: Sequence[int], steps_per_point: int,
                           kv_capacity_tokens: int | None) -> tuple[tuple[int, ...], str]:
    """The context-length axis for ``batch_sizes`` (module doc), and why. A grid point
    decodes ``steps_per_point`` steps past its context; the smallest context leaves room
    for them under the smallest step's Σctx."""
    b_min, b_max = min(batch_sizes), max(batch_sizes)
    s_min, s_max = int(steps.sum_contexts.min()), int(steps.sum_contexts.max())
    room = s_min / b_min - steps_per_point
    low = context_multiple(room, "down") if room >= 1 else 1
    low_why = (f"{low} keeps the smallest step's Σctx ({s_min} tokens) inside the range at batch size {b_min} with the "
               f"{steps_per_point} steps a point decodes" if room >= 1 else
               f"{low} is the least (the smallest step's Σctx, {s_min} tokens at batch size {b_min}, is under a point's "
               f"{steps_per_point} decode steps: such steps stay outside)")
    high = context_multiple(s_max / b_max, "up")
    capped = ""
    if kv_capacity_tokens is not None and b_max * high > kv_capacity_tokens:
        high = max(1, kv_capacity_tokens // b_max)  # rounding up went past what the instance holds
        capped = f" ({high}: no more at batch size {b_max} under --kv-capacity-tokens {kv_capacity_tokens})"
    if high <= low:
        raise TraceGridError(
            f"--grid-from-trace {steps.trace}: the steps' Σctx ({s_min} .. {s_max} tokens) gives no range of context lengths "
            f"at batch sizes {b_min} .. {b_max}; give --context-lengths"
        )
    per_request = steps.sum_contexts / steps.batch_sizes
    median = float(np.quantile(per_request, 0.5, method="nearest"))
    middle = context_multiple(median, "nearest")
    middle_why = f"{middle} is the steps' median tokens per request ({median:.0f})"
    if not low < middle < high:
        middle = context_multiple(math.sqrt(low * high), "nearest")
        middle_why = (f"{middle} lies between them (geometric mean; the steps' median tokens per request, {median:.0f}, "
                      "is not)")
    lengths = sorted({low, middle, high})
    why = (f"{low_why}; {high} takes batch size {b_max} to the largest step's Σctx ({s_max} "
           f"tokens); " + (middle_why if middle in lengths[1:-1] else "no point between them")
           + f"; multiples of {CONTEXT_STEP}{capped}")
    return tuple(lengths), why


def covered_fraction(steps: TraceSteps, batch_sizes: Sequence[int], context_lengths: Sequence[int], steps_per_point: int) -> float:
    """The fraction of ``steps`` inside the range a grid measures, taken narrow: its Σctx
    from the smallest point's with all its decode steps to the largest point's first step
    (its context and the token being decoded)."""
    b_min, b_max = min(batch_sizes), max(batch_sizes)
    s_low = b_min * (min(context_lengths) + steps_per_point)
    s_high = b_max * (max(context_lengths) + 1)
    b, s = steps.batch_sizes, steps.sum_contexts
    inside = (b >= b_min) & (b <= b_max) & (s >= s_low) & (s <= s_high)
    return float(inside.mean()) if len(b) else 1.0


def choose_grid(
    steps: TraceSteps,
    steps_per_point: int,
    batch_sizes: Sequence[int] | None = None,
    context_lengths: Sequence[int] | None = None,
    kv_capacity_tokens: int | None = None,
) -> GridChoice:
    """The grid for ``steps``; an axis given (``--batch-sizes``, ``--context-lengths``) is
    kept as given and the other chosen around it."""
    if batch_sizes is None:
        batch_sizes, batch_why = choose_batch_sizes(steps)
    else:
        batch_why = "as --batch-sizes gave them"
    if context_lengths is None:
        context_lengths, context_why = choose_context_lengths(steps, batch_sizes, steps_per_point, kv_capacity_tokens)
    else:
        context_why = "as --context-lengths gave them"
    covered = covered_fraction(steps, batch_sizes, context_lengths, steps_per_point)
    return GridChoice(tuple(batch_sizes), tuple(context_lengths), batch_why, context_why, covered)
