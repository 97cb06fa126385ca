"""Choosing the micro-batch size so one unit takes about the target time.

A quick measurement before training: a synthetic micro-batch of the longest sample
length runs the embedding, one decoder layer and the head forward and backward through
the real trainer path (window included); the longest of those unit times at micro-batch
1 gives a first size by linear extrapolation, which one more measurement at that size
corrects. Gradients and RNG state are restored afterwards, so the measurement leaves no
trace in training. The head (vocabulary projection) is usually the longest unit, so it
bounds the choice.
"""

from __future__ import annotations

import math
import statistics
import time

import torch

from harvest.train import checkpoint
from harvest.train.split_model import MicroBatch


def choose_micro_batch_size(trainer, target_ms: float, seq_len: int, max_size: int,
                            agree_ms=None) -> tuple[int, float]:
    """(micro-batch size in 1..max_size, its measured longest unit in ms). ``agree_ms``:
    tensor-parallel ranks' agreement on a measurement (their slowest), so every rank
    probes the same sizes and picks the same one (the probes run collectives)."""
    rng_state = checkpoint.capture_rng_state(trainer.device)
    agree = agree_ms or (lambda ms: ms)
    try:
        unit_ms = agree(longest_unit_ms(trainer, 1, seq_len))
        size = max(1, min(max_size, math.floor(target_ms / unit_ms)))
        if size > 1:
            unit_ms = agree(longest_unit_ms(trainer, size, seq_len))
            if unit_ms > 1.2 * target_ms:
                size = max(1, math.floor(size * target_ms / unit_ms))
                unit_ms = agree(longest_unit_ms(trainer, size, seq_len))
        return size, unit_ms
    finally:
        trainer.optimizer.zero_grad(set_to_none=True)
        checkpoint.restore_rng_state(rng_state, trainer.device)


def longest_unit_ms(trainer, micro_batch_size: int, seq_len: int, repeats: int = 3) -> float:
    """Median over `repeats` (after one warm-up) of the longest unit of a synthetic micro-batch."""
    split, window, device = trainer.split, trainer.window, trainer.device
    layer_stage = 1 if split.num_layers > 0 else split.head_stage
    order = split.pass_stages()
    samples = []
    for _ in range(repeats + 1):
        ids = torch.randint(0, split.config.vocab_size, (micro_batch_size, seq_len), device=device)
        mb = MicroBatch(0, ids, torch.ones_like(ids), ids.clone(), num_tokens=ids.numel(),
                        num_label_tokens=micro_batch_size * (seq_len - 1))
        durations = []

        def timed(stage, action):
            window.prepare(stage, iter(order), trainer._compute_stream(None))
            _synchronize(device)
            started = time.perf_counter()
            action()
            _synchronize(device)
            durations.append((time.perf_counter() - started) * 1e3)

        def forward(stage):
            with window.saved_tensor_hooks(), trainer._autocast():
                split.forward(stage, mb, mb.num_label_tokens)

        with trainer._unit_lock:
            window.prepare(0, iter(order), trainer._compute_stream(None))
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
