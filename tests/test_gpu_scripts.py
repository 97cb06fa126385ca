"""The GPU validation scripts, checked where no GPU is (issue 9, docs/gpu-validation.md).

- scripts/gpu_validate.sh parses, is shellcheck-clean, refuses bad arguments, and its
  step runner records failures and keeps going (run here with a fake python);
- scripts/colocate_gpu.py: a short run of every mode on CPU, with sglang and
  llamafactory unimportable (as on the GPU machine), ends with the JSON line the docs
  describe; --graphs on serves through the slot batch (eager on CPU), --kv paged through
  the paged batch; results are written
  as they exist and an interrupt keeps them. The engine pieces it runs (batches, per-level
  graphs, the shared-weight trainer) are tested in tests/engines/, on CUDA too (``gpu``).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
VALIDATE = ROOT / "scripts" / "gpu_validate.sh"
COLOCATE = ROOT / "scripts" / "colocate_gpu.py"
CPU_PROFILE = ROOT / "profiles" / "cpu-tiny-llama-sglang.json"


# -- gpu_validate.sh ---------------------------------------------------------------------
def test_validate_script_parses():
    subprocess.run(["bash", "-n", str(VALIDATE)], check=True)


@pytest.mark.skipif(shutil.which("shellcheck") is None, reason="shellcheck is not installed")
def test_validate_script_is_shellcheck_clean():
    result = subprocess.run(["shellcheck", str(VALIDATE)], capture_output=True, text=True)
    assert result.returncode == 0, result.stdout


@pytest.mark.parametrize("args, message", [([], "gpu_validate.sh OUT_DIR [--part"), (["out", "--part", "gpu"], "--part gpu"),
                                           (["out", "--device", "tpu"], "--device tpu"),
                                           (["out", "--budget-s", "ten"], "--budget-s ten")])
def test_validate_script_refuses_bad_arguments(args, message, tmp_path):
    result = subprocess.run(["bash", str(VALIDATE), *args], capture_output=True, text=True, cwd=tmp_path)
    assert result.returncode == 2
    assert message.lower() in (result.stdout + result.stderr).lower()


def _validate_with_fakes(tmp_path, *args):
    """Run gpu_validate.sh with a python and a cmake that fail at once (exit 3)."""
    fake = tmp_path / "bin"
    fake.mkdir(exist_ok=True)
    for tool in ("python3", "cmake"):
        (fake / tool).write_text(f"#!/bin/sh\necho 'fake {tool}: not here' >&2\nexit 3\n")
        (fake / tool).chmod(0o755)
    env = {**os.environ, "PYTHON": str(fake / "python3"), "PATH": f"{fake}:{os.environ['PATH']}",
           "HARVEST_GPU_BUILD_DIR": str(tmp_path / "native")}
    result = subprocess.run(["bash", str(VALIDATE), *map(str, args)], capture_output=True, text=True, env=env, timeout=60)
    out = Path(args[0])
    rows = [line.split("\t") for line in (out / "steps.tsv").read_text().splitlines()[1:]]
    return result, {row[0]: row for row in rows}


@pytest.mark.timeout(120)
def test_validate_script_records_each_failed_step_and_goes_on(tmp_path):
    out, archive = tmp_path / "out", tmp_path / "run.tar.gz"
    result, rows = _validate_with_fakes(tmp_path, out, "--part", "2", "--device", "cuda", "--archive", archive)
    assert result.returncode == 1, result.stdout + result.stderr
    assert list(rows) == ["build", "doctor", "profile", "bench-predictor", "colocate"]
    for name, row in rows.items():
        assert row[1:3] == ["failed", "3"], row
        assert row[5:8] == ["2", "cuda", {"profile": "d", "bench-predictor": "d", "colocate": "e,f"}.get(name, "-")], row
        assert "not here" in (out / f"{name}.stderr.txt").read_text()
    assert (out / "model" / "llama3-8b" / "config.json").is_file()
    assert json.loads((out / "run.json").read_text())["budget_s"] == 540
    assert archive.is_file() and not (tmp_path / "run.tar.gz.tmp").exists()
    assert not (tmp_path / "native" / "install").exists()


@pytest.mark.timeout(120)
def test_validate_script_skips_steps_that_do_not_fit_the_budget(tmp_path):
    result, rows = _validate_with_fakes(tmp_path, tmp_path / "out", "--part", "1", "--budget-s", "35")
    assert result.returncode == 1
    assert rows["build"][1] == "failed" and rows["doctor"][1] == "failed"  # 15 s left: enough for these
    for name in ("greenctx", "level-graphs", "bench-vmm", "gpu-tests"):  # they need at least 20 to 40 s
        assert rows[name][1].startswith("skipped (budget"), rows[name]
    assert rows["build"][6] == "cpu"  # the fake python has no torch: the CPU rehearsal


def _result_folder(tmp_path, device: str) -> Path:
    """A result folder as a part-1 and part-2 run leave it (figures made up for the test)."""
    out = tmp_path / "out"
    out.mkdir()
    (out / "run.json").write_text(json.dumps({"part": "all", "device": device, "device_reason": "test",
                                              "budget_s": 1080, "profile": "cuda-llama3-8b-transformers.json"}))
    (out / "steps.tsv").write_text(
        "step\tstatus\trc\tseconds\ttimeout_s\tpart\tdevice\tclaims\tstdout\tstderr\n"
        f"build\tok\t0\t12\t60\t1\t{device}\t-\tb.out\tb.err\n"
        f"greenctx\tok\t0\t40\t90\t1\t{device}\tb\tg.out\tg.err\n"
        f"level-graphs\tok\t0\t80\t150\t1\t{device}\tb,c\tl.out\tl.err\n"
        f"bench-vmm\tok\t0\t30\t75\t1\t{device}\ta\tv.out\tv.err\n"
        f"gpu-tests\tfailed\t1\t90\t90\t1\t{device}\ta\tt.out\tt.err\n"
        f"profile\ttimeout (220s)\t124\t220\t220\t2\t{device}\td\tp.out\tp.err\n")
    (out / "bench-vmm.json").write_text(json.dumps({"backend": device if device == "cuda" else "host",
                                                    "lend_us_median": 812.5, "under_load_fault": None}))
    (out / "greenctx.stdout.txt").write_text('noise\nGPU-VALIDATION ladder {"realised": [[24, 108], [132, 0]]}\n'
                                             'GPU-VALIDATION scaling {"ratio": 5.4}\n')
    (out / "gpu-tests.xml").write_text(
        '<testsuites><testsuite><testcase classname="tests.a" name="t1"/><testcase classname="tests.memory.b" name="t2">'
        '<failure message="x"/></testcase><testcase classname="tests.b" name="t3"><skipped message="no GPU"/></testcase>'
        '</testsuite></testsuites>')
    level = {"levels": [{"level": 0, "decode_sms": 24, "trainer_sms": 108, "eager_ms": 30.0, "graph_ms": 28.0,
                         "graph_over_whole_graph": 3.5, "partition_respected": True, "verdict": "keeps to"},
                        {"level": 1, "decode_sms": 132, "trainer_sms": 0, "eager_ms": 10.0, "graph_ms": 8.0}]}
    (out / "level-graphs.json").write_text(json.dumps({"modes": {"level-graphs": {
        "graphs_unavailable": None, "batch_sizes": {"32": level}, "memory_by_level": {"0": {"graphs": 1}}}}}))
    return out


def test_validate_summary_collects_the_figures(tmp_path):
    out = _result_folder(tmp_path, "cuda")
    shutil.copy(CPU_PROFILE, out / "cuda-llama3-8b-transformers.json")
    result = subprocess.run([sys.executable, str(ROOT / "scripts" / "gpu_validate_summary.py"), str(out)],
                            capture_output=True, text=True)
    assert result.returncode == 0, result.stderr
    summary = json.loads((out / "summary.json").read_text())
    assert [s["status"] for s in summary["steps"]][-2:] == ["failed", "timeout (220s)"]
    assert summary["bench_vmm"]["lend_us_median"] == 812.5 and summary["colocate"] is None
    assert summary["gpu_tests"]["counts"] == {"passed": 1, "failure": 1, "skipped": 1}
    assert summary["gpu_tests"]["skip_reasons"] == {"no GPU": 1}
    assert summary["gpu_validation"][0] == {"name": "ladder", "values": {"realised": [[24, 108], [132, 0]]}}
    profile = json.loads(CPU_PROFILE.read_text())
    largest = max((s["batch_size"], s["context_length"]) for s in profile["samples"])
    solo = [s for s in profile["samples"] if s["stage"] == "solo" and (s["batch_size"], s["context_length"]) == largest]
    assert summary["profile"]["decode_step_ms_vs_decode_sms"] == [[1, round(solo[0]["latency_s"] * 1e3, 3)]]
    assert summary["profile"]["stage2_quality"] == profile["stage2"]["combined"]["quality"]
    claims = summary["claims"]
    assert claims["a"]["figures"]["lend_us_median"] == 812.5 and "not_measured" not in claims["a"]
    assert claims["a"]["figures"]["device_allocator_tests_not_passed"] == {"tests.memory.b::t2": "failure"}
    assert [line["name"] for line in claims["b"]["figures"]["spin_kernel"]] == ["ladder", "scaling"]
    assert claims["c"]["figures"]["by_batch_size"]["32"][0]["partition_respected"] is True
    assert "not_measured" not in claims["c"] and "figures" in claims["d"]
    assert claims["e"]["not_measured"] == "step not run in this part"
    assert "(a) measured" in result.stdout and "(e) step not run" in result.stdout


def test_validate_summary_reads_the_lines_as_pytest_s_prints_them(tmp_path):
    """pytest -s writes the file name or the progress dots before a test's print: the
    GPU-VALIDATION lines of a real greenctx step (2026-11-24 H100 and 2026-11-26 H200 runs)
    begin that way, and claim (b)'s spin_kernel came back empty from both."""
    out = _result_folder(tmp_path, "cuda")
    (out / "greenctx.stdout.txt").write_text(
        "collected 7 items\n\n"
        'tests/compute/test_greenctx_gpu.py GPU-VALIDATION ladder {"realised": [[24, 108], [132, 0]]}\n'
        '..GPU-VALIDATION scaling {"whole_gpu_ms": 39.08, "rows": [{"side": "decode", "sms": 24, "ratio": 5.497}]}\n'
        '.GPU-VALIDATION isolation {"decode_solo_ms": 80.64, "decode_beside_trainer_ms": 80.69}\n'
        '.GPU-VALIDATION graph {"eager_ms": 80.69, "replay_ms": 80.71} ...\n'
        ".GPU-VALIDATION broken {not json\n"
        "...\n")
    subprocess.run([sys.executable, str(ROOT / "scripts" / "gpu_validate_summary.py"), str(out)], check=True,
                   capture_output=True)
    summary = json.loads((out / "summary.json").read_text())
    assert [line["name"] for line in summary["gpu_validation"]] == ["ladder", "scaling", "isolation", "graph"]
    assert summary["gpu_validation"][3]["values"] == {"eager_ms": 80.69, "replay_ms": 80.71}
    spin = summary["claims"]["b"]["figures"]["spin_kernel"]
    assert [line["name"] for line in spin] == ["ladder", "scaling", "isolation"]
    assert spin[1]["values"]["whole_gpu_ms"] == 39.08 and spin[1]["values"]["rows"][0]["ratio"] == 5.497
    assert spin[2]["values"] == {"decode_solo_ms": 80.64, "decode_beside_trainer_ms": 80.69}


