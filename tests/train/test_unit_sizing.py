"""Units sized by the decode step (issue 35, item 4; harvest.train.microbatch.UnitSizing).

- In a decode server a job whose ``unit_target_ms`` is auto sizes its micro-batch so a unit
  takes ``trainer.unit_step_fraction`` of the decode step's target, timed on the trainer
  stream of the level that gives the trainer the fewest SMs; the composition root hands
  that sizing to the job builder.
- A job's own ``unit_target_ms`` wins (still timed on the server's partition); alone
  (``harvest train``) auto is the stand-alone default.
- ``/harvest/status`` (the trainer's stats) says what the micro-batch was sized for, the
  measured unit and why; a bad ``trainer.unit_step_fraction`` is refused naming the key.
- The size: at most three probes; a unit's cost that is a fixed part plus a part per
  sequence (a small unit is mostly the host issuing kernels) gets the largest size within
  the target, not the size a line through the origin stops at.
"""

from __future__ import annotations

import pytest

from harvest.ladder import GREEN_CONTEXTS, Ladder, Level
from harvest.train.job import DEFAULT_UNIT_TARGET_MS, load_job
from harvest.train.microbatch import UnitSizing, decode_step_sizing
from tests.train.trainer_helpers import job_dict


def test_on_a_whole_device_ladder_the_unit_is_the_fraction_of_the_step_on_the_shared_device():
    sizing = decode_step_sizing(0.25, 40.0, Ladder.whole_device(8, "CPU", trainer_stream=None))
    assert sizing.target_ms == pytest.approx(10.0) and sizing.stream is None
    assert sizing.reason == "0.25 of the 40 ms decode step, on the whole device, shared with decode"


def test_with_partitions_the_unit_is_timed_on_the_trainers_smallest_partition():
    streams = {sms: f"trainer stream of {sms} SMs" for sms in (32, 52, 72)}
    levels = [Level(132 - t, t, f"decode {t}", streams[t]) for t in (52, 32, 72)] + [Level(132, 0)]
    ladder = Ladder(132, tuple(levels), GREEN_CONTEXTS)
    sizing = decode_step_sizing(0.5, 30.0, ladder)
    assert sizing.target_ms == pytest.approx(15.0)
    assert sizing.stream == "trainer stream of 32 SMs"
    assert sizing.reason == "0.5 of the 30 ms decode step, on level 1's 32 of 132 SMs, the trainer's smallest partition"


def _build(tiny_llama_path, tmp_path, unit_sizing=None, **harvest):
    from harvest.train.build import build_trainer

    return build_trainer(load_job(job_dict(tiny_llama_path, tmp_path, harvest={"micro_batch_size": "auto", **harvest})),
                         unit_sizing=unit_sizing)


def test_an_auto_job_in_a_server_is_sized_for_the_servers_target_and_says_so(tiny_llama_path, tmp_path):
    server = UnitSizing(1e-6, None, "0.25 of the 4e-06 ms decode step, on the whole device, shared with decode")
    trainer = _build(tiny_llama_path, tmp_path / "server", server)
    assert trainer.micro_batch_size == 1  # no unit meets a nanosecond: the smallest micro-batch
    sizing = trainer.stats().unit_sizing
    assert sizing["target_ms"] == 0.0 and sizing["reason"] == server.reason and sizing["micro_batch_size"] == 1
    assert sizing["measured_ms"] > 0

    roomy = UnitSizing(1e6, None, "a step of minutes")
    trainer = _build(tiny_llama_path, tmp_path / "roomy", roomy)
    assert trainer.micro_batch_size == 4  # the whole step's samples (2 x 2) in one unit
    assert trainer.stats().unit_sizing["reason"] == "a step of minutes"


