"""The GPU validation scripts, checked where no GPU is (issue 9, docs/gpu-validation.md).

- scripts/gpu_validate.sh parses, is shellcheck-clean, refuses bad arguments, and its
  step runner records failures and keeps going (run here with a fake python);
- scripts/colocate_gpu.py: its ragged decode batch gives every request the logits it
  would get decoding alone (joins, left padding, trims on leave); its trainer, built
  without LlamaFactory on the decode model's own weights, matches plain PEFT; and a
  short run of every mode on CPU, with sglang and llamafactory unimportable (as on the
  GPU machine), ends with the JSON line the docs describe.

The trainer and batch checks run on CUDA too (``gpu``), where gpu_validate.sh runs them.
"""

from __future__ import annotations

import importlib.util
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
DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)]


@pytest.fixture(scope="module")
def colocate():
    spec = importlib.util.spec_from_file_location("colocate_gpu", COLOCATE)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up there
    spec.loader.exec_module(module)
    yield module
    sys.modules.pop(spec.name, None)


@pytest.fixture
def one_thread():
    import torch

    saved = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(saved)


def _model(path, device):
    from harvest.predict.profiler.hf_engine import load_causal_lm

    return load_causal_lm(str(path), device, "float32", False).requires_grad_(False)


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


# -- colocate_gpu.py pieces -----------------------------------------------------------------
def _solo_logits(model, prompt, steps, device):
    import torch

    with torch.inference_mode():
        out = model(input_ids=torch.tensor([prompt], device=device), use_cache=True)
        cache, length, rows = out.past_key_values, len(prompt), []
        next_id = out.logits[:, -1].argmax(-1, keepdim=True)
        for _ in range(steps):
            out = model(input_ids=next_id, past_key_values=cache, position_ids=torch.tensor([[length]], device=device),
                        use_cache=True)
            rows.append(out.logits[0, -1].float().cpu())
            next_id, cache, length = out.logits[:, -1].argmax(-1, keepdim=True), out.past_key_values, length + 1
    return rows


@pytest.mark.parametrize("device", DEVICES)
def test_ragged_batch_decodes_each_request_as_if_alone(colocate, tiny_llama_path, device, one_thread):
    import torch

    model = _model(tiny_llama_path, device)
    prompts = {1: [5 + 7 * j % 300 for j in range(5)], 2: [9 + 11 * j % 300 for j in range(9)], 3: [3, 4, 5]}
    batch = colocate.RaggedDecodeBatch(model, device)
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
        reference = _solo_logits(model, prompts[rid], len(rows), device)
        assert torch.allclose(torch.stack(rows), torch.stack(reference), atol=1e-4, rtol=1e-4), rid


@pytest.mark.parametrize("device", DEVICES)
def test_slot_batch_decodes_each_request_as_if_alone(colocate, tiny_llama_path, device, one_thread):
    """The graphs-on serving batch: requests join free slots and leave (the last slots move
    into the holes), steps compute the smallest bucket holding them, and the shared write
    column wraps around its ring twice; every request gets the logits it would decoding
    alone."""
    import torch

    model = _model(tiny_llama_path, device)
    prompts = {1: [5 + 7 * j % 300 for j in range(5)], 2: [9 + 11 * j % 300 for j in range(9)], 3: [3, 4, 5],
               4: [200, 17, 33, 8]}
    batch = colocate.SlotDecodeBatch(model, device, 4, 9, 6, buckets=[1, 2])
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
        reference = _solo_logits(model, prompts[rid], len(rows), device)
        assert torch.allclose(torch.stack(rows), torch.stack(reference), atol=1e-4, rtol=1e-4), rid


