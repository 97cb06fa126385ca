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


def test_a_batch_keeps_the_packed_rows_position_ids_and_counts_tokens_by_its_mask():
    from llamafactory.data.collator import prepare_4d_attention_mask

    from harvest.train.data import micro_batch_from

    ids = torch.tensor([[5, 6, 7, 8, 9, 0]])
    labels = torch.tensor([[IGNORE_INDEX, 6, 7, IGNORE_INDEX, 9, IGNORE_INDEX]])
    positions = torch.tensor([[0, 1, 2, 0, 1, 0]])  # two packed sequences, then padding
    indexed = torch.tensor([[1, 1, 1, 2, 2, 0]])  # neat packing numbers its sequences
    cpu = torch.device("cpu")
    packed = micro_batch_from({"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": labels,
                               "position_ids": positions}, 0, cpu)
    assert torch.equal(packed.position_ids, positions)
    assert packed.num_tokens == 6  # packing's padding is attended (mask 1), as LlamaFactory builds it
    assert packed.num_label_tokens == 3
    neat = micro_batch_from({"input_ids": ids, "attention_mask": prepare_4d_attention_mask(indexed, torch.float32),
                             "labels": labels, "position_ids": positions}, 1, cpu)
    assert neat.attention_mask.shape == (1, 1, 6, 6) and neat.num_tokens == 5
    assert micro_batch_from({"input_ids": ids, "attention_mask": indexed, "labels": labels}, 2, cpu).num_tokens == 5
    assert micro_batch_from({"input_ids": ids, "attention_mask": None, "labels": labels}, 3, cpu).num_tokens == 6
    assert micro_batch_from({"input_ids": ids, "attention_mask": indexed, "labels": labels}, 4, cpu).position_ids \
        is None  # the embedding stage counts 0.. as the model's forward does


def test_a_batch_field_the_trainer_would_not_feed_is_refused_not_dropped():
    import pytest

    from harvest.train.data import micro_batch_from

    ids = torch.tensor([[5, 6]])
    batch = {"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": ids, "token_type_ids": ids,
             "pixel_values": torch.zeros(1)}
    with pytest.raises(ValueError, match="carries pixel_values, token_type_ids, which the layer-split trainer"):
        micro_batch_from(batch, 0, torch.device("cpu"))


def test_a_job_whose_collator_makes_such_a_field_stops_before_training(tiny_qwen2_path, tmp_path, monkeypatch):
    from pathlib import Path

    import pytest
    from llamafactory.data import SFTDataCollatorWith4DAttentionMask

    from harvest.train.build import build_trainer
    from harvest.train.job import JobError, load_job
    from tests.train.test_llamafactory_parity import parity_job

    collate = SFTDataCollatorWith4DAttentionMask.__call__
    monkeypatch.setattr(SFTDataCollatorWith4DAttentionMask, "__call__",
                        lambda self, features: collate(self, features) | {"token_type_ids": torch.zeros(1)})
    job = parity_job(Path(tiny_qwen2_path), tmp_path / "out") | {"harvest": {"device": "cpu"}}
    with pytest.raises(JobError, match="dataset: the collated batch carries token_type_ids"):
        build_trainer(load_job(job))
    assert not (tmp_path / "out").exists() or not any((tmp_path / "out").iterdir())
