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
            batch = self.collate([self.dataset[i] for i in indices[start: start + micro_batch_size]])
            result.append(micro_batch_from(batch, number, device))
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



# What LlamaFactory's SFT collator hands the model, each fed to the split model as
# ``model(**batch)`` would take it. Anything else is refused, not dropped: a batch field the
# trainer left out would train something other than what ``llamafactory-cli train`` trains.
BATCH_FIELDS = frozenset({"input_ids", "attention_mask", "labels", "position_ids"})


def micro_batch_from(batch: dict[str, Any], index: int, device: torch.device) -> MicroBatch:
    """A collated batch as one micro-batch, on ``device``. The one conversion used by
    training, evaluation, the micro-batch sizing's probe and the build-time check of the
    collator.

    ``attention_mask`` is what the collator made of it: 2-D (1 per token; with
    ``packing`` the padding of a packed row is 1 too, as LlamaFactory makes it), 4-D
    (``neat_packing``: LlamaFactory's block-diagonal causal mask, 0 where a token may
    attend and the dtype's minimum elsewhere, passed to the decoder layers as it is) or
    absent (``neat_packing`` with flash attention: the packed rows are told apart by
    ``position_ids``). ``position_ids`` (packing: each packed sequence counts from 0) goes
    to the layers and the rotary embedding as Hugging Face's model forward passes it.
    """
    extra = sorted(set(batch) - BATCH_FIELDS)
    if extra:
        raise ValueError(f"the collated batch carries {', '.join(extra)}, which the layer-split trainer does not "
                         "feed to the model (it trains text-only decoders on input_ids, attention_mask, "
                         "position_ids and labels)")
    input_ids, attention_mask, labels = batch["input_ids"], batch.get("attention_mask"), batch["labels"]
    position_ids = batch.get("position_ids")
    return MicroBatch(
        index=index,
        input_ids=_to_device(input_ids, device),
        attention_mask=_to_device(attention_mask, device) if attention_mask is not None else None,
        labels=_to_device(labels, device),
        position_ids=_to_device(position_ids, device) if position_ids is not None else None,
        num_tokens=real_tokens(input_ids, attention_mask),
        # After the causal shift (Hugging Face's num_items_in_batch counts these).
        num_label_tokens=int((labels[:, 1:] != IGNORE_INDEX).sum()),
    )


def real_tokens(input_ids: torch.Tensor, attention_mask: torch.Tensor | None) -> int:
    """Tokens the mask lets attend (padding excluded), whatever form the mask has."""
    if attention_mask is None:
        return input_ids.numel()
    if attention_mask.dim() == 4:  # a token that may attend to itself is not padding
        return int((attention_mask.diagonal(dim1=-2, dim2=-1) == 0).sum())
    return int((attention_mask != 0).sum())  # neat packing numbers its sequences 1, 2, ...


def _to_device(tensor: torch.Tensor, device: torch.device) -> torch.Tensor:
    """An asynchronous host-to-device copy: from page-locked memory, since a copy from
    pageable memory makes the host wait for it."""
    if device.type == "cuda":
        tensor = tensor.pin_memory()
    return tensor.to(device, non_blocking=True)
