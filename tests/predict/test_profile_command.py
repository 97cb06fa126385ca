"""`harvest profile` end to end on CPU: SGLang's ModelRunner on the tiny model (one level),
the transformers engine with an interrupted and resumed run, and argument errors."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest

from harvest import cli
from harvest.predict.profiler.partial import partial_path
from harvest.predict.schema import Profile

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"
SMALL_GRID = ["--batch-sizes", "1,2,4", "--context-lengths", "16,64", "--warmup", "1", "--torch-threads", "1", "--trainer-alone-s", "0.3"]


def _profile_cmd(out, *extra) -> list[str]:
    return [sys.executable, "-m", "harvest.cli", "profile", "--model-path", "tiny-llama", *SMALL_GRID, "--out", str(out), *extra]


def _counted_units(record) -> bool:
    """A co-run point counted the trainer's units over a wall window. How many end inside
    it is not asserted: the windows here are a few ms of tiny-model steps, and whether
    the niced trainer thread gets the CPU in them is the OS's choice on a loaded host
    (``start`` proved it runs: it returns after the first unit). test_profiler_loop counts
    them with a scripted engine that waits for a unit in each window."""
    return record.trainer_units is not None and record.trainer_window_s > 0


def _check_profile(out, engine: str) -> Profile:
    profile = Profile.load(out)  # validates every field
    prov = profile.provenance
    assert prov.engine == engine and prov.device_kind == "cpu" and prov.finetune.workload == "peft-lora"
    assert prov.measurement.timer == "perf_counter_ns" and prov.measurement.torch_threads == 1
    assert profile.ladder.num_levels == 1 and profile.ladder.realisation == "whole-device"
    assert len([r for r in profile.samples if r.stage == "solo"]) == 6
    assert {r.phase for r in profile.samples if r.stage == "corun"} == {"forward", "backward"}
    assert len(profile.samples) == 18
    assert all(_counted_units(r) for r in profile.samples if r.stage == "corun")
    trainer = profile.trainer  # the trainer alone on the one shared level, i.e. the whole device, per phase
    assert trainer is not None and trainer.whole_device_level == 0 and trainer.seconds_per_phase == 0.3
    assert [(r.level, r.phase) for r in trainer.alone] == [(0, "forward"), (0, "backward")]
    assert all(r.units > 0 and r.seconds >= 0.3 for r in trainer.alone)
    assert trainer.tokens_per_unit == 2 * 128 / 2  # default micro-batch 2 x 128 tokens over a forward + a backward unit
    assert prov.finetune.micro_batch_tokens == 2 * 128  # what the server compares its jobs' micro-batches with
    assert profile.profiled_range.min_batch_size == 1 and profile.profiled_range.max_batch_size == 4
    report = out.with_suffix(".png")
    assert report.read_bytes()[:8] == PNG_MAGIC and report.stat().st_size > 10_000
    assert not partial_path(out).exists()
    predictor = profile.predictor()
    assert predictor.predict_colo(0, 2, 100.0) > 0 and predictor.predict_solo(0, 2, 100.0) > 0
    memory = profile.memory  # lend/reclaim timed on the host backend: the tiny model's chunk of 2 layers x K, V x 64 KiB
    assert memory is not None and memory.chunk_bytes == 4 * 64 * 1024 and memory.pages_per_chunk == 4
    assert memory.lend_ms_per_chunk > 0 and memory.reclaim_ms_per_chunk > 0
    return profile


@pytest.mark.sglang
@pytest.mark.slow
@pytest.mark.timeout(600)
def test_profile_with_sglang_model_runner_writes_a_valid_profile_and_png(tmp_path, tiny_llama_path):
    out = tmp_path / "cpu-tiny.json"
    result = subprocess.run(_profile_cmd(out, "--repeats", "5"), capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-5000:]
    profile = _check_profile(out, "sglang")
    assert profile.provenance.sglang_version == "0.5.23"
    assert profile.batch_size_buckets == ()  # CPU: no CUDA graphs, no padding
    assert "fit quality (sglang engine" in result.stdout and "stage 2, combined" in result.stdout
    assert f"wrote {out}" in result.stdout


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_interrupted_transformers_run_resumes_and_finishes(tmp_path, tiny_llama_path):
    out = tmp_path / "hf.json"
    cmd = _profile_cmd(out, "--engine", "transformers", "--repeats", "60")
    process = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    partial = partial_path(out)
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline and process.poll() is None:
        if partial.exists() and len(partial.read_text().splitlines()) >= 3:  # header + 2 grid points
            break
        time.sleep(0.05)
    assert process.poll() is None, "the run finished before it could be interrupted"
    process.send_signal(signal.SIGINT)
    stdout, stderr = process.communicate(timeout=120)
    assert process.returncode == 130, stderr[-3000:]
    assert "run the same command again to resume" in stderr
    saved = len(partial.read_text().splitlines()) - 1
    assert 2 <= saved < 18 and not out.exists()

    result = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-5000:]
    assert f"resuming: {saved} grid points already measured" in result.stdout
    _check_profile(out, "transformers")


def test_partial_run_with_other_settings_is_refused_before_loading_models(tmp_path, tiny_llama_path, capsys):
    out = tmp_path / "p.json"
    partial_path(out).write_text('{"device": "another machine"}\n')
    code = cli.main(["profile", "--model-path", str(tiny_llama_path), "--engine", "transformers", "--out", str(out), "--repeats", "2"])
    err = capsys.readouterr().err
    assert code == 1 and "different settings" in err and "--restart" in err and "device" in err


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--batch-sizes", "4,x"], "expected comma-separated integers"),
        (["--context-lengths", "64,64"], "distinct integers > 0"),
        (["--trim", "0.6"], "--trim=0.6: must be in [0, 0.5)"),
        (["--repeats", "0"], "--repeats=0: must be >= 1"),
        (["--torch-threads", "0"], "--torch-threads=0: must be > 0"),
        (["--trainer-alone-s", "0"], "--trainer-alone-s=0.0: must be a finite number of seconds > 0"),
        (["--trainer-alone-s", "nan"], "--trainer-alone-s=nan: must be"),
        (["--model-path", "/nonexistent/model"], "no config.json there"),
        (["--batch-sizes", "16"], "at least 2 --batch-sizes and 2 --context-lengths"),
        (["--tp", "0"], "--tp=0: must be >= 1"),
        (["--graphs", "on", "--engine", "transformers", "--device", "cpu"],
         "--graphs on: decode CUDA graphs need a CUDA device (--device cpu: none here)"),
        (["--graphs", "sometimes"], "invalid choice: 'sometimes'"),
        (["--kv", "pages"], "argument --kv: invalid choice: 'pages'"),
        (["--kv", "paged", "--engine", "sglang"], "--kv paged: for --engine transformers (the sglang engine pages its own"),
        (["--kv", "paged", "--engine", "transformers", "--kv-page-size", "12"], "--kv-page-size: page_size=12: a power of two"),
        (["--tp", "2", "--engine", "transformers"],
         "--tp 2: the transformers engine decodes in one process and cannot shard the model; use --engine sglang"),
        (["--levels", "0"], "argument --levels: '0': ask for 2 to 8 levels (one is always the whole device)\n"),
        (["--levels", "1"], "argument --levels: '1': ask for 2 to 8 levels"),
        (["--levels", "9"], "argument --levels: '9': ask for 2 to 8 levels"),
        (["--levels", "-3"], "argument --levels: '-3': ask for 2 to 8 levels"),
        (["--levels", "many"], "argument --levels: 'many': a number of levels, or decode SM counts such as 24,40,56"),
        (["--levels", "24,40,24"], "argument --levels: '24,40,24': decode SM counts are distinct integers >= 1"),
        (["--levels", "24,0"], "argument --levels: '24,0': decode SM counts are distinct integers >= 1"),
        (["--levels", "8,16,24,32,40,48,56,64,72"], "'8,16,24,32,40,48,56,64,72': at most 8 levels"),
    ],
)
def test_bad_arguments_are_refused_with_the_flag_named(argv, message, capsys, tmp_path):
    full = ["profile", "--model-path", str(tmp_path), *argv] if "--model-path" not in argv else ["profile", *argv]
    if "--model-path" not in argv:
        (tmp_path / "config.json").write_text("{}")
    try:
        code = cli.main(full)
    except SystemExit as exc:  # argparse type errors exit 2
        code = exc.code
    assert code == 2
    assert message in capsys.readouterr().err


def test_levels_the_device_cannot_have_are_said_plainly():
    from harvest.compute.ladder_planning import plan_ladder
    from harvest.compute.partitioner import WholeDevicePartitioner
    from harvest.predict.profiler.session import levels_note

    cpu = WholeDevicePartitioner("cpu").ladder
    assert levels_note(None, cpu) is None and levels_note(1, cpu) is None
    assert levels_note(5, cpu) == ("--levels 5 does not apply to this device: no SM partitioning (CPU device); the "
                                   "profile has one level, decode and the trainer sharing the whole device")
    small = plan_ladder(10, (8, 0), levels=8)  # 10 SMs: decode 4 or 6 leave the trainer its 4, plus the whole device
    assert small.num_levels == 3
    assert levels_note(8, small).startswith("--levels 8: this device realises 3 distinct levels (green-context ladder")
    assert levels_note(3, small) is None
    # decode SM counts, as harvest.yaml's `ladder` gives them (the whole device's may be left out)
    assert levels_note((6, 4), small) is None and levels_note((10, 6, 4), small) is None
    assert levels_note((6,), small) == f"--levels 6: this device realises other levels ({small.describe()})"
    assert levels_note((24, 40), cpu).startswith("--levels 24,40 does not apply to this device: no SM partitioning")


def test_more_ranks_than_cpu_cores_are_refused_before_any_model_loads(tmp_path, tiny_llama_path, capsys, monkeypatch):
    from harvest.predict.profiler import tp_layout

    monkeypatch.setattr(tp_layout, "usable_cpus", lambda: [3])
    monkeypatch.delenv(tp_layout.THREADS_BIND_VAR, raising=False)
    code = cli.main(["profile", "--model-path", str(tiny_llama_path), "--engine", "sglang", "--device", "cpu", "--tp", "2",
                     "--out", str(tmp_path / "p.json")])
    err = capsys.readouterr().err
    assert code == 1 and "--tp 2: needs at least 2 CPU cores (one per rank), this process may use 1 (3," in err
    assert not partial_path(tmp_path / "p.json").exists()


def _two_cores_or_skip() -> None:
    from harvest.predict.profiler.tp_layout import usable_cpus

    if len(usable_cpus()) < 2:
        pytest.skip("--tp 2 on a CPU needs 2 usable cores")


@pytest.mark.sglang
@pytest.mark.slow
@pytest.mark.timeout(600)
def test_profile_at_tp_2_runs_two_sglang_ranks_and_records_the_degree(tmp_path, tiny_llama_path):
    _two_cores_or_skip()
    out = tmp_path / "cpu-tiny-tp2.json"
    env = {k: v for k, v in os.environ.items() if k != "SGLANG_CPU_OMP_THREADS_BIND"}  # harvest splits the cores
    result = subprocess.run(_profile_cmd(out, "--repeats", "3", "--tp", "2"), capture_output=True, text=True, timeout=600, env=env)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-5000:]
    assert "tensor parallel: 2 ranks on cores " in result.stdout
    assert "(TP rank 1 of 2)" in result.stderr  # the follower process built its own ModelRunner
    profile = _check_profile(out, "sglang")
    assert profile.provenance.tp_size == 2 and profile.schema_version == 3
    assert "--tp 2" in profile.provenance.command_line


@pytest.mark.sglang
@pytest.mark.slow
@pytest.mark.timeout(300)
def test_a_rank_that_fails_while_starting_is_named_instead_of_hanging(tiny_llama_path):
    """Rank 1 cannot take its cores and dies before SGLang's rendezvous, which would wait
    30 minutes for it; rank 0 must refuse at once, naming it."""
    _two_cores_or_skip()
    script = (
        "import os\n"
        "os.environ['SGLANG_CPU_OMP_THREADS_BIND'] = '0|1'\n"
        "from harvest.predict.profiler.engines import EngineConfig, EngineError\n"
        "from harvest.predict.profiler.sglang_engine import SglangDecodeEngine\n"
        f"config = EngineConfig({str(tiny_llama_path)!r}, 'cpu', 'float32', False, 4, 128, 0, 2, ((0,), (1 << 20,)))\n"
        "try:\n"
        "    SglangDecodeEngine(config)\n"
        "except EngineError as exc:\n"
        "    print('REFUSED', str(exc).splitlines()[0])\n"
    )
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=280)
    assert "REFUSED SGLang's tensor-parallel start-up failed: TP rank 1 failed: OSError" in result.stdout, result.stderr[-3000:]


def test_profile_command_is_registered_and_cheap_to_import():
    assert cli.COMMANDS["profile"] == "harvest.predict.profiler.command"
    out = subprocess.run(
        [sys.executable, "-c", "import sys, harvest.predict.profiler.command; print(sorted(m for m in ('torch', 'sglang', 'sklearn', 'numpy') if m in sys.modules))"],
        capture_output=True, text=True, timeout=60, env={**os.environ},
    )
    assert out.returncode == 0 and out.stdout.strip() == "[]", out.stderr


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_co_run_with_harvest_layer_split_trainer(tmp_path, tiny_llama_path):
    from tests.train.trainer_helpers import DATA_DIR

    job = tmp_path / "job.yaml"
    job.write_text(
        f"model_name_or_path: {tiny_llama_path}\ntemplate: default\ndataset: tiny_alpaca\ndataset_dir: {DATA_DIR}\n"
        f"lora_rank: 4\nlora_alpha: 8\nlora_target: all\ncutoff_len: 64\nper_device_train_batch_size: 2\n"
        f"max_steps: 2\noutput_dir: {tmp_path / 'job-out'}\nseed: 0\nharvest:\n  micro_batch_size: 2\n"
    )
    out = tmp_path / "trainer.json"
    cmd = _profile_cmd(out, "--engine", "transformers", "--repeats", "4", "--finetune-job", str(job))
    result = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-5000:]
    profile = Profile.load(out)
    finetune = profile.provenance.finetune
    assert finetune.workload == "harvest-trainer" and "layer-split trainer" in finetune.description
    assert finetune.base_model == str(tiny_llama_path)
    corun = [r for r in profile.samples if r.stage == "corun"]
    assert {r.phase for r in corun} == {"mixed"} and all(_counted_units(r) for r in corun)
    assert profile.stage2.by_phase == {} and not profile.stage2.use_phase_models
    assert not (tmp_path / "job-out").exists()  # profiling ran the job in a scratch directory
    assert [r.phase for r in profile.trainer.alone] == ["mixed"] and profile.trainer.alone[0].units > 0
    # Units are stages of a micro-batch (forward and backward) and optimizer updates: far fewer tokens than a micro-batch each.
    assert 0 < profile.trainer.tokens_per_unit < 2 * 64
    # Measured from the micro-batches it ran: more tokens than any one unit carries.
    assert profile.trainer.tokens_per_unit < finetune.micro_batch_tokens
