"""The composition root builds the system the config describes: every section reaches the
part it configures, the refiner runs no thread of its own, and a failure at start-up
releases the SM ladder it built."""

from __future__ import annotations

import json
import threading
from pathlib import Path

import pytest

from harvest.colocate.assemble import EngineAdapter, assemble
from harvest.colocate.colocation import NoKvLending
from harvest.compute import WholeDevicePartitioner
from harvest.config import HarvestConfig, MemoryConfig
from harvest.predict.compat import ProfileMismatchError
from harvest.predict.online import OnlineSettings
from harvest.schedule import SchedulerConfig, TrainerState
from harvest.train.trainer_cpu import TrainerConfig

ROOT = Path(__file__).resolve().parents[2]
CPU_PROFILE = ROOT / "profiles" / "cpu-tiny-llama-sglang.json"


class _Trainer:
    """Enough of a LayerSplitTrainer for the host: it runs until stopped."""

    total_steps = 1
    global_step = 0

    def peek_next_unit_ready(self):
        return True

    def peek_next_unit(self):
        return None

    def run(self, gate, on_unit=None):
        while not gate.stopped:
            gate.acquire()
        return "stopped"

    def stats(self):
        return None


def _config(**overrides):
    values = dict(qos=SchedulerConfig(target_tpot_ms=12.0, max_margin=0.3, hysteresis_steps=2),
                  profile=CPU_PROFILE, allow_profile_mismatch=True, online=OnlineSettings(window=64, refit_min_interval_s=7.0),
                  trainer=TrainerConfig(cpu_threads=1, nice=3))
    values.update(overrides)
    return HarvestConfig(**values)


def test_every_section_reaches_the_part_it_configures(tiny_llama_path):
    config = _config()
    engine = EngineAdapter(device="cpu", model_path=str(tiny_llama_path), model_dtype="float32",
                           build_trainer=lambda job: _Trainer(), jobs=("job",))
    colocation = assemble(config, engine)
    try:
        assert colocation.step_controller.qos.config is config.qos
        assert colocation.step_controller.target_s == pytest.approx(0.012)
        assert colocation.refiner.settings is config.online and colocation.refit_min_interval_s == 7.0
        assert colocation.step_controller.predictor is colocation.refiner.predictor
        assert colocation.partitioner.ladder.num_levels == 1 and colocation.step_controller.qos.ladder is colocation.partitioner.ladder
        host = colocation.trainer_host
        assert (host.cpu_threads, host.nice) == (1, 3) and host.scheduler_state() is TrainerState.BUILDING
        assert host.on_unit == colocation._after_trainer_unit and host.on_fault == colocation._on_trainer_fault
        assert isinstance(colocation.lending, NoKvLending)  # this engine lends no KV cache
        assert not [t for t in threading.enumerate() if "refit" in t.name]  # refits run between units and when idle
        # The committed profile predates the co-run workload's micro-batch size: it checks nothing.
        assert host.corun_check(10**9, "job x") is None
    finally:
        colocation.close(trainer_timeout_s=5.0)
        colocation.partitioner.close()


def test_the_jobs_units_are_checked_against_the_co_run_workload_the_profile_records(tiny_llama_path, tmp_path):
    data = json.loads(CPU_PROFILE.read_text())
    data["provenance"]["finetune"]["micro_batch_tokens"] = 256.0
    profile = tmp_path / "recorded.json"
    profile.write_text(json.dumps(data))
    engine = EngineAdapter(device="cpu", model_path=str(tiny_llama_path), model_dtype="float32",
                           build_trainer=lambda job: _Trainer(), jobs=("job",))
    colocation = assemble(_config(profile=profile), engine)
    try:
        check = colocation.trainer_host.corun_check
        assert check(300.0, "job j") is None
        assert check(2048.0, "job j").startswith("job j's micro-batches carry 2048 tokens, 8x the 256")
    finally:
        colocation.close(trainer_timeout_s=5.0)
        colocation.partitioner.close()


