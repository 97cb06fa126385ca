"""The transformers engine's decode batches (harvest.engines.transformers): the ragged
eager batch, the slot batch of the graphs-on serving step and the static batch of the
level-graphs measurement each give every request the logits it would get decoding alone
(joins, leaves, padding, the write column's ring); the capturable steps read nothing back
to the host. The ``[cuda]`` cases run where gpu_validate.sh runs ``-m gpu``."""

from __future__ import annotations

import pytest

from harvest.engines.transformers.ragged_batch import RaggedDecodeBatch
from harvest.engines.transformers.static_batch import SlotDecodeBatch, StaticDecodeBatch
from tests.engines.helpers import DEVICES, model_on, solo_logits


@pytest.mark.parametrize("device", DEVICES)
def test_ragged_batch_decodes_each_request_as_if_alone(tiny_llama_path, device, one_thread):
    import torch

    model = model_on(tiny_llama_path, device)
    prompts = {1: [5 + 7 * j % 300 for j in range(5)], 2: [9 + 11 * j % 300 for j in range(9)], 3: [3, 4, 5]}
    batch = RaggedDecodeBatch(model, device)
    seen = {rid: [] for rid in prompts}

    def steps(count):
        for _ in range(count):
            batch.step()
            for row, rid in enumerate(batch.request_ids):
                seen[rid].append(batch.last_logits[row].float().cpu())
            assert batch.padded_length == max(batch.lengths)
            assert batch.sum_context() == sum(batch.lengths) + batch.num_requests
            assert batch.padded_sum_context() == batch.num_requests * (batch.padded_length + 1)

    def join(rid):
        batch.join([rid], [len(prompts[rid])], prompts=[prompts[rid]])

    join(1)
    steps(2)
    join(2)  # longer than the batch: the cache grows on the left
    steps(2)
    join(3)  # shorter: padded on the left
    steps(2)
    batch.leave([2])  # the longest leaves: padding columns are trimmed
    assert batch.padded_length == max(batch.lengths) == 5 + 6
    steps(2)
    batch.leave([1, 3])
    assert batch.num_requests == 0
    for rid, rows in seen.items():
        reference = solo_logits(model, prompts[rid], len(rows), device)
        assert torch.allclose(torch.stack(rows), torch.stack(reference), atol=1e-4, rtol=1e-4), rid


@pytest.mark.parametrize("device", DEVICES)
def test_slot_batch_decodes_each_request_as_if_alone(tiny_llama_path, device, one_thread):
    """The graphs-on serving batch: requests join free slots and leave (the last slots move
    into the holes), steps compute the smallest bucket holding them, and the shared write
    column wraps around its ring twice; every request gets the logits it would decoding
    alone."""
    import torch

    model = model_on(tiny_llama_path, device)
    prompts = {1: [5 + 7 * j % 300 for j in range(5)], 2: [9 + 11 * j % 300 for j in range(9)], 3: [3, 4, 5],
               4: [200, 17, 33, 8]}
    batch = SlotDecodeBatch(model, device, 4, 9, 6, buckets=[1, 2])
    assert batch.buckets == [1, 2, 4] and batch.max_length == 15
    seen = {rid: [] for rid in prompts}
    buckets = []

    def steps(count):
        for _ in range(count):
            buckets.append(batch.bucket)
            batch.step()
            for slot, rid in enumerate(batch.request_ids):
                seen[rid].append(batch.last_logits[slot].float().cpu().clone())  # a static buffer
            assert batch.sum_context() == sum(batch.lengths) + batch.num_requests
            assert batch.padded_sum_context() == batch.bucket * batch.max_length

    def join(*rids):
        batch.join(rids, [len(prompts[r]) for r in rids], prompts=[prompts[r] for r in rids])

    join(1)
    steps(2)
    join(2, 3)
    steps(2)
    batch.leave([1])  # slot 0 freed: request 3 (slot 2) moves there
    assert batch.request_ids == [3, 2]
    steps(3)
    join(4)
    steps(1)
    batch.leave([2, 3])
    assert batch.request_ids == [4]
    steps(4)
    assert buckets == [1, 1, 4, 4, 2, 2, 2, 4, 1, 1, 1, 1]  # the write column went round its ring of 6 twice
    with pytest.raises(RuntimeError, match="outstays"):
        steps(2)  # request 4's sixth step fits, a seventh would overwrite its first ring column
    batch.leave([4])
    assert batch.num_requests == 0 and [len(rows) for rows in seen.values()] == [4, 6, 6, 6]
    for rid, rows in seen.items():
        reference = solo_logits(model, prompts[rid], len(rows), device)
        assert torch.allclose(torch.stack(rows), torch.stack(reference), atol=1e-4, rtol=1e-4), rid


# -- the static-cache step the level-graphs measurement captures (claim c) -------------------
HOST_READS = {"_local_scalar_dense", "nonzero", "masked_select", "_unique2", "unique_dim", "unique_consecutive",
              "repeat_interleave"}


@pytest.mark.parametrize("device", DEVICES)
def test_static_batch_decodes_each_request_as_if_alone(tiny_llama_path, device, one_thread):
    import torch

    model = model_on(tiny_llama_path, device)
    prompts = [[5 + 7 * j % 300 for j in range(6)], [9 + 11 * j % 300 for j in range(6)]]
    batch = StaticDecodeBatch(model, device, 2, 6, max_steps=3, prompts=prompts)
    seen = []
    for _ in range(5):  # the cache holds 3 new tokens: the fourth step starts over from the context
        batch.run(None, 0, None, graph=False)
        seen.append(batch.last_logits.float().cpu().clone())
    for row, prompt in enumerate(prompts):
        reference = solo_logits(model, prompt, 3, device)
        got = [seen[0][row], seen[1][row], seen[2][row]]
        assert torch.allclose(torch.stack(got), torch.stack(reference), atol=1e-4, rtol=1e-4), row
    assert batch.length == 8 and batch.steps_left == 1


def test_a_static_decode_step_reads_nothing_back_to_the_host(tiny_llama_path, one_thread):
    """What would break a CUDA graph capture (a sync: .item(), bool(tensor), nonzero, ...)
    shows on CPU as the aten op that reads a value to the host."""
    import torch
    from torch.utils._python_dispatch import TorchDispatchMode

    class HostReads(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.seen = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if func.__name__.split(".")[0] in HOST_READS:
                self.seen.append(func.__name__)
            return func(*args, **(kwargs or {}))

    batch = StaticDecodeBatch(model_on(tiny_llama_path, "cpu"), "cpu", 3, 8, max_steps=4)
    with HostReads() as mode:
        batch.decode_step()
        batch.decode_step()
    assert mode.seen == []
    slots = SlotDecodeBatch(batch.model, "cpu", 4, 8, 2, buckets=[2])
    slots.join([1], [5])
    with HostReads() as mode:  # the serving step, both buckets, the write column wrapping round
        for bucket in (2, 4, 2):
            slots.decode_step(bucket)
    assert mode.seen == []
    with HostReads() as mode:  # the detector does see one
        bool(torch.ones(1).any())
    assert mode.seen == ["_local_scalar_dense.default"]
