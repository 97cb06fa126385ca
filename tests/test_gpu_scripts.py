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
    result, rows = _validate_with_fakes(tmp_path, out, "--part", "colocate", "--archive", archive)
    assert result.returncode == 1, result.stdout + result.stderr
    assert list(rows) == ["build", "doctor", "profile", "bench-predictor", "colocate"]
    for name, row in rows.items():
        assert row[1:3] == ["failed", "3"], row
        assert "not here" in (out / f"{name}.stderr.txt").read_text()
    assert (out / "model" / "llama3-8b" / "config.json").is_file()
    assert archive.is_file() and not (tmp_path / "run.tar.gz.tmp").exists()
    assert not (tmp_path / "native" / "install").exists()


@pytest.mark.timeout(120)
def test_validate_script_skips_steps_that_do_not_fit_the_budget(tmp_path):
    result, rows = _validate_with_fakes(tmp_path, tmp_path / "out", "--part", "core", "--budget-s", "50")
    assert result.returncode == 1
    assert rows["build"][1] == "failed" and rows["doctor"][1] == "failed"  # 30 s left: enough for these
    for name in ("gpu-tests", "bench-trainer"):  # they need at least 60 and 120 s
        assert rows[name][1].startswith("skipped (budget"), rows[name]


def test_validate_summary_collects_the_figures(tmp_path):
    """The summary code of gpu_validate.sh on a result folder laid out as a run leaves it."""
    code = VALIDATE.read_text().split("<<'PY' >\"$OUT_DIR/summary.stdout.txt\" 2>&1\n", 1)[1].split("\nPY\n", 1)[0]
    out = tmp_path / "out"
    out.mkdir()
    (out / "steps.tsv").write_text("step\tstatus\trc\tseconds\tstdout\tstderr\nbuild\tok\t0\t12\tb.out\tb.err\n"
                                   "gpu-tests\tfailed\t1\t90\tg.out\tg.err\n")
    (out / "bench-vmm.json").write_text(json.dumps({"lend_us_median": 812.5}))
    (out / "gpu-tests.stdout.txt").write_text('noise\nGPU-VALIDATION ladder {"realised": [[24, 108], [132, 0]]}\n')
    (out / "gpu-tests.xml").write_text(
        '<testsuites><testsuite><testcase classname="tests.a" name="t1"/><testcase classname="tests.a" name="t2">'
        '<failure message="x"/></testcase><testcase classname="tests.b" name="t3"><skipped/></testcase>'
        '</testsuite></testsuites>')
    shutil.copy(CPU_PROFILE, out / "cuda-llama3-8b-transformers.json")
    result = subprocess.run([sys.executable, "-", str(out)], input=code, capture_output=True, text=True)
    assert result.returncode == 0, result.stderr
    summary = json.loads((out / "summary.json").read_text())
    assert [s["status"] for s in summary["steps"]] == ["ok", "failed"]
    assert summary["bench_vmm"] == {"lend_us_median": 812.5} and summary["colocate"] is None
    assert summary["gpu_tests"] == {"counts": {"passed": 1, "failure": 1, "skipped": 1},
                                    "not_passed": {"tests.a::t2": "failure", "tests.b::t3": "skipped"}}
    assert summary["gpu_validation"] == [{"name": "ladder", "values": {"realised": [[24, 108], [132, 0]]}}]
    profile = json.loads(CPU_PROFILE.read_text())
    largest = max((s["batch_size"], s["context_length"]) for s in profile["samples"])
    solo = [s for s in profile["samples"] if s["stage"] == "solo" and (s["batch_size"], s["context_length"]) == largest]
    assert summary["profile"]["decode_step_ms_vs_decode_sms"] == [[1, round(solo[0]["latency_s"] * 1e3, 3)]]
    assert summary["profile"]["stage2_quality"] == profile["stage2"]["combined"]["quality"]


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
    for name in ("static", "trainer-alone"):
        assert modes[name]["trainer_tokens_per_s"] > 0 and modes[name]["trainer_steps"] > 0, name
        assert modes[name]["trainer_state"] == "stopped"
    assert modes["static"]["trainer_step_fraction"] == 1.0
    assert modes["harvest"]["qos"]["num_decisions"] == modes["harvest"]["steps"]
    assert modes["harvest"]["trainer_tokens_per_s"] >= 0 and modes["harvest"]["control_us_per_step"] > 0
    assert summary["harvest_trainer_vs_alone"] == pytest.approx(
        modes["harvest"]["trainer_tokens_per_s"] / modes["trainer-alone"]["trainer_tokens_per_s"], rel=1e-3)
    logged = json.loads(steps_out.read_text())
    assert {name: len(rows) for name, rows in logged.items()} == {n: modes[n]["steps"] for n in ("decode-alone", "harvest", "static")}
    assert all(row["itl_s"] >= row["tpot_s"] > 0 for rows in logged.values() for row in rows)