def test_jobs_without_a_builder_or_a_kv_pool_are_refused(tiny_llama_path, monkeypatch):
    built = []
    monkeypatch.setattr("harvest.colocate.assemble.build_partitioner",
                        lambda config, device: built.append(WholeDevicePartitioner("cpu")) or built[-1])
    engine = EngineAdapter(device="cpu", model_path=str(tiny_llama_path), model_dtype="float32", jobs=("job",))
    with pytest.raises(ValueError, match="build_trainer"):
        assemble(_config(), engine)
    assert built[0].closed  # the ladder it built is released


def test_a_profile_that_does_not_match_refuses_and_releases_the_ladder(tiny_llama_path, monkeypatch):
    built = []
    monkeypatch.setattr("harvest.colocate.assemble.build_partitioner",
                        lambda config, device: built.append(WholeDevicePartitioner("cpu")) or built[-1])

    def refuse(path, identity, allow_mismatch):
        raise ProfileMismatchError(f"{path}: measured on another device")

    monkeypatch.setattr("harvest.predict.compat.load_for", refuse)
    engine = EngineAdapter(device="cpu", model_path=str(tiny_llama_path), model_dtype="float32")
    with pytest.raises(ProfileMismatchError, match="another device"):
        assemble(_config(allow_profile_mismatch=False), engine)
    assert len(built) == 1 and built[0].closed


def test_kv_fence_streams_are_every_levels_decode_stream_and_the_engines_current_stream(monkeypatch):
    import torch

    from harvest.colocate.assemble import kv_fence_streams
    from harvest.ladder import GREEN_CONTEXTS, Ladder, Level

    decode = [object(), object()]
    current = object()
    ladder = Ladder(132, (Level(32, 100, decode[0], object()), Level(132, 0, decode[1])), realisation=GREEN_CONTEXTS)
    seen_devices = []
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device: seen_devices.append(device) or current)
    assert kv_fence_streams(ladder, "cuda:1") == [decode[0], decode[1], current]
    assert seen_devices == [torch.device("cuda", 1)]
    engine_own = object()  # SGLang's forward stream, say
    assert kv_fence_streams(ladder, "cuda:1", (engine_own, None)) == [decode[0], decode[1], engine_own, current]
    assert kv_fence_streams(Ladder.whole_device(1, "CPU device"), "cpu") == []  # host work is synchronous


def test_the_composition_root_registers_the_kv_fence_streams_on_the_allocator(tiny_llama_path, monkeypatch):
    from harvest.colocate.assemble import KvPool
    from harvest.memory import UnifiedAllocator

    alloc = UnifiedAllocator(num_layers=2, kv_heads=2, head_dim=16, dtype_bytes=4, max_tokens=8 * 128,
                             page_bytes=16 * 1024)
    asked = []

    def fence_streams(ladder, device, engine_streams):
        asked.append((ladder, device, engine_streams))
        return [5, None]

    monkeypatch.setattr("harvest.colocate.assemble.kv_fence_streams", fence_streams)
    kv = KvPool(allocator=alloc, num_tokens=8 * 128 - 1, max_batch_size=4,
                lending_controller=lambda policy, budget, memory, metrics: NoKvLending(), engine_streams=("own",))
    engine = EngineAdapter(device="cpu", model_path=str(tiny_llama_path), model_dtype="float32", kv=kv, jobs=())
    colocation = assemble(_config(), engine)
    try:
        assert asked == [(colocation.partitioner.ladder, "cpu", ("own",))]
        assert alloc.fence_streams == (5, 0)  # None: the legacy default stream
    finally:
        colocation.close(trainer_timeout_s=5.0)
        colocation.partitioner.close()
        alloc.close()


def _job_file(path: Path, **keys) -> Path:
    import yaml

    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(yaml.safe_dump({"output_dir": "adapter", **keys}))
    return path


def test_start_up_refuses_two_jobs_with_one_name_or_one_output_folder(tmp_path):
    from harvest.colocate.assemble import job_specs
    from harvest.colocate.job_queue import JobRefused

    a = _job_file(tmp_path / "a.yaml", output_dir="out/a")
    same_name = _job_file(tmp_path / "other" / "x.yaml", output_dir="b", harvest={"name": "a"})
    with pytest.raises(JobRefused, match=r"jobs\[1\] .* has the name of"):
        job_specs([a, same_name])
    # The same folder spelled another way (relative to another job file, through ..) is the same folder.
    same_folder = _job_file(tmp_path / "sub" / "b.yaml", output_dir="../out/x/../a")
    with pytest.raises(JobRefused, match=rf"jobs\[1\] .* has the output_dir {tmp_path}/sub/\.\./out/x/\.\./a of"):
        job_specs([a, same_folder])
    assert [spec.name for spec in job_specs([a, _job_file(tmp_path / "c.yaml", output_dir="out/c")])] == ["a", "c"]