@pytest.mark.parametrize("device", DEVICES)
def test_shared_weight_trainer_matches_plain_peft(colocate, tiny_llama_path, device, one_thread):
    """One optimizer step (two micro-batches) gives plain PEFT's LoRA gradients and loss,
    with the decode model's tensors as frozen weights (none copied, none changed)."""
    import copy

    import torch
    from peft import LoraConfig, get_peft_model

    from tests.train.trainer_helpers import full_batch, lora_grads, max_abs_diff, run_until_optimizer

    model = _model(tiny_llama_path, device)
    before = {name: tensor.detach().clone() for name, tensor in model.state_dict().items()}
    trainer = colocate.build_shared_trainer(model, device, lora_rank=4, seq_len=16, samples_per_step=2, micro_batch=1)
    assert trainer.stats().window_bytes == 0
    q_proj = trainer.split.decoder.layers[0].self_attn.q_proj.base_layer.weight
    assert q_proj.data_ptr() == model.model.layers[0].self_attn.q_proj.weight.data_ptr()

    reference = get_peft_model(copy.deepcopy(model).cpu(), LoraConfig(r=4, lora_alpha=8, lora_dropout=0.0,
                                                                       target_modules="all-linear", task_type="CAUSAL_LM"))
    trained = dict(trainer.split.peft_model.named_parameters())
    with torch.no_grad():
        for name, param in reference.named_parameters():
            if param.requires_grad:
                param.copy_(trained[name].cpu())
    batch = full_batch(trainer, 0)
    output = reference(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"], labels=batch["labels"])
    output.loss.backward()
    run_until_optimizer(trainer)
    grads = {name: grad.cpu() for name, grad in lora_grads(trainer.split.peft_model).items()}
    tolerance = 1e-5 if device == "cpu" else 1e-4  # CUDA vs CPU kernels, fp32
    assert max_abs_diff(grads, lora_grads(reference)) <= tolerance
    trainer.run_one_unit()
    assert trainer.global_step == 1 and abs(trainer.stats().loss - float(output.loss.detach())) <= tolerance
    after = model.state_dict()
    assert all(torch.equal(after[name], value) for name, value in before.items()), "frozen weights changed"


# -- colocate_gpu.py end to end ---------------------------------------------------------------
def _run_colocate(args, timeout=240):
    launcher = ("import runpy, sys; sys.modules.update(sglang=None, llamafactory=None); "
                f"sys.argv = [{str(COLOCATE)!r}] + sys.argv[1:]; runpy.run_path({str(COLOCATE)!r}, run_name='__main__')")
    return subprocess.run([sys.executable, "-c", launcher, *args], capture_output=True, text=True, timeout=timeout,
                          cwd=ROOT)


@pytest.mark.parametrize("args, message", [(["--modes", "harvest,fast"], "--modes: fast"),
                                           (["--modes", "harvest"], "--profile is required")])
def test_colocate_refuses_bad_arguments(args, message, tiny_llama_path):
    result = _run_colocate(["--model-path", str(tiny_llama_path), "--device", "cpu", *args])
    assert result.returncode == 2 and message in result.stderr, result.stderr


@pytest.mark.timeout(300)
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
        "--trainer-seq-len", "32", "--trainer-batch", "2", "--trainer-micro-batch", "1", "--steps-out", str(steps_out)])
    assert result.returncode == 0, result.stderr[-3000:]
    summary = json.loads(result.stdout.strip().splitlines()[-1])
    modes = summary["modes"]
    assert list(modes) == ["decode-alone", "harvest", "static", "trainer-alone"]
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


def test_graph_step_replays_the_chosen_levels_graph_for_the_batchs_bucket(colocate, tiny_llama_path, one_thread):
    """With (emulated) graphs captured per (level, bucket) on an empty slot batch, the serving
    step replays the graph of the partitioner's level and the batch's bucket, and decodes
    what the eager step decodes."""
    import torch

    from harvest.ladder import GREEN_CONTEXTS, Ladder, Level

    class Partitioner:
        ladder = Ladder(2, (Level(1, 1), Level(2, 0)), GREEN_CONTEXTS)
        current_index = 1

    model = _model(tiny_llama_path, "cpu")
    prompts = [[5 + 7 * j % 300 for j in range(6)], [9, 8, 7], [4, 4, 4, 4]]
    runs = {}
    for graphs_on in (True, False):
        batch = colocate.SlotDecodeBatch(model, "cpu", 4, 8, 5, buckets=[2])
        graphs = _emulated_graphs()(Partitioner.ladder.levels)
        if graphs_on:
            report = colocate.capture_serving_graphs(batch, graphs, Partitioner.ladder)
            assert report["captured"] == 4 and sorted(graphs.captures) == [(0, 2), (0, 4), (1, 2), (1, 4)]
        step, rows = colocate.GraphStep(batch, graphs, Partitioner()), []
        batch.join([1, 2], [6, 3], prompts=prompts[:2])
        for joining in ([3], []):  # buckets 2, then 4
            for _ in range(2):
                step()
                rows.append(batch.last_logits[:batch.num_requests].clone())
            if joining:
                batch.join(joining, [4], prompts=prompts[2:])
        runs[graphs_on] = rows, step.graph_steps, step.eager_steps
    assert runs[True][1:] == (4, 0) and runs[False][1:] == (0, 4)
    assert all(torch.allclose(a, b, atol=1e-5) for a, b in zip(runs[True][0], runs[False][0]))

