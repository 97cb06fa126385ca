"""The tensor-parallel trainer (harvest.train.tensor_parallel).

- A LoRA job on 2 ranks (gloo) equals the same job on one: the loss of every step and
  the final adapter rank 0 writes, to 1e-5 (LoRA B randomized so LoRA A learns too;
  gradient clipping on, so the norm over the ranks' shards is checked as well); no rank's
  trainer returns from the checkpoint before rank 0 has written it.
- A trainer fault on rank 1 makes rank 0's trainer leave (PeerTrainerFault) instead of
  waiting forever in a collective; also when the faulted rank's connections close before
  rank 0 is told (the collective fails first, the abort follows within a grace).
- The vocabulary is split as SGLang splits it; what cannot be split is refused by name.
"""

from __future__ import annotations

import types

import pytest

from harvest.train.errors import JobError
from harvest.train.tensor_parallel import TensorParallel, Vote, check_shardable, vocab_range

pytestmark = pytest.mark.timeout(600)


@pytest.mark.slow
@pytest.mark.parametrize("family", ["llama", "qwen2"])
def test_two_ranks_train_as_one(family, tmp_path):
    from tests.train.tp_parity import check

    report = check(2, "cpu", work_dir=tmp_path, family=family)
    assert report["outcomes"] == {"0": "finished", "1": "finished"}, report
    assert len(report["tp_losses"]) == len(report["tp1_losses"]) == 4
    assert report["ranks_agree_on_losses"]
    assert report["checkpoint_step_by_rank"] == [4, 4], report  # rank 0 wrote it, and every rank knows
    assert report["max_loss_diff"] <= 1e-5, report
    assert report["adapter_keys_equal"]
    assert report["max_adapter_diff"] <= 1e-5, report


@pytest.mark.slow
def test_a_fault_on_rank_1_stops_rank_0s_trainer(tmp_path):
    from tests.train.tp_parity import check

    report = check(2, "cpu", fault_rank=1, work_dir=tmp_path)
    assert report["outcomes"] == {"0": "peer_fault", "1": "fault"}, report
    assert "InjectedTrainerFault" in report["errors"]["1"]
    assert "rank 1" in report["errors"]["0"]


@pytest.mark.parametrize("vocab", [512, 400, 32000, 128256, 151936])
@pytest.mark.parametrize("size", [1, 2, 4, 8])
def test_vocab_shards_are_sglangs(vocab, size):
    from sglang.srt.layers.vocab_parallel_embedding import pad_vocab_size, vocab_range_from_global_vocab_size

    padded = pad_vocab_size(vocab)
    if padded % size:
        with pytest.raises(JobError, match="vocabulary"):
            vocab_range(vocab, 0, size)
        return
    covered = []
    for rank in range(size):
        start, end, rows = vocab_range(vocab, rank, size)
        first, last = vocab_range_from_global_vocab_size(padded, rank, size)
        assert (start, rows) == (first, last - first)
        assert end == min(last, vocab)
        covered += list(range(start, end))
    assert covered == list(range(vocab))


def _config(heads=32, kv_heads=8, intermediate=14336, vocab=128256):
    return types.SimpleNamespace(num_attention_heads=heads, num_key_value_heads=kv_heads,
                                 intermediate_size=intermediate, vocab_size=vocab)


@pytest.mark.parametrize("size", [1, 2, 4, 8])
def test_llama3_8b_splits_over_up_to_8_ranks(size):
    check_shardable(_config(), size)


@pytest.mark.parametrize("config, size, named", [
    (_config(kv_heads=2), 4, "key/value heads"),
    (_config(heads=12, kv_heads=12), 8, "attention heads"),
    (_config(intermediate=100), 8, "intermediate"),
])
def test_what_does_not_split_evenly_is_refused_by_name(config, size, named):
    with pytest.raises(JobError, match=named):
        check_shardable(config, size)


def test_one_rank_needs_no_collectives():
    tp = TensorParallel.single()
    assert tp.agree(Vote.WAIT) is Vote.WAIT
    import torch

    t = torch.ones(3)
    assert tp.all_reduce(t) is t
    assert tp.all_gather(t, 0) is t


class _FailedWork:
    """A collective that gloo completed with an error (a peer closed its connections)."""

    def is_completed(self):
        return True

    def wait(self):
        raise RuntimeError("[gloo/transport/tcp/pair.cc] Connection closed by peer")


@pytest.mark.parametrize("poll", [True, False])
def test_a_failed_collective_that_a_peers_fault_explains_is_that_fault(poll):
    import threading

    from harvest.train.tensor_parallel import PeerTrainerFault

    tp = TensorParallel.single()
    # The faulted peer's process ended before this rank's abort came: the abort follows.
    timer = threading.Timer(0.05, tp.abort, args=("rank 1's trainer faulted",))
    timer.start()
    with pytest.raises(PeerTrainerFault, match="rank 1"):
        tp._wait(_FailedWork(), poll=poll)
    timer.join()
    # No abort within the grace: the operation's own error.
    with pytest.raises(RuntimeError, match="Connection closed by peer") as raised:
        TensorParallel.single()._wait(_FailedWork(), poll=poll)
    assert not isinstance(raised.value, PeerTrainerFault)


@pytest.mark.parametrize("optim", ["adafactor"])
def test_a_tensor_parallel_job_refuses_optimizers_that_are_not_elementwise(optim, tiny_llama_path, tmp_path):
    from harvest.train.plan import check_tensor_parallel_job
    from harvest.train.job import load_job
    from tests.train.trainer_helpers import job_dict

    job = load_job(job_dict(tiny_llama_path, tmp_path / "out", optim=optim))
    with pytest.raises(JobError, match=f"optim: '{optim}'"):
        check_tensor_parallel_job(job)
    check_tensor_parallel_job(load_job(job_dict(tiny_llama_path, tmp_path / "out2")))