class _LendingWithReserve(NoKvLending):
    reserve = None  # the server's lending controller has one (harvest.sglang.kv_lending)


class _Log:
    def __init__(self):
        self.lines = []

    def __getattr__(self, level):
        return lambda message, *args: self.lines.append((level, message % args))


def _assemble_with_kv(tiny_llama_path, monkeypatch, config):
    from harvest.colocate.assemble import KvPool
    from harvest.memory import UnifiedAllocator

    log = _Log()
    monkeypatch.setattr("harvest.colocate.assemble.logger", log)
    alloc = UnifiedAllocator(num_layers=2, kv_heads=2, head_dim=16, dtype_bytes=4, max_tokens=8 * 128, page_bytes=16 * 1024)
    lending = _LendingWithReserve()
    kv = KvPool(allocator=alloc, num_tokens=8 * 128 - 1, max_batch_size=4,
                lending_controller=lambda policy, budget, memory, metrics: lending)
    engine = EngineAdapter(device="cpu", model_path=str(tiny_llama_path), model_dtype="float32", kv=kv, jobs=())
    colocation = assemble(config, engine)
    colocation.close(trainer_timeout_s=5.0)
    colocation.partitioner.close()
    return lending.reserve, [line for line in log.lines if "KV lending" in line[1]], alloc.geometry.chunk_bytes


def test_the_auto_reserve_counts_the_profiles_measured_reclaim_cost_scaled_to_the_served_chunk(tiny_llama_path, tmp_path,
                                                                                             monkeypatch):
    import json

    data = json.loads(CPU_PROFILE.read_text())
    chunk_bytes = 4 * 16 * 1024  # the pool below: 2 layers, K and V, one 16 KiB page each
    data["memory"] = {"chunk_bytes": 2 * chunk_bytes, "lend_ms_per_chunk": 1.0, "reclaim_ms_per_chunk": 0.5, "pages_per_chunk": 8}
    profile = tmp_path / "measured.json"
    profile.write_text(json.dumps(data))
    reserve, lines, served = _assemble_with_kv(tiny_llama_path, monkeypatch, _config(profile=profile))
    assert served == chunk_bytes
    assert reserve.reclaim_s_per_chunk == pytest.approx(0.25e-3) and reserve.cost_source == "measured by `harvest profile`"
    assert [level for level, _ in lines] == ["info"]
    assert f"0.25 ms per chunk reclaimed (profile {profile}'s memory section, measured for a 0.125 MiB chunk, scaled" in lines[0][1]
    # harvest.yaml's figure wins over the profile's
    reserve, lines, _ = _assemble_with_kv(tiny_llama_path, monkeypatch,
                                          _config(profile=profile, memory=MemoryConfig(reclaim_ms_per_chunk=2.0)))
    assert reserve.reclaim_s_per_chunk == pytest.approx(2e-3) and "harvest.yaml" in reserve.cost_source
    assert [level for level, _ in lines] == ["info"]


def test_without_a_measured_or_configured_reclaim_cost_the_default_is_used_with_one_warning(tiny_llama_path, tmp_path,
                                                                                           monkeypatch):
    import json

    older = tmp_path / "older.json"  # a profile from before `harvest profile` timed lends and reclaims
    older.write_text(json.dumps({k: v for k, v in json.loads(CPU_PROFILE.read_text()).items() if k != "memory"}))
    reserve, lines, _ = _assemble_with_kv(tiny_llama_path, monkeypatch, _config(profile=older))
    assert reserve.reclaim_s_per_chunk == pytest.approx(7e-3) and reserve.cost_source == "the default"
    assert [level for level, _ in lines] == ["warning", "info"]
    assert lines[0][1].startswith(f"KV lending: profile {older} has no lend/reclaim figures (profile.memory.reclaim_ms")
    assert "the default 7 ms per chunk" in lines[0][1]
    # a fixed reserve has no reclaim horizon: nothing to warn about
    reserve, lines, _ = _assemble_with_kv(tiny_llama_path, monkeypatch,
                                          _config(profile=older, memory=MemoryConfig(reserve_tokens=64)))
    assert reserve is None and lines == []


