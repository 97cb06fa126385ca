"""Choosing the micro-batch size so one unit takes about the target time.

A quick measurement before training: a synthetic micro-batch of the longest sample
length runs the embedding, one decoder layer and the head forward and backward through
the real trainer path (window included), on the stream of the partition the target is
for; the longest of those unit times at micro-batch 1 gives a first size by linear
extrapolation, and a line through both measurements (a fixed cost per unit plus a cost
per sequence) the final one, measured once more. Gradients and RNG state
are restored afterwards, so the measurement leaves no trace in training. The head
(vocabulary projection) is usually the longest unit, so it bounds the choice.

The target (`UnitSizing`): a unit's host cost does not grow with its tokens, so a unit
should carry as many as its time allows; in a decode server that time is a fraction of
the decode step on the smallest partition the trainer runs on (a level change waits for
the unit in flight), alone a fixed default (docs/design.md §2, 'Units sized by the decode
step').
"""

from __future__ import annotations

import dataclasses
import math
import statistics
import time
from typing import Any, Callable

import torch

from harvest.compute.device import on_stream
from harvest.train import checkpoint
from harvest.train.split_model import MicroBatch


@dataclasses.dataclass(frozen=True)
class UnitSizing:
    """What ``micro_batch_size: auto`` sizes a unit for: ``target_ms`` of device time on the
    partition whose trainer ``stream`` it is timed on (None: the thread's current stream,
    every SM; always None on a CPU), and why that target, for the log and the status."""

    target_ms: float
    stream: Any = None
    reason: str = ""

    def status(self, micro_batch_size: int, unit_ms: float | None) -> dict[str, Any]:
        return {"target_ms": round(self.target_ms, 3), "measured_ms": None if unit_ms is None else round(unit_ms, 3),
                "micro_batch_size": micro_batch_size, "reason": self.reason}


def decode_step_sizing(unit_step_fraction: float, target_tpot_ms: float, ladder) -> UnitSizing:
    """A decode server's sizing: ``unit_step_fraction`` of the decode step's target, timed
    on the trainer stream of the level that gives the trainer the fewest SMs (a unit sized
    there fits that share of the step on every level the trainer runs on). ``ladder``:
    the built ladder (harvest.ladder.Ladder, its levels carrying their streams)."""
    target_ms = unit_step_fraction * target_tpot_ms
    if not ladder.trainer_levels:  # a ladder without a trainer level never runs units; size for the device
        return UnitSizing(target_ms, None, f"{unit_step_fraction:g} of the {target_tpot_ms:g} ms decode step")
    index = min(ladder.trainer_levels, key=lambda i: ladder.levels[i].trainer_sms)
    level = ladder.levels[index]
    where = ("the whole device, shared with decode" if ladder.num_levels == 1 and level.decode_sms == level.trainer_sms
             else f"level {index}'s {level.trainer_sms} of {ladder.total_sms} SMs, the trainer's smallest partition")
    return UnitSizing(target_ms, level.trainer_stream,
                      f"{unit_step_fraction:g} of the {target_tpot_ms:g} ms decode step, on {where}")


def choose_micro_batch_size(trainer, target_ms: float, probe_batch: Callable[[int], MicroBatch], max_size: int,
                            agree_ms=None, stream=None) -> tuple[int, float]:
    """(micro-batch size in 1..max_size, its measured longest unit in ms). ``probe_batch(n)``:
    a micro-batch of ``n`` of the job's longest samples, as its collator makes it (the
    mask's form and the padded length set what attention costs). ``agree_ms``:
    tensor-parallel ranks' agreement on a measurement (their slowest), so every rank
    probes the same sizes and picks the same one (the probes run collectives).
    ``stream``: the trainer stream of the partition the target is for (None: current).

    At most three probes: micro-batch 1, the size a line through the origin and it
    predicts (at least 2), then the size a line through both measurements predicts. The
    second line has an intercept because a small unit's time is mostly fixed cost (the host
    issuing its kernels): on an H200 a unit of 512 tokens took about as long to issue as to
    run, and the first line alone stopped at units of 4-5 ms against a 10 ms target."""
    rng_state = checkpoint.capture_rng_state(trainer.device)
    agree = agree_ms or (lambda ms: ms)
    measured: dict[int, float] = {}

    def measure(size: int) -> None:
        measured[size] = agree(longest_unit_ms(trainer, probe_batch(size), stream=stream))

    try:
        measure(1)
        if measured[1] < target_ms and max_size > 1:
            measure(max(2, predicted_size(measured, target_ms, max_size)))  # at least 2: the second line needs a slope
            size = predicted_size(measured, target_ms, max_size)
            if size not in measured:
                measure(size)
        size = predicted_size(measured, target_ms, max_size)
        if size not in measured:  # probes spent: the largest measured size that held its target
            within = [n for n, ms in measured.items() if ms <= 1.2 * target_ms]
            size = max(within) if within else min(measured)
        return size, measured[size]
    finally:
        trainer.optimizer.zero_grad(set_to_none=True)
        checkpoint.restore_rng_state(rng_state, trainer.device)


def predicted_size(measured: dict[int, float], target_ms: float, max_size: int) -> int:
    """The micro-batch whose unit a line through the measurements puts at ``target_ms``,
    in 1..max_size. One measurement (size 1): a line through the origin. More: the line
    through the two largest sizes measured (fixed cost + cost per sequence); a unit whose
    cost did not grow with its size takes ``max_size``."""
    sizes = sorted(measured)
    if len(sizes) == 1:
        estimate = target_ms / measured[sizes[0]] * sizes[0]
    else:
        small, large = sizes[-2], sizes[-1]
        per_sequence = (measured[large] - measured[small]) / (large - small)
        if per_sequence <= 0:
            return max_size
        fixed = measured[large] - per_sequence * large
        estimate = (target_ms - fixed) / per_sequence
    return max(1, min(max_size, math.floor(estimate)))


def longest_unit_ms(trainer, probe: MicroBatch, repeats: int = 3, stream=None) -> float:
    """Median over `repeats` (after one warm-up) of the longest unit of micro-batch
    ``probe``, its units issued on ``stream`` (None: the current stream)."""
    split, window, device = trainer.split, trainer.window, trainer.device
    compute_stream = trainer._compute_stream(stream)
    layer_stage = 1 if split.num_layers > 0 else split.head_stage
    order = split.pass_stages()
    samples = []
    for _ in range(repeats + 1):
        mb = dataclasses.replace(probe, masks={}, inputs={}, outputs={}, pair_saved={})  # a fresh pass each time
        durations = []

        def timed(stage, action):
            window.prepare(stage, iter(order), compute_stream)
            _synchronize(device)
            started = time.perf_counter()
            with on_stream(compute_stream):
                action()
            _synchronize(device)
            durations.append((time.perf_counter() - started) * 1e3)

        def forward(stage):
            with window.saved_tensor_hooks(), trainer._autocast():
                split.forward(stage, mb, mb.num_label_tokens)

        with trainer._unit_lock:
            window.prepare(0, iter(order), compute_stream)
            with on_stream(compute_stream):
                forward(0)
            if layer_stage != split.head_stage:
                timed(layer_stage, lambda: forward(layer_stage))
            timed(split.head_stage, lambda: forward(split.head_stage))
            if split.first_trainable_stage <= split.head_stage:
                timed(split.head_stage, lambda: split.backward(split.head_stage, mb))
            if layer_stage != split.head_stage and layer_stage >= split.first_trainable_stage:
                timed(layer_stage, lambda: split.backward(layer_stage, mb))
        samples.append(max(durations))
    return statistics.median(samples[1:])


def _synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
