"""Compiled layer units (``trainer.compile``, harvest.train.compiled_units), fp32 on CPU.

- A compiled trainer's step equals the eager trainer's bit for bit (loss, LoRA gradients,
  updated LoRA weights), with the whole model resident and LoRA dropout (masks from
  ATen's generator), and with a one-stage window (every stage swapped in and out, saved
  tensors through the window's hooks); its status says so.
- The CPU backend (harvest.train.eager_numerics) computes RMSNorm and SiLU's backward as
  eager does where plain inductor does not, and never loads plain inductor's artifacts.
- A layer that cannot compile trains eager, with the reason in the status.
- ``auto`` compiles on CUDA only; a bad value is refused naming the setting, in harvest.yaml
  and on ``harvest train``'s command line; YAML's unquoted on/off (booleans) mean on/off.
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

from tests.train.trainer_helpers import build, lora_grads, lora_params, max_abs_diff, randomize_lora_b, run_until_optimizer


pytestmark = pytest.mark.timeout(900)


def _one_step(trainer):
    randomize_lora_b(trainer)
    torch.manual_seed(5)  # the same dropout masks in both trainers
    run_until_optimizer(trainer)
    grads = lora_grads(trainer.split.peft_model)
    trainer.run_one_unit()  # the optimizer unit
    return trainer.stats().loss, grads, lora_params(trainer.split.peft_model)


@pytest.mark.slow
@pytest.mark.parametrize("window_stages, lora_dropout", [("all", 0.1), (1, 0.0)])
def test_a_compiled_step_equals_the_eager_step(window_stages, lora_dropout, tiny_llama_path, tmp_path):
    harvest = {"window_stages": window_stages, "micro_batch_size": 2}
    eager = build(tiny_llama_path, tmp_path / "eager", compile_layers="off", harvest=harvest, lora_dropout=lora_dropout)
    compiled = build(tiny_llama_path, tmp_path / "compiled", compile_layers="on", harvest=harvest,
                     lora_dropout=lora_dropout)
    loss, grads, params = _one_step(eager)
    compiled_loss, compiled_grads, compiled_params = _one_step(compiled)

    # Bit for bit (harvest.train.eager_numerics); the bound is 1e-5.
    assert compiled_loss == loss
    assert max_abs_diff(compiled_grads, grads) == 0.0
    assert max(float(g.abs().max()) for g in grads.values() if g is not None) > 1e-3  # not vacuous
    assert max_abs_diff(compiled_params, params) == 0.0
    layers = compiled.split.num_layers
    status = compiled.stats().compile
    assert status | {"signatures": 0, "compiled_pairs": 0} == {
        "requested": "on", "layers_compiled": layers, "reason": None, "signatures": 0, "compiled_pairs": 0,
        "units_past_signature_limit": 0}  # the pairs' counts: tests/train/test_compiled_pair.py
    assert eager.stats().compile == {"requested": "off", "layers_compiled": 0, "reason": None}
    # The layers really ran compiled: dynamo's wrapper, not the eager call, is in place.
    assert all(layer._compiled_call_impl is not None for layer in compiled.split.decoder.layers)


def _rms_norm_and_swiglu(x, gate, up, weight):
    """RMSNorm (Llama's) and SwiGLU's product: the reductions and SiLU of a decoder layer."""
    variance = x.pow(2).mean(-1, keepdim=True)
    normed = weight * (x * torch.rsqrt(variance + 1e-6))
    return normed, torch.nn.functional.silu(gate) * up


def _values_and_grads(fn, inputs, grads):
    leaves = [t.detach().clone().requires_grad_(True) for t in inputs[:3]]
    outputs = fn(*leaves, inputs[3])
    torch.autograd.backward(outputs, grads)
    return [o.detach() for o in outputs] + [leaf.grad for leaf in leaves]


def test_the_cpu_backend_computes_norms_and_silu_as_eager_where_plain_inductor_does_not(tmp_path, monkeypatch):
    """Bit for bit: RMSNorm's forward and backward (ATen's reductions) and SiLU's backward
    (ATen's fused multiply-add), compiled by harvest's backend right after plain inductor
    compiled the same graph into the same, empty cache (its artifacts must not be reused)."""
    from harvest.train.eager_numerics import backend

    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "inductor"))
    # Set in CI, where inductor refuses to fall back to an ATen op it has a decomposition
    # for: the backend must compile the same with or without it.
    monkeypatch.setenv("CI", "true")
    generator = torch.Generator().manual_seed(0)
    x, gate, up = (torch.randn(2, 64, 64, generator=generator) * 3 for _ in range(3))
    weight = torch.randn(64, generator=generator) * 0.1 + 1
    grads = [torch.randn(2, 64, 64, generator=generator) for _ in range(2)]
    inputs = (x, gate, up, weight)
    eager = _values_and_grads(_rms_norm_and_swiglu, inputs, grads)

    torch._dynamo.reset()
    plain = _values_and_grads(torch.compile(_rms_norm_and_swiglu, backend="inductor"), inputs, grads)
    torch._dynamo.reset()
    ours = _values_and_grads(torch.compile(_rms_norm_and_swiglu, backend=backend()), inputs, grads)
    torch._dynamo.reset()

    names = ["norm", "product", "x.grad", "gate.grad", "up.grad"]
    differing = [name for name, a, b in zip(names, plain, eager) if not torch.equal(a, b)]
    assert {"norm", "x.grad", "gate.grad"} <= set(differing)  # what the backend is for
    assert [name for name, a, b in zip(names, ours, eager) if not torch.equal(a, b)] == []


def test_a_layer_that_cannot_compile_trains_eager_and_says_why(tiny_llama_path, tmp_path):
    def failing_backend(graph_module, example_inputs):
        raise RuntimeError("this backend compiles nothing")

    eager = build(tiny_llama_path, tmp_path / "eager", compile_layers="off")
    trainer = build(tiny_llama_path, tmp_path / "fails", compile_layers="off")
    trainer.split.compile_layers("on", torch.device("cpu"), backend=failing_backend)
    loss, grads, _ = _one_step(eager)
    fallback_loss, fallback_grads, _ = _one_step(trainer)

    assert fallback_loss == loss and max_abs_diff(fallback_grads, grads) == 0.0  # eager, the same step
    status = trainer.stats().compile
    assert status["layers_compiled"] == 0
    assert "could not compile and runs eager" in status["reason"] and "this backend compiles nothing" in status["reason"]
    assert all(layer._compiled_call_impl is None for layer in trainer.split.decoder.layers)


def test_auto_compiles_on_cuda_only_and_unknown_values_are_refused():
    from harvest.train.compiled_units import wants_compile

    assert wants_compile("auto", torch.device("cuda")) and not wants_compile("auto", torch.device("cpu"))
    assert wants_compile("on", torch.device("cpu")) and not wants_compile("off", torch.device("cuda"))
    with pytest.raises(ValueError, match="trainer.compile: 'fast' is not one of auto, on, off"):
        wants_compile("fast", torch.device("cpu"))


def test_tensor_parallel_layers_stay_eager_and_say_why(tiny_llama_path, tmp_path):
    trainer = build(tiny_llama_path, tmp_path / "tp", compile_layers="off")
    state = trainer.split.compile_layers("on", torch.device("cpu"), tensor_parallel=True)
    assert state.layers == 0 and "tensor-parallel layers run eager" in state.reason


@pytest.mark.parametrize("value, expected", [("auto", "auto"), ("on", "on"), ("off", "off"), (True, "on"),
                                             (False, "off")])
def test_harvest_yaml_trainer_compile(value, expected, tmp_path):
    from harvest.config import HarvestConfig, load, parse

    assert parse({"trainer": {"compile": value}}, base_dir=None).trainer.compile == expected
    assert HarvestConfig().trainer.compile == "auto"
    if isinstance(value, str):  # as written in a file: YAML reads an unquoted on/off as a boolean
        (tmp_path / "harvest.yaml").write_text(f"trainer:\n  compile: {value}\n")
        assert load(tmp_path / "harvest.yaml").trainer.compile == expected


@pytest.mark.parametrize("value", ["fast", 1, None])
def test_a_bad_trainer_compile_is_refused_naming_the_setting(value):
    from harvest.config import ConfigError, parse

    with pytest.raises(ConfigError, match=r"trainer\.compile.*auto, on or off"):
        parse({"trainer": {"compile": value}}, base_dir=None)


def test_harvest_train_refuses_a_bad_compile_flag(tmp_path):
    job = tmp_path / "job.yaml"
    job.write_text("model_name_or_path: nowhere\n")
    result = subprocess.run([sys.executable, "-m", "harvest.cli", "train", str(job), "--compile", "fast"],
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 2 and "--compile" in result.stderr and "auto, on or off" in result.stderr


def test_inductor_artifacts_go_to_harvests_cache_unless_the_operator_chose_a_folder(monkeypatch, tmp_path):
    from torch._inductor.runtime.cache_dir_utils import default_cache_dir

    from harvest.train.compiled_units import use_harvest_cache

    monkeypatch.setenv("HARVEST_CACHE_DIR", str(tmp_path / "harvest-cache"))
    for inductors_own in (None, default_cache_dir()):  # unset, or the default inductor wrote there itself
        if inductors_own is None:
            monkeypatch.delenv("TORCHINDUCTOR_CACHE_DIR", raising=False)
        else:
            monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", inductors_own)
        use_harvest_cache()
        assert os.environ["TORCHINDUCTOR_CACHE_DIR"] == str(tmp_path / "harvest-cache" / "torchinductor"
                                                            / torch.__version__)
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "operators"))
    use_harvest_cache()
    assert os.environ["TORCHINDUCTOR_CACHE_DIR"] == str(tmp_path / "operators")