# -- per-level CUDA graphs of a static-cache decode step (claim c) ----------------------------
HOST_READS = {"_local_scalar_dense", "nonzero", "masked_select", "_unique2", "unique_dim", "unique_consecutive",
              "repeat_interleave"}


@pytest.mark.parametrize("device", DEVICES)
def test_static_batch_decodes_each_request_as_if_alone(colocate, tiny_llama_path, device, one_thread):
    import torch

    model = _model(tiny_llama_path, device)
    prompts = [[5 + 7 * j % 300 for j in range(6)], [9 + 11 * j % 300 for j in range(6)]]
    batch = colocate.StaticDecodeBatch(model, device, 2, 6, max_steps=3, prompts=prompts)
    seen = []
    for _ in range(5):  # the cache holds 3 new tokens: the fourth step starts over from the context
        batch.run(None, 0, None, graph=False)
        seen.append(batch.last_logits.float().cpu().clone())
    for row, prompt in enumerate(prompts):
        reference = _solo_logits(model, prompt, 3, device)
        got = [seen[0][row], seen[1][row], seen[2][row]]
        assert torch.allclose(torch.stack(got), torch.stack(reference), atol=1e-4, rtol=1e-4), row
    assert batch.length == 8 and batch.steps_left == 1


def test_a_static_decode_step_reads_nothing_back_to_the_host(colocate, tiny_llama_path, one_thread):
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

    batch = colocate.StaticDecodeBatch(_model(tiny_llama_path, "cpu"), "cpu", 3, 8, max_steps=4)
    with HostReads() as mode:
        batch.decode_step()
        batch.decode_step()
    assert mode.seen == []
    slots = colocate.SlotDecodeBatch(batch.model, "cpu", 4, 8, 2, buckets=[2])
    slots.join([1], [5])
    with HostReads() as mode:  # the serving step, both buckets, the write column wrapping round
        for bucket in (2, 4, 2):
            slots.decode_step(bucket)
    assert mode.seen == []
    with HostReads() as mode:  # the detector does see one
        bool(torch.ones(1).any())
    assert mode.seen == ["_local_scalar_dense.default"]


class EmulatedGraphBackend:
    """'Graphs' that re-run the captured step (CPU): the measurement's capture, replay,
    check and report run as on a GPU."""

    unavailable = None

    def __init__(self):
        self.next_run, self.used = None, 0

    def new_pool(self):
        return "pool"

    def new_graph(self):
        return {"run": None}

    def capture(self, graph, stream, pool):
        import contextlib

        graph["run"] = self.next_run
        return contextlib.nullcontext()

    def on_stream(self, stream):
        import contextlib

        return contextlib.nullcontext()

    def wait(self, stream, other):
        pass

    def synchronize(self, stream):
        pass

    def replay(self, graph):
        graph["run"]()

    def memory(self):
        self.used += 1 << 20
        return self.used // 2, self.used


def _emulated_graphs():
    from harvest.compute.level_graphs import LevelGraphs

    class EmulatedGraphs(LevelGraphs):
        def __init__(self, levels):
            super().__init__(levels, EmulatedGraphBackend())

        def capture(self, level, batch_size, run):
            self.backend.next_run = run
            return super().capture(level, batch_size, run)

    return EmulatedGraphs


def test_level_graph_measurement_compares_graph_eager_and_whole_gpu(colocate, tiny_llama_path, monkeypatch, one_thread):
    import argparse

    from harvest.compute import level_graphs
    from harvest.ladder import GREEN_CONTEXTS, Ladder, Level

    class TwoLevels:
        ladder = Ladder(2, (Level(1, 1), Level(2, 0)), GREEN_CONTEXTS)

    monkeypatch.setattr(level_graphs, "LevelGraphs", _emulated_graphs())
    sink = colocate.ResultSink(None, "x")
    ctx = {"partitioner": TwoLevels(), "model": _model(tiny_llama_path, "cpu"), "device_type": "cpu", "device": "cpu",
           "sink": sink}
    args = argparse.Namespace(graph_batch_sizes=[2, 3], graph_context=8, graph_repeats=3, seed=0)
    result = colocate.measure_level_graphs(args, ctx)
    assert result["graphs_unavailable"] is None and "skipped" not in result
    for bs in ("2", "3"):
        partial, whole = result["batch_sizes"][bs]["levels"]
        for row in (partial, whole):
            assert row["eager_ms"] > 0 and row["graph_ms"] > 0 and row["graph_max_abs_diff_vs_eager"] == 0.0
        assert whole["graph_over_whole_graph"] == 1.0 and "verdict" not in whole
        assert partial["partition_respected"] is None or isinstance(partial["partition_respected"], bool)
        assert partial["capture_reserved_bytes"] > 0
    per_level = {"graphs": 2, "allocated_bytes": 2 * (1 << 19), "reserved_bytes": 2 * (1 << 20)}  # 2 batch sizes
    assert result["memory_by_level"] == {"0": per_level, "1": per_level}


