"""The trainer the GPU experiment runs beside the transformers engine
(harvest.engines.transformers.shared_trainer): built without LlamaFactory on the decode
model's own weights, it matches plain PEFT."""

from __future__ import annotations

import pytest

from harvest.engines.transformers.shared_trainer import build_shared_trainer
from tests.engines.helpers import model_on


# "pairs" on CUDA only: a CPU's compiled trainer runs its pairs by default (tests/train cover it).
@pytest.mark.parametrize("device, compile_choice", [("cpu", "auto"), *[
    pytest.param("cuda", choice, marks=pytest.mark.gpu, id=f"cuda-{choice}") for choice in ("auto", "pairs")]])
def test_shared_weight_trainer_matches_plain_peft(tiny_llama_path, device, compile_choice, one_thread):
    """One optimizer step (two micro-batches) gives plain PEFT's LoRA gradients and loss,
    with the decode model's tensors as frozen weights (none copied, none changed); "auto"
    as a server runs it (compiled on CUDA), "pairs" compiled with every layer unit through
    an explicit compiled pair (on CUDA too: colocate_gpu.py --trainer-compile pairs)."""
    import copy

    import torch
    from peft import LoraConfig, get_peft_model

    from harvest.engines.transformers.experiment_modes import trainer_compile_options
    from tests.train.trainer_helpers import full_batch, lora_grads, max_abs_diff, run_until_optimizer

    model = model_on(tiny_llama_path, device)
    before = {name: tensor.detach().clone() for name, tensor in model.state_dict().items()}
    trainer = build_shared_trainer(model, device, lora_rank=4, seq_len=16, samples_per_step=2, micro_batch=1,
                                   **trainer_compile_options(compile_choice))
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
    if compile_choice == "pairs":  # every layer's forward units (one per micro-batch) ran as pairs
        assert [paired.calls for paired in trainer.split.compiled.paired] == [2] * trainer.split.num_layers
        assert trainer.stats().compile["reason"] is None
    trainer.run_one_unit()
    assert trainer.global_step == 1 and abs(trainer.stats().loss - float(output.loss.detach())) <= tolerance
    after = model.state_dict()
    assert all(torch.equal(after[name], value) for name, value in before.items()), "frozen weights changed"