def test_validate_summary_never_calls_a_cpu_figure_measured(tmp_path):
    out = _result_folder(tmp_path, "cpu")
    level = json.loads((out / "level-graphs.json").read_text())
    level["modes"]["level-graphs"] = {"graphs_unavailable": "CUDA graphs need a CUDA device", "batch_sizes": {
        "2": {"levels": [{"level": 0, "decode_sms": 1, "trainer_sms": 1, "eager_ms": 3.0}]}}}
    (out / "level-graphs.json").write_text(json.dumps(level))
    subprocess.run([sys.executable, str(ROOT / "scripts" / "gpu_validate_summary.py"), str(out)], check=True,
                   capture_output=True)
    claims = json.loads((out / "summary.json").read_text())["claims"]
    assert claims["a"]["not_measured"].startswith("bench-vmm ran the host backend")
    assert "CPU rehearsal (test): not a GPU figure" in claims["b"]["not_measured"]
    assert claims["c"]["not_measured"] == "CUDA graphs need a CUDA device" and "figures" not in claims["c"]
    assert claims["d"]["not_measured"].startswith("no figures in")  # the profile step timed out


def test_llama3_8b_config_has_the_8b_shape(tmp_path):
    """The config gpu_validate.sh writes is Llama-3-8B: 8.03 B parameters."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    text = VALIDATE.read_text()
    config_json = text.split("<<'JSON'\n", 1)[1].split("\nJSON\n", 1)[0]
    (tmp_path / "config.json").write_text(config_json)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(tmp_path))
    assert round(sum(p.numel() for p in model.parameters()) / 1e9, 2) == 8.03


# -- colocate_gpu.py end to end ---------------------------------------------------------------
def _run_colocate(args, timeout=240):
    launcher = ("import runpy, sys; sys.modules.update(sglang=None, llamafactory=None); "
                f"sys.argv = [{str(COLOCATE)!r}] + sys.argv[1:]; runpy.run_path({str(COLOCATE)!r}, run_name='__main__')")
    return subprocess.run([sys.executable, "-c", launcher, *args], capture_output=True, text=True, timeout=timeout,
                          cwd=ROOT)


@pytest.mark.parametrize("args, message", [(["--modes", "harvest,fast"], "--modes: fast"),
                                           (["--modes", "harvest"], "--profile is required"),
                                           (["--kv", "ragged"], "argument --kv: invalid choice: 'ragged'"),
                                           (["--modes", "decode-alone", "--kv", "paged", "--kv-page-size", "12"],
                                            "--kv-page-size: page_size=12: a power of two")])
def test_colocate_refuses_bad_arguments(args, message, tiny_llama_path):
    result = _run_colocate(["--model-path", str(tiny_llama_path), "--device", "cpu", *args])
    assert result.returncode == 2 and message in result.stderr, result.stderr


@pytest.mark.timeout(300)
@pytest.mark.parametrize("flag, value", [("--trainer-micro-batch", "0"), ("--trainer-micro-batch", "some"),
                                         ("--unit-step-fraction", "0"), ("--unit-step-fraction", "1.5"),
                                         ("--levels", "1"), ("--levels", "24,24")])
def test_colocate_refuses_a_bad_unit_size_or_ladder_naming_the_flag(flag, value):
    result = subprocess.run([sys.executable, str(ROOT / "scripts" / "colocate_gpu.py"), "--model-path", "x", flag, value],
                            capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert result.returncode == 2 and f"argument {flag}: {value!r}" in result.stderr, result.stderr[-2000:]


def test_colocate_runs_every_mode_on_cpu(tiny_llama_path, tmp_path):
    from harvest.replay.trace import SAMPLE_TRACE, read_trace

    seconds, time_scale, max_generated = 10.0, 0.2, 24
    requests = [r for r in read_trace(SAMPLE_TRACE) if r.arrival_s < seconds]
    expected_tokens = sum(min(r.generated_tokens, max_generated) - 1 for r in requests)
    steps_out = tmp_path / "steps.json"
    result = _run_colocate([
        "--model-path", str(tiny_llama_path), "--device", "cpu", "--torch-threads", "1", "--profile", str(CPU_PROFILE),
        "--allow-profile-mismatch", "--trace-seconds", str(seconds), "--time-scale", str(time_scale),
        "--max-generated", str(max_generated), "--trainer-alone-s", "1.5", "--lora-rank", "4",
        "--trainer-seq-len", "32", "--trainer-batch", "2", "--trainer-micro-batch", "auto", "--unit-step-fraction",
        "0.5", "--steps-out", str(steps_out)])
    assert result.returncode == 0, result.stderr[-3000:]
    summary = json.loads(result.stdout.strip().splitlines()[-1])
    modes = summary["modes"]
    assert list(modes) == ["decode-alone", "harvest", "static", "trainer-alone"]
    # --trainer-micro-batch auto: the units sized as a server sizes a job's (--unit-step-fraction
    # of --target-tpot-ms on the trainer's smallest partition: on a CPU the one shared level)
    sizing = summary["trainer"]["unit_sizing"]
    assert sizing["target_ms"] == 20.0 and "0.5 of the 40 ms decode step" in sizing["reason"], sizing
    assert sizing["micro_batch_size"] == summary["trainer"]["micro_batch"] in (1, 2) and sizing["measured_ms"] > 0
    assert summary["ladder"] == [[1, 1]] and summary["trace"]["requests"] == len(requests)
    for name in ("decode-alone", "harvest", "static"):
        mode = modes[name]
        assert mode["decode_tokens"] == expected_tokens, name  # every request got all its tokens
        assert 0 < mode["tpot_ms_p50"] <= mode["tpot_ms_p99"] <= mode["tpot_ms_max"]
        assert mode["tpot_ms_p50"] <= mode["itl_ms_p50"] and mode["itl_ms_p50"] <= mode["itl_ms_p99"]
        assert 0.0 <= mode["violation_rate"] <= mode["itl_violation_rate"] <= 1.0
        assert mode["padded_over_real_context"] >= 1.0
    assert modes["decode-alone"]["trainer_tokens_per_s"] is None and modes["decode-alone"]["trainer_step_fraction"] == 0
    # trainer-alone runs until an optimizer step completed; static's trainer is on for every
    # step, but how many steps it completes in ~2 s of serving is the OS's to say.
    assert modes["trainer-alone"]["trainer_tokens_per_s"] > 0 and modes["trainer-alone"]["trainer_steps"] > 0
    static = modes["static"]
    assert static["trainer_step_fraction"] == 1.0
    assert static["trainer_steps"] >= 0 and static["trainer_tokens_per_s"] >= 0
    for name in ("static", "trainer-alone"):
        assert modes[name]["trainer_state"] == "stopped", name
    for name in ("decode-alone", "harvest", "static"):  # --graphs auto: off on CPU
        assert modes[name]["graphs"] is False and "--graphs off" in modes[name]["graphs_reason"], name
    assert modes["harvest"]["qos"]["num_decisions"] == modes["harvest"]["steps"]
    assert modes["harvest"]["trainer_tokens_per_s"] >= 0 and modes["harvest"]["control_us_per_step"] > 0
    assert summary["harvest_trainer_vs_alone"] == pytest.approx(
        modes["harvest"]["trainer_tokens_per_s"] / modes["trainer-alone"]["trainer_tokens_per_s"], rel=1e-3)
    logged = json.loads(steps_out.read_text())
    assert {name: len(rows) for name, rows in logged.items()} == {n: modes[n]["steps"] for n in ("decode-alone", "harvest", "static")}
    assert all(row["itl_s"] >= row["tpot_s"] > 0 for rows in logged.values() for row in rows)


@pytest.mark.timeout(300)
def test_colocate_serves_with_graphs_on_and_falls_back_to_eager_on_cpu(tiny_llama_path, tmp_path):
    """--graphs on: the slot batch serves every request through the graph step, eager on
    CPU (no CUDA graphs), and each serving mode says so."""
    from harvest.replay.trace import SAMPLE_TRACE, read_trace

    seconds, time_scale, max_generated = 6.0, 0.2, 12
    requests = [r for r in read_trace(SAMPLE_TRACE) if r.arrival_s < seconds]
    expected_tokens = sum(min(r.generated_tokens, max_generated) - 1 for r in requests)
    result = _run_colocate([
        "--model-path", str(tiny_llama_path), "--device", "cpu", "--torch-threads", "1", "--graphs", "on",
        "--modes", "decode-alone,harvest", "--profile", str(CPU_PROFILE), "--allow-profile-mismatch",
        "--trace-seconds", str(seconds), "--time-scale", str(time_scale), "--max-generated", str(max_generated),
        "--max-context", "256", "--max-batch-size", "16", "--graph-buckets", "4,8", "--lora-rank", "4",
        "--trainer-seq-len", "32", "--trainer-batch", "2", "--trainer-micro-batch", "1"])
    assert result.returncode == 0, result.stderr[-3000:]
    summary = json.loads(result.stdout.strip().splitlines()[-1])
    assert summary["serving_graphs_on"] is True
    captured = summary["serving_graphs"]
    assert captured["buckets"] == [4, 8, 16] and captured["captured"] == 0 and "CUDA" in captured["unavailable"]
    for name in ("decode-alone", "harvest"):
        mode = summary["modes"][name]
        assert mode["decode_tokens"] == expected_tokens, name
        assert mode["graphs"] is False and mode["graphs_reason"] == captured["unavailable"]
        assert mode["graph_steps"] == 0 and mode["eager_steps"] >= mode["steps"] > 0
        assert "slot batch" in mode["decode_engine"] and set(mode["violation_rate_at"]) == {"target", "tight"}


@pytest.mark.timeout(300)
@pytest.mark.parametrize("graphs", ["on", "off"])
def test_colocate_serves_through_the_paged_batch_on_cpu(tiny_llama_path, graphs):
    """--kv paged: the paged batch serves every request, through the graph step (eager on
    CPU) or eagerly; the load a step reports is each request's pages, not the slots x the
    longest context."""
    from harvest.replay.trace import SAMPLE_TRACE, read_trace

    seconds, time_scale, max_generated = 5.0, 0.2, 12
    requests = [r for r in read_trace(SAMPLE_TRACE) if r.arrival_s < seconds]
    expected_tokens = sum(min(r.generated_tokens, max_generated) - 1 for r in requests)
    result = _run_colocate([
        "--model-path", str(tiny_llama_path), "--device", "cpu", "--torch-threads", "1", "--graphs", graphs,
        "--kv", "paged", "--kv-page-size", "8", "--modes", "decode-alone", "--trace-seconds", str(seconds),
        "--time-scale", str(time_scale), "--max-generated", str(max_generated), "--max-context", "256",
        "--max-batch-size", "16", "--graph-buckets", "4,8"])
    assert result.returncode == 0, result.stderr[-3000:]
    summary = json.loads(result.stdout.strip().splitlines()[-1])
    assert summary["kv"] == {"layout": "paged", "page_size": 8}
    mode = summary["modes"]["decode-alone"]
    assert mode["decode_tokens"] == expected_tokens and mode["graphs"] is False
    assert "paged KV batch (16 slots, " in mode["decode_engine"] and "FlexAttention eager" in mode["decode_engine"]
    assert 1.0 <= mode["padded_over_real_context"] < 1.2  # pages of 8 over contexts of up to 256 tokens
    if graphs == "on":
        assert mode["graph_steps"] == 0 and mode["eager_steps"] >= mode["steps"] > 0
    else:
        assert mode["graphs_reason"] == "--graphs off: the paged batch, eager"


# -- results written as they exist -------------------------------------------------------------
@pytest.mark.timeout(300)
def test_colocate_writes_each_mode_as_it_ends_and_an_interrupt_keeps_what_was_measured(tiny_llama_path, tmp_path):
    import signal
    import time

    out = tmp_path / "out"
    launcher = ("import runpy, sys; sys.modules.update(sglang=None, llamafactory=None); "
                f"sys.argv = [{str(COLOCATE)!r}] + sys.argv[1:]; runpy.run_path({str(COLOCATE)!r}, run_name='__main__')")
    proc = subprocess.Popen(
        [sys.executable, "-c", launcher, "--model-path", str(tiny_llama_path), "--device", "cpu", "--torch-threads", "1",
         "--modes", "decode-alone,trainer-alone", "--trace-seconds", "4", "--time-scale", "0.25", "--max-generated", "8",
         "--trainer-alone-s", "120", "--lora-rank", "4", "--trainer-seq-len", "16", "--trainer-batch", "2",
         "--trainer-micro-batch", "1", "--out-dir", str(out), "--steps-out", str(tmp_path / "steps.json")],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=ROOT)
    try:
        deadline = time.monotonic() + 240
        while not (out / "colocate-decode-alone.json").exists() and time.monotonic() < deadline and proc.poll() is None:
            time.sleep(0.2)
        first = json.loads((out / "colocate-decode-alone.json").read_text())  # written when the mode ended
        assert first["steps"] > 0 and "interrupted" not in first
        assert json.loads((out / "colocate.json").read_text())["complete"] is False  # the summary so far
        assert "decode-alone" in json.loads((tmp_path / "steps.json").read_text())
        time.sleep(3)  # inside the 120 s trainer-alone mode
        proc.send_signal(signal.SIGINT)
        stdout, stderr = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 130, stderr[-3000:]
    cut = json.loads((out / "colocate-trainer-alone.json").read_text())
    assert cut["interrupted"] is True and cut["wall_s"] < 60
    summary = json.loads((out / "colocate.json").read_text())
    assert summary["complete"] is False and summary["interrupted"] is True
    assert set(summary["modes"]) == {"decode-alone", "trainer-alone"}
    assert json.loads(stdout.strip().splitlines()[-1]) == summary


def test_bench_vmm_writes_each_measurement_as_it_has_it(tmp_path):
    """The host backend (the CUDA one runs in gpu_validate.sh's bench-vmm step): lend and
    reclaim under a decode-like reader, and the result file rewritten after each part."""
    out = tmp_path / "bench-vmm.json"
    result = subprocess.run([sys.executable, str(ROOT / "scripts" / "bench_vmm.py"), "--backend", "host", "--num-layers",
                             "2", "--fuzz-ops", "200", "--json", "--out", str(out)], capture_output=True, text=True,
                            timeout=300, cwd=ROOT)
    assert result.returncode == 0, result.stderr[-3000:]
    written = json.loads(out.read_text())
    assert written == json.loads(result.stdout.strip().splitlines()[-1]) and written["complete"] is True
    assert written["under_load_fault"] is None and written["under_load_checksum_ok"] is True
    assert written["under_load_passes"] >= 1 and 0 < written["under_load_busy_fraction"] <= 1


def test_bench_layer_unit_times_eager_units():
    """scripts/bench_layer_unit.py on CPU (the tiny shape, fp32), eager only: the compiled
    variant's comparison is bench_trainer.py's test (the same compile, inside the trainer)."""
    result = subprocess.run([sys.executable, str(ROOT / "scripts" / "bench_layer_unit.py"), "--variants", "eager",
                             "--rounds", "2", "--warmup", "1", "--layers", "2", "--seq-len", "64", "--json"],
                            capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert result.returncode == 0, result.stderr[-3000:]
    report = json.loads(result.stdout.strip().splitlines()[-1])
    eager = report["variants"]["eager"]
    assert report["tokens_per_unit"] == 2 * 64 and report["dtype"] == "float32" and list(report["variants"]) == ["eager"]
    assert eager["lora_grad_rel_diff_vs_eager"] == 0.0 and eager["ops_per_layer_unit"] > 100
    assert eager["host_us_forward_unit"] > 0 and eager["tokens_per_s_model"] > 0


def test_bench_layer_unit_refuses_graphs_without_cuda():
    result = subprocess.run([sys.executable, str(ROOT / "scripts" / "bench_layer_unit.py"), "--variants", "graphs"],
                            capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert result.returncode == 2 and "the graphs variant needs --device cuda" in result.stderr


@pytest.mark.slow
def test_bench_trainer_measures_eager_compiled_and_peft_in_one_run():
    """scripts/bench_trainer.py --model cpu-deep (2 of its 32 layers, one timed step): plain
    PEFT, the eager and the compiled layer-split trainer measured together; compiled
    dispatches fewer operators per layer unit, and its step-1 LoRA gradients equal eager's."""
    result = subprocess.run([sys.executable, str(ROOT / "scripts" / "bench_trainer.py"), "--model", "cpu-deep",
                             "--layers", "2", "--rounds", "1", "--warmup", "0", "--json"],
                            capture_output=True, text=True, timeout=600, cwd=ROOT)
    assert result.returncode == 0, result.stderr[-3000:]
    report = json.loads(result.stdout.strip().splitlines()[-1])
    assert report["model"] == "cpu-deep" and "2 layers" in report["model_shape"]
    for key in ("tokens_per_s_peft", "tokens_per_s_eager", "tokens_per_s_compiled",
                "host_us_per_layer_unit_eager", "host_us_per_layer_unit_compiled"):
        assert report[key] > 0, key
    assert {k: report["compile"][k] for k in ("requested", "layers_compiled", "reason")} == {
        "requested": "on", "layers_compiled": 2, "reason": None}
    assert report["compile"]["units_past_signature_limit"] == 0  # every layer unit ran as a compiled pair
    assert 0 < report["ops_per_layer_compiled"] < report["ops_per_layer_eager"]
    assert report["ops_layer_units"]["layer"] == "layer.1"
    assert report["compiled_grad_max_abs_diff"] <= 1e-5
    assert report["compiles_in_timed_steps"] == 0 and report["compile_s"] is not None
    assert set(report["targets"]) == {"ops_compiled_le_0.3x_eager", "host_us_compiled_le_0.5x_eager",
                                      "compiled_grad_diff_le_1e-5"}
    assert all(isinstance(met, bool) for met in report["targets"].values())
    assert report["targets"]["compiled_grad_diff_le_1e-5"] is True
    # The keys the benchmark reported before the compiled learner: still there.
    assert report["grad_max_abs_diff"] <= 1e-5 and report["loss_abs_diff"] <= 1e-5
    assert report["step_ratio_vs_peft"] > 0 and report["step_ratio_swapping"] > 0
    assert set(report["step_ms_median"]) == {"peft", "all", "compiled", "one"}


def test_bench_trainer_refuses_cuda_without_a_gpu():
    import torch

    if torch.cuda.is_available():
        pytest.skip("a CUDA device is here")
    result = subprocess.run([sys.executable, str(ROOT / "scripts" / "bench_trainer.py"), "--device", "cuda", "--json"],
                            capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert result.returncode == 2, result.stderr[-3000:]
    assert "--device cuda: no CUDA device here" in result.stderr and "Traceback" not in result.stderr


@pytest.mark.parametrize("argv, refusal", [
    (["--model", "cpu-deep", "--dtype", "bfloat16"], "--dtype and --fp32-reference apply to the synthetic models"),
    (["--model", "small-synthetic", "--fp32-reference"], "--fp32-reference compares a bfloat16 run with fp32"),
], ids=["dtype of a checkpoint model", "fp32 reference of an fp32 run"])
def test_bench_trainer_refuses_what_it_cannot_compare(argv, refusal):
    result = subprocess.run([sys.executable, str(ROOT / "scripts" / "bench_trainer.py"), *argv],
                            capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert result.returncode == 2 and refusal in result.stderr and "Traceback" not in result.stderr
