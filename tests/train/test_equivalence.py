"""The layer-split trainer computes what plain PEFT training computes (fp32, CPU).

One optimizer step on the same batch: same loss, same LoRA gradients (max abs diff
<= 1e-5) and same updated LoRA weights, for Llama and Qwen2, with the whole model resident
(W = all) and with a one-stage window (every stage swapped in and out), and with compiled
decoder layers (``trainer.compile: on``).
"""

from __future__ import annotations

import pytest
import torch

from tests.train.trainer_helpers import (build, full_batch, lora_grads, lora_params, max_abs_diff, randomize_lora_b,
                                         reference_peft_model, run_until_optimizer)

TOLERANCE = 1e-5


def reference_step(model, batch, learning_rate=1e-3, max_grad_norm=1.0):
    """Plain PEFT: one forward + backward over the whole batch, clip, AdamW step."""
    output = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"], labels=batch["labels"])
    output.loss.backward()
    grads = lora_grads(model)
    params = [p for p in model.parameters() if p.requires_grad]
    torch.nn.utils.clip_grad_norm_(params, max_grad_norm)
    torch.optim.AdamW(params, lr=learning_rate, weight_decay=0.0, fused=True).step()
    return float(output.loss.detach()), grads, lora_params(model)


def layer_split_step(trainer):
    run_until_optimizer(trainer)
    grads = lora_grads(trainer.split.peft_model)
    trainer.run_one_unit()  # the optimizer unit
    return trainer.stats().loss, grads, lora_params(trainer.split.peft_model)


@pytest.mark.parametrize("family, window_stages, compile_layers", [
    ("llama", "all", "off"), ("llama", 1, "off"), ("qwen2", "all", "off"), ("qwen2", 1, "off"),
    # Compiled layers (the Llama ones compare with eager in test_compiled_units).
    pytest.param("qwen2", 1, "on", marks=pytest.mark.slow)])
def test_one_step_matches_plain_peft(family, window_stages, compile_layers, tiny_llama_path, tiny_qwen2_path,
                                     tmp_path):
    model_path = tiny_llama_path if family == "llama" else tiny_qwen2_path
    harvest = {"window_stages": window_stages, "micro_batch_size": 2}
    trainer = build(model_path, tmp_path / "split", compile_layers=compile_layers, harvest=harvest)
    randomize_lora_b(trainer)
    reference = reference_peft_model(trainer, model_path, tmp_path / "ref")
    batch = full_batch(trainer, 0)

    ref_loss, ref_grads, ref_params = reference_step(reference, batch)
    loss, grads, params = layer_split_step(trainer)

    assert abs(loss - ref_loss) <= TOLERANCE
    assert max_abs_diff(grads, ref_grads) <= TOLERANCE
    assert max(float(g.abs().max()) for g in grads.values() if g is not None) > 1e-3  # not vacuous
    assert max_abs_diff(params, ref_params) <= TOLERANCE
    if window_stages == 1:
        stats = trainer.stats()
        assert stats.window_stages == 1
        assert len(trainer.window.resident_stages()) == 1
        # Every stage was loaded at least once per pass, forward and backward.
        assert trainer.window.num_loads >= 2 * trainer.split.num_stages
        assert stats.window_bytes in trainer.window.stage_bytes()


