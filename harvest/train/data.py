"""Which samples each optimizer step takes, and how a step is cut into micro-batches.

Epoch ``e`` visits the dataset in the order ``torch.randperm(n)`` drawn from a generator
seeded with ``seed + e``; step ``t`` of an epoch takes the next ``samples_per_step``
samples (the epoch's last step takes what is left). The data position is thus a pure
function of the global step: a checkpoint records the step, and a resumed run feeds
exactly the samples an uninterrupted run would have.
"""

from __future__ import annotations

import math
from typing import Any, Callable, Sequence

import torch

from harvest.train.split_model import MicroBatch

IGNORE_INDEX = -100  # label value that carries no loss (LlamaFactory's and Hugging Face's)


class StepBatches:
    def __init__(self, dataset: Sequence[dict[str, Any]], collate: Callable[[list], dict[str, torch.Tensor]],
                 samples_per_step: int, seed: int, shuffle: bool = True):
        if len(dataset) == 0:
            raise ValueError("dataset: no training samples after preprocessing (check cutoff_len and the data file)")
        if samples_per_step < 1:
            raise ValueError(f"samples_per_step must be >= 1, got {samples_per_step}")
        self.dataset = dataset
        self.collate = collate
        self.samples_per_step = samples_per_step
        self.seed = seed
        self.shuffle = shuffle
        self.num_samples = len(dataset)
        self.steps_per_epoch = math.ceil(self.num_samples / samples_per_step)
        self._cached_order: tuple[int, list[int]] = (-1, [])

    def position(self, step: int) -> tuple[int, int]:
        """(epoch, offset of the step's first sample within that epoch's order)."""
        return step // self.steps_per_epoch, (step % self.steps_per_epoch) * self.samples_per_step

    def step_indices(self, step: int) -> list[int]:
        epoch, offset = self.position(step)
        order = self._epoch_order(epoch)
        return order[offset: offset + self.samples_per_step]

    def micro_batches(self, step: int, micro_batch_size: int, device: torch.device,
                      shard: tuple[int, int] | None = None) -> list[MicroBatch]:
        """``shard`` (rank, size): every ``size``-th of the step's samples from ``rank`` on
        (a fleet's every_step members split each step so)."""
        indices = self.step_indices(step)
        if shard is not None:
            indices = indices[shard[0]::shard[1]]
        result = []
        for number, start in enumerate(range(0, len(indices), micro_batch_size)):
            features = [self.dataset[i] for i in indices[start: start + micro_batch_size]]
            batch = self.collate(features)
            attention_mask, labels = batch["attention_mask"], batch["labels"]
            result.append(MicroBatch(
                index=number,
                input_ids=_to_device(batch["input_ids"], device),
                attention_mask=_to_device(attention_mask, device),
                labels=_to_device(labels, device),
                num_tokens=int(attention_mask.sum()),
                # After the causal shift (Hugging Face's num_items_in_batch counts these).
                num_label_tokens=int((labels[:, 1:] != IGNORE_INDEX).sum()),
            ))
        return result

    def _epoch_order(self, epoch: int) -> list[int]:
        if self._cached_order[0] != epoch:
            if self.shuffle:
                generator = torch.Generator().manual_seed(self.seed + epoch)
                order = torch.randperm(self.num_samples, generator=generator).tolist()
            else:
                order = list(range(self.num_samples))
            self._cached_order = (epoch, order)
        return self._cached_order[1]



def _to_device(tensor: torch.Tensor, device: torch.device) -> torch.Tensor:
    """An asynchronous host-to-device copy: from page-locked memory, since a copy from
    pageable memory makes the host wait for it."""
    if device.type == "cuda":
        tensor = tensor.pin_memory()
    return tensor.to(device, non_blocking=True)