def test_the_jobs_own_target_wins_and_alone_auto_is_the_default(tiny_llama_path, tmp_path):
    from harvest.train.build import _unit_sizing
    from harvest.train.job import HarvestOptions

    server = UnitSizing(1e6, "the partition's stream", "the server's")
    own = _unit_sizing(HarvestOptions(unit_target_ms=2.5), server)
    assert (own.target_ms, own.stream, own.reason) == (2.5, "the partition's stream", "harvest.unit_target_ms in the job")
    assert _unit_sizing(HarvestOptions(), server) is server
    alone = _unit_sizing(HarvestOptions(), None)
    assert (alone.target_ms, alone.stream) == (DEFAULT_UNIT_TARGET_MS, None)

    trainer = _build(tiny_llama_path, tmp_path / "own", UnitSizing(1e6, None, "the server's"), unit_target_ms=1e-6)
    assert trainer.micro_batch_size == 1 and trainer.stats().unit_sizing["reason"] == "harvest.unit_target_ms in the job"
    fixed = _build(tiny_llama_path, tmp_path / "fixed", UnitSizing(1e-6, None, "the server's"), micro_batch_size=2)
    assert fixed.micro_batch_size == 2
    assert fixed.stats().unit_sizing == {"micro_batch_size": 2, "reason": "harvest.micro_batch_size in the job"}


