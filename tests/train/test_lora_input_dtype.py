"""Under bf16 autocast the trainer turns off PEFT's fp32 cast of LoRA inputs
(harvest.train.build.keep_lora_inputs_in_compute_dtype): the gradients are bit for bit
those with the cast, with fewer operators per unit; with LoRA dropout the cast stays."""

from __future__ import annotations

import torch

from tests.train.trainer_helpers import build, lora_grads, randomize_lora_b, run_until_optimizer


def _lora_layers(trainer):
    from peft.tuners.tuners_utils import BaseTunerLayer

    return [m for m in trainer.split.peft_model.modules() if isinstance(m, BaseTunerLayer)]


def _grads_and_ops(trainer):
    randomize_lora_b(trainer)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as profile:
        run_until_optimizer(trainer)
    casts = sum(1 for event in profile.events() if event.name == "aten::_to_copy")
    return lora_grads(trainer.split.peft_model), casts


def test_lora_inputs_stay_in_the_compute_dtype_under_autocast_with_the_same_gradients(tiny_llama_path, tmp_path):
    job = dict(bf16=True, harvest={"micro_batch_size": 2})
    without_cast = build(tiny_llama_path, tmp_path / "a", compile_layers="off", **job)
    with_cast = build(tiny_llama_path, tmp_path / "b", compile_layers="off", **job)
    assert without_cast.autocast_dtype == torch.bfloat16
    layers = _lora_layers(with_cast)
    assert layers and not any(layer.cast_input_dtype_enabled for layer in _lora_layers(without_cast))
    for layer in layers:
        layer.cast_input_dtype_enabled = True  # PEFT's default

    grads, casts = _grads_and_ops(without_cast)
    reference, reference_casts = _grads_and_ops(with_cast)
    assert grads.keys() == reference.keys()
    for name, grad in grads.items():
        assert torch.equal(grad, reference[name]), name
    assert max(float(g.abs().max()) for g in grads.values()) > 0  # not vacuous
    assert casts < reference_casts, (casts, reference_casts)


def test_the_cast_stays_with_lora_dropout_and_without_autocast(tiny_llama_path, tmp_path):
    dropout = build(tiny_llama_path, tmp_path / "a", compile_layers="off", bf16=True, lora_dropout=0.1)
    assert all(layer.cast_input_dtype_enabled for layer in _lora_layers(dropout))
    fp32 = build(tiny_llama_path, tmp_path / "b", compile_layers="off")
    assert fp32.autocast_dtype is None
    assert all(layer.cast_input_dtype_enabled for layer in _lora_layers(fp32))
