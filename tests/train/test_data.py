"""Data position: a pure function of the global step (what makes resume exact)."""

from __future__ import annotations

import torch

from harvest.train.data import IGNORE_INDEX, StepBatches


def collate(features):
    width = max(len(f["input_ids"]) for f in features)
    pad = lambda seq, value: seq + [value] * (width - len(seq))  # noqa: E731
    return {
        "input_ids": torch.tensor([pad(f["input_ids"], 0) for f in features]),
        "attention_mask": torch.tensor([pad([1] * len(f["input_ids"]), 0) for f in features]),
        "labels": torch.tensor([pad(f["labels"], IGNORE_INDEX) for f in features]),
    }


DATASET = [{"input_ids": list(range(1, 3 + i)), "labels": [IGNORE_INDEX] + list(range(2, 3 + i))} for i in range(11)]


def test_each_epoch_visits_every_sample_once_with_a_short_last_step():
    batches = StepBatches(DATASET, collate, samples_per_step=4, seed=3)
    assert batches.steps_per_epoch == 3
    for epoch in range(3):
        steps = [batches.step_indices(epoch * 3 + j) for j in range(3)]
        assert [len(s) for s in steps] == [4, 4, 3]
        assert sorted(i for s in steps for i in s) == list(range(11))
    assert batches.step_indices(0) != batches.step_indices(3)  # reshuffled per epoch
    assert batches.position(4) == (1, 4)


def test_positions_do_not_depend_on_history():
    fresh = StepBatches(DATASET, collate, samples_per_step=4, seed=3)
    walked = StepBatches(DATASET, collate, samples_per_step=4, seed=3)
    for step in range(7):
        walked.step_indices(step)
    assert fresh.step_indices(7) == walked.step_indices(7)
    assert StepBatches(DATASET, collate, 4, seed=4).step_indices(0) != fresh.step_indices(0)


def test_micro_batches_split_the_step_and_count_label_tokens_after_the_shift():
    batches = StepBatches(DATASET, collate, samples_per_step=4, seed=0)
    micro = batches.micro_batches(0, micro_batch_size=3, device=torch.device("cpu"))
    assert [mb.input_ids.shape[0] for mb in micro] == [3, 1]
    indices = batches.step_indices(0)
    expected_labels = sum(len(DATASET[i]["labels"]) - 1 for i in indices)  # first label is IGNORE
    assert sum(mb.num_label_tokens for mb in micro) == expected_labels
    assert sum(mb.num_tokens for mb in micro) == sum(len(DATASET[i]["input_ids"]) for i in indices)