@pytest.mark.parametrize("data_keys, mask_dims", [({}, 2), ({"neat_packing": True, "cutoff_len": 256}, 4)])
def test_the_sizing_times_micro_batches_of_the_jobs_own_form(tiny_llama_path, tmp_path, monkeypatch, data_keys,
                                                             mask_dims):
    """What a unit costs depends on the batch the collator makes (neat packing's 4-D mask
    takes attention off its causal fast path; packing fills every row to cutoff_len), so the
    probe is the job's longest sample, collated as training collates it, not a stand-in."""
    from harvest.train import microbatch
    from harvest.train.build import build_trainer

    probes = []
    monkeypatch.setattr(microbatch, "longest_unit_ms",
                        lambda trainer, probe, stream=None: probes.append(probe) or float(probe.input_ids.shape[0]))
    job = job_dict(tiny_llama_path, tmp_path, harvest={"micro_batch_size": "auto"}, **data_keys)
    trainer = build_trainer(load_job(job), unit_sizing=UnitSizing(2.0, None, "two probe units"))
    assert trainer.micro_batch_size == 2 and [p.input_ids.shape[0] for p in probes] == [1, 2]
    longest = max(len(row["input_ids"]) for row in trainer.batches.dataset)
    assert all(p.attention_mask.dim() == mask_dims for p in probes)
    assert all(p.input_ids.shape[1] == -(-longest // 8) * 8 for p in probes)  # the collator pads to a multiple of 8


def test_the_composition_root_hands_the_job_builder_the_decode_step_sizing(tiny_llama_path, monkeypatch):
    from harvest.colocate import assemble as assemble_module
    from harvest.colocate.assemble import EngineAdapter, KvPool, assemble
    from harvest.colocate.colocation import NoKvLending
    from harvest.colocate.job_queue import JobSpec
    from harvest.config import HarvestConfig, MemoryConfig
    from harvest.memory import UnifiedAllocator
    from harvest.schedule import SchedulerConfig
    from harvest.train.trainer_cpu import TrainerConfig

    handed = {}

    def job_file_builder(*args, **kwargs):
        handed.update(kwargs)
        return lambda job_path: None

    monkeypatch.setattr(assemble_module, "job_file_builder", job_file_builder)
    alloc = UnifiedAllocator(num_layers=2, kv_heads=2, head_dim=16, dtype_bytes=4, max_tokens=8 * 128,
                             page_bytes=16 * 1024)
    kv = KvPool(allocator=alloc, num_tokens=8 * 128 - 1, max_batch_size=4,
                lending_controller=lambda policy, budget, memory, metrics: NoKvLending())
    # A job in the queue, so the server builds jobs (the builder above builds nothing).
    engine = EngineAdapter(device="cpu", model_path=str(tiny_llama_path), model_dtype="float32", kv=kv,
                           jobs=(JobSpec("job.yaml", "job", 1.0, None, "out"),))
    config = HarvestConfig(qos=SchedulerConfig(target_tpot_ms=48.0), trainer=TrainerConfig(unit_step_fraction=0.125),
                           memory=MemoryConfig(reserve_tokens=128))
    colocation = assemble(config, engine)
    try:
        sizing = handed["unit_sizing"]
        assert sizing.target_ms == pytest.approx(6.0) and sizing.stream is None
        assert sizing.reason == "0.125 of the 48 ms decode step, on the whole device, shared with decode"
    finally:
        colocation.close(trainer_timeout_s=5.0)
        colocation.partitioner.close()


@pytest.mark.parametrize("value", [0, 1.5, -0.25, "half"])
def test_a_bad_unit_step_fraction_is_refused_naming_the_key(tmp_path, value):
    from harvest.config import ConfigError, load

    path = tmp_path / "harvest.yaml"
    path.write_text(f"trainer: {{unit_step_fraction: {value}}}\n")
    with pytest.raises(ConfigError, match=r"trainer\.unit_step_fraction"):
        load(path)


class _CostModel:
    """A unit's time as a function of its micro-batch size, counting the probes."""

    def __init__(self, cost):
        self.cost, self.probes = cost, []

    def __call__(self, trainer, probe, stream=None):
        self.probes.append(probe)
        return self.cost(probe)


def _choose(monkeypatch, cost, target_ms, max_size):
    import types

    import torch

    from harvest.train import microbatch

    model = _CostModel(cost)
    monkeypatch.setattr(microbatch, "longest_unit_ms", model)
    trainer = types.SimpleNamespace(device=torch.device("cpu"),
                                    optimizer=types.SimpleNamespace(zero_grad=lambda set_to_none: None))
    chosen = microbatch.choose_micro_batch_size(trainer, target_ms, lambda n: n, max_size)
    return chosen, model.probes


@pytest.mark.parametrize("cost, target_ms, max_size, chosen, probes", [
    (lambda n: 3 + 0.5 * n, 10.0, 64, (14, 10.0), [1, 2, 14]),  # host-bound: the origin's line said 2
    (lambda n: 6 + 0.5 * n, 10.0, 64, (8, 10.0), [1, 2, 8]),  # the origin's line says 1: still probes 2
    (lambda n: 3 + 0.5 * n, 10.0, 8, (8, 7.0), [1, 2, 8]),  # the job's batch caps it
    (lambda n: 1.0 * n, 4.0, 64, (4, 4.0), [1, 4]),  # proportional: the first line was right
    (lambda n: 12.0, 10.0, 64, (1, 12.0), [1]),  # one sequence is over the target already
    (lambda n: 1.0, 10.0, 64, (64, 1.0), [1, 10, 64]),  # a cost that does not grow: the whole batch
    (lambda n: 3 + 0.05 * n * n, 10.0, 64, (3, 3.45), [1, 3, 35]),  # curved: the largest measured within target
    (lambda n: 5.0, 5.0, 64, (1, 5.0), [1]),
])
def test_the_size_is_the_largest_a_fixed_plus_per_sequence_line_puts_within_the_target(monkeypatch, cost, target_ms,
                                                                                      max_size, chosen, probes):
    got, probed = _choose(monkeypatch, cost, target_ms, max_size)
    assert probed == probes and len(probed) <= 3
    assert got[0] == chosen[0] and got[1] == pytest.approx(chosen[1])


def test_for_any_linear_cost_the_size_is_the_largest_within_the_target(monkeypatch):
    import math
    import random

    rng = random.Random(7)
    for _ in range(300):
        fixed, per_sequence = rng.uniform(0, 8), rng.uniform(0.01, 3)
        target_ms, max_size = rng.uniform(1, 20), rng.randint(1, 64)
        (size, unit_ms), probes = _choose(monkeypatch, lambda n: fixed + per_sequence * n, target_ms, max_size)
        best = max(1, min(max_size, math.floor((target_ms - fixed) / per_sequence)))
        assert size == best, (fixed, per_sequence, target_ms, max_size, probes)
        assert len(probes) <= 3 and unit_ms == pytest.approx(fixed + per_sequence * size)