def test_the_committed_cpu_profile_gives_the_server_its_measured_reclaim_cost(tiny_llama_path, monkeypatch):
    reserve, lines, served = _assemble_with_kv(tiny_llama_path, monkeypatch, _config())
    measured = json.loads(CPU_PROFILE.read_text())["memory"]
    scaled = measured["reclaim_ms_per_chunk"] * served / measured["chunk_bytes"]
    assert reserve.reclaim_s_per_chunk == pytest.approx(scaled / 1e3) and [level for level, _ in lines] == ["info"]


@pytest.mark.parametrize("memory, message", [
    ({"chunk_bytes": 65536, "lend_ms_per_chunk": 1.0, "reclaim_ms_per_chunk": -2.0}, "profile.memory.reclaim_ms_per_chunk=-2.0"),
    ({"chunk_bytes": 65536, "lend_ms_per_chunk": 1e999, "reclaim_ms_per_chunk": 2.0}, "profile.memory.lend_ms_per_chunk: expected a finite number"),
    ({"chunk_bytes": 65536, "lend_ms_per_chunk": 1.0}, "profile.memory: missing field(s) reclaim_ms_per_chunk"),
])
def test_a_damaged_memory_section_refuses_the_start_naming_the_file_and_field(tiny_llama_path, tmp_path, monkeypatch, memory,
                                                                             message):
    import json

    from harvest.predict.schema import ProfileError

    data = json.loads(CPU_PROFILE.read_text())
    profile = tmp_path / "bad.json"
    profile.write_text(json.dumps({**data, "memory": memory}).replace("Infinity", "1e999"))
    with pytest.raises(ProfileError) as refused:
        _assemble_with_kv(tiny_llama_path, monkeypatch, _config(profile=profile))
    assert str(refused.value).startswith(f"{profile}: {message}")


def test_a_job_built_in_the_server_starts_where_harvest_train_does_and_hands_decode_its_generators_back(
        tiny_llama_path, tmp_path):
    """LlamaFactory's parser seeds every generator with the job's seed. In a server those are
    decode's (SGLang samples with them, seeded by --random-seed): left reseeded, every server
    that built the same job sampled from one sequence. The job's LoRA weights still start
    where `harvest train`'s do, as the job's seed says."""
    import random

    import numpy as np
    import torch

    from harvest.colocate.assemble import job_file_builder
    from harvest.memory import UnifiedAllocator
    from harvest.memory.lent_budget import LentMemoryBudget
    from tests.train.trainer_helpers import build, job_dict, lora_params, max_abs_diff

    def seed_every_generator(seed):
        random.seed(seed)
        np.random.seed(seed)
        torch.manual_seed(seed)

    def draws():
        return random.random(), float(np.random.rand()), torch.rand(4).tolist()

    alloc = UnifiedAllocator(num_layers=2, kv_heads=2, head_dim=16, dtype_bytes=4, max_tokens=32 * 128,
                             page_bytes=16 * 1024)
    alloc.lend(list(range(1, 32)))
    budget = LentMemoryBudget()
    budget.publish(lent_bytes=31 * alloc.geometry.chunk_bytes, wanted_back_bytes=0)
    seed_every_generator(1234)
    expected = draws()
    seed_every_generator(1234)
    served = job_file_builder(alloc, "cpu", budget, compile_layers="off")(job_dict(tiny_llama_path, tmp_path / "served"))
    try:
        after = draws()
        standalone = build(tiny_llama_path, tmp_path / "standalone", compile_layers="off")
        try:
            served_lora, standalone_lora = lora_params(served.split.peft_model), lora_params(standalone.split.peft_model)
        finally:
            standalone.close()
    finally:
        served.close()
    assert after == expected  # decode's sequence goes on where it was: not reseeded, nothing drawn twice
    assert any(float(value.abs().max()) > 0 for value in served_lora.values())  # LoRA A is random ...
    assert max_abs_diff(served_lora, standalone_lora) == 0  # ... drawn from the job's seed, as harvest train draws it
    alloc.check_integrity()