@pytest.mark.parametrize("micro_batch_size, microbatches_per_pass", [(1, 1), (3, 1), (1, 2)])
def test_gradient_accumulation_matches_full_batch(micro_batch_size, microbatches_per_pass, tiny_llama_path, tmp_path):
    # 2 x 2 samples per step; micro-batches of 1 (4 of them) or 3 (a 3 and a 1), passes of
    # one or two micro-batches: all must give the full batch's gradient.
    harvest = {"micro_batch_size": micro_batch_size, "microbatches_per_pass": microbatches_per_pass,
               "window_stages": 2}
    trainer = build(tiny_llama_path, tmp_path / "split", harvest=harvest)
    randomize_lora_b(trainer)
    reference = reference_peft_model(trainer, tiny_llama_path, tmp_path / "ref")
    ref_loss, ref_grads, _ = reference_step(reference, full_batch(trainer, 0))

    run_until_optimizer(trainer)
    assert len(trainer._step.micro_batches) == -(-4 // micro_batch_size)
    grads = lora_grads(trainer.split.peft_model)
    trainer.run_one_unit()
    assert abs(trainer.stats().loss - ref_loss) <= TOLERANCE
    assert max_abs_diff(grads, ref_grads) <= TOLERANCE


def test_same_base_model_mode_uses_provided_tensors(tiny_llama_path, tmp_path):
    """Frozen weights taken from existing tensors (the serving engine's) instead of a copy."""
    from transformers import AutoModelForCausalLM

    from harvest.train.build import build_trainer
    from harvest.train.job import load_job
    from harvest.train.weights import SharedTensorWeightSource
    from tests.train.trainer_helpers import job_dict

    served = AutoModelForCausalLM.from_pretrained(tiny_llama_path, dtype=torch.float32)
    served_tensors = {name: t for name, t in served.state_dict().items()}
    job = load_job(job_dict(tiny_llama_path, tmp_path / "shared"))
    shared = build_trainer(job, weight_source=SharedTensorWeightSource(served_tensors))
    copied = build(tiny_llama_path, tmp_path / "copied")
    randomize_lora_b(shared)
    randomize_lora_b(copied)

    run_until_optimizer(shared)
    run_until_optimizer(copied)
    assert max_abs_diff(lora_grads(shared.split.peft_model), lora_grads(copied.split.peft_model)) <= TOLERANCE
    assert shared.stats().window_bytes == 0 and shared.window.num_loads == 0
    q_proj = shared.split.decoder.layers[0].self_attn.q_proj.base_layer.weight
    assert q_proj.data_ptr() == served_tensors["model.layers.0.self_attn.q_proj.weight"].data_ptr()


def test_weight_source_mismatch_is_named(tiny_llama_path, tmp_path):
    from transformers import AutoModelForCausalLM

    from harvest.train.build import build_trainer
    from harvest.train.errors import WeightSourceError
    from harvest.train.job import load_job
    from harvest.train.weights import SharedTensorWeightSource
    from tests.train.trainer_helpers import job_dict

    tensors = dict(AutoModelForCausalLM.from_pretrained(tiny_llama_path, dtype=torch.float32).state_dict())
    del tensors["model.layers.1.mlp.up_proj.weight"]
    job = load_job(job_dict(tiny_llama_path, tmp_path / "out"))
    with pytest.raises(WeightSourceError, match="model.layers.1.mlp.up_proj.weight"):
        build_trainer(job, weight_source=SharedTensorWeightSource(tensors))


def test_in_memory_model_with_tied_embeddings(tmp_path):
    """assemble_trainer without LlamaFactory (the path a serving process or the GPU bench
    uses), on a Qwen2 with tied input/output embeddings: each stage gets its own window
    copy of the shared matrix, and the step still matches plain PEFT."""
    from peft import LoraConfig, get_peft_model
    from transformers import Qwen2Config, Qwen2ForCausalLM

    from harvest.train.build import TrainerSettings, assemble_trainer
    from harvest.train.job import HarvestOptions

    config = Qwen2Config(vocab_size=300, hidden_size=32, intermediate_size=64, num_hidden_layers=3,
                         num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=True)

    def peft_model():
        torch.manual_seed(0)
        base = Qwen2ForCausalLM(config).float()
        lora = LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj", "down_proj"], task_type="CAUSAL_LM")
        model = get_peft_model(base, lora)
        generator = torch.Generator().manual_seed(1)
        with torch.no_grad():
            for name, param in model.named_parameters():
                if "lora_B" in name:
                    param.normal_(0, 0.05, generator=generator)
        return model

    ids = torch.randint(0, 300, (4, 12), generator=torch.Generator().manual_seed(2))
    dataset = [{"input_ids": row, "attention_mask": torch.ones_like(row), "labels": row} for row in ids]

    def collate(features):
        return {key: torch.stack([f[key] for f in features]) for key in ("input_ids", "attention_mask", "labels")}

    reference = peft_model()
    assert reference.get_base_model().lm_head.weight is reference.get_base_model().model.embed_tokens.weight
    batch = collate(dataset)
    loss = reference(**batch).loss
    loss.backward()
    settings = TrainerSettings(samples_per_step=4, learning_rate=1e-3, max_steps=1, output_dir=None)
    for window_stages in (None, 1):
        trainer = assemble_trainer(peft_model(), dataset, collate, settings,
                                   HarvestOptions(micro_batch_size=2, window_stages=window_stages), device="cpu")
        trainer.batches.shuffle = False
        run_until_optimizer(trainer)
        assert max_abs_diff(lora_grads(trainer.split.peft_model), lora_grads(reference)) <= TOLERANCE
        trainer.run_one_unit()
        assert abs(trainer.stats().loss - float(loss.detach())) <= TOLERANCE