@pytest.mark.parametrize("decode_sms, graph, respected, words", [
    (24, 2.07, True, "keeps to"), (104, 1.10, True, "keeps to"), (56, 1.02, False, "escapes"),
    (66, 1.05, False, "escapes"), (104, 1.05, None, "inconclusive")])
def test_graph_verdict(colocate, decode_sms, graph, respected, words):
    """A graph no slower than on the whole GPU ran on every SM: on half the SMs or fewer
    that is an escape; on a larger level a memory-bound step may just not need them."""
    whole = {"eager_ms": 40.0, "graph_ms": 13.0, "decode_sms": 132}
    row = {"eager_ms": 45.0, "graph_ms": 13.0 * graph, "decode_sms": decode_sms}
    verdict = colocate.graph_verdict(row, whole, 132)
    assert verdict[0] is respected and words in verdict[1], verdict


def test_graph_verdict_does_not_lean_on_a_launch_bound_eager_step(colocate):
    """H100, batch 8 of an 8B model: eager 32 ms on the whole GPU against a 13 ms graph, and
    eager no slower on 80 SMs; the graph's own x1.12 decides."""
    whole = {"eager_ms": 32.0, "graph_ms": 12.9, "decode_sms": 132}
    respected, words = colocate.graph_verdict({"eager_ms": 31.0, "graph_ms": 14.5, "decode_sms": 80}, whole, 132)
    assert respected is True and "x1.12" in words and "eager x0.97" in words


@pytest.mark.gpu
def test_each_levels_graph_replays_the_eager_step_on_its_own_stream(colocate, tiny_llama_path):
    """On the GPU: one graph per level of a real ladder, each replayed on its level's
    stream, gives the logits of the eager step (the measurement's correctness half)."""
    import torch

    from harvest.compute import create_partitioner
    from harvest.compute.level_graphs import LevelGraphs

    model = _model(tiny_llama_path, "cuda:0")
    with create_partitioner("cuda:0", levels=4) as partitioner:
        graphs = LevelGraphs(partitioner.ladder.levels)
        batch = colocate.StaticDecodeBatch(model, "cuda:0", 4, 16, max_steps=8)
        for index, level in enumerate(partitioner.ladder.levels):
            with torch.cuda.stream(level.decode_stream):
                batch.reset()
                batch.decode_step()
            level.decode_stream.synchronize()
            eager = batch.last_logits.clone()
            assert graphs.capture(index, 4, batch.decode_step) is not None
            with torch.cuda.stream(level.decode_stream):
                batch.reset()
            assert graphs.replay(index, 4) is True
            level.decode_stream.synchronize()
            assert torch.equal(batch.last_logits, eager), index
        assert set(graphs.memory_by_level()) == set(range(len(partitioner.ladder.levels)))
        graphs.close()


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


@pytest.mark.gpu
def test_profilers_graph_steps_decode_what_eager_static_steps_decode(tiny_llama_path):
    """`harvest profile --graphs on` (the transformers engine): each timed step is the
    captured graph of the grid point's static batch, replayed on the current stream; it
    decodes the tokens the same batch decodes eagerly, and reports the cache it reads."""
    import torch

    from harvest.compute.static_decode import StaticDecodeBatch
    from harvest.predict.profiler.engines import EngineConfig
    from harvest.predict.profiler.hf_engine import TransformersDecodeEngine

    config = EngineConfig(str(tiny_llama_path), "cuda:0", "float32", False, 4, 64, graphs=True, steps_per_point=6)
    engine = TransformersDecodeEngine(config)
    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream):
        engine.prepare(4, 16)
        sums = []
        for _ in range(5):
            sums.append(engine.begin_step())
            engine.step()
        stream.synchronize()
        replayed = engine._static.ids.clone()
        reference = StaticDecodeBatch(engine.model, "cuda:0", 4, 16, max_steps=6, seed=config.seed + 1)
        for _ in range(5):
            reference.decode_step()
        stream.synchronize()
    assert torch.equal(replayed, reference.ids)
    assert sums == [4.0 * (16 + 6)] * 5
    with torch.cuda.stream(stream):
        engine.step()
        with pytest.raises(Exception, match="more than the 6 steps"):
            engine.begin_step()
    engine.close()


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
    assert report["compile"] == {"requested": "on", "layers_compiled": 2, "reason": None}
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
