"""The trainer on CUDA (skipped without a GPU): copy stream + events, stream switches.

Not run on the CPU-only build machines; kept small so any GPU machine runs it in seconds.
"""

from __future__ import annotations

import pytest
import torch

from tests.train.trainer_helpers import (build, full_batch, lora_grads, lora_params, max_abs_diff, randomize_lora_b,
                                         reference_peft_model, run_until_optimizer)

pytestmark = pytest.mark.gpu
# These build trainers through LlamaFactory, which the GPU validation image lacks; there the
# trainer on CUDA is covered by tests/test_gpu_scripts.py (assemble_trainer, no LlamaFactory).
pytest.importorskip("llamafactory", reason="LlamaFactory is not installed (GPU validation image)")


@pytest.mark.parametrize("window_stages", ["all", 1])
def test_one_step_on_cuda_matches_plain_peft_on_cpu(window_stages, tiny_llama_path, tmp_path):
    trainer = build(tiny_llama_path, tmp_path / "gpu", harvest={"device": "cuda", "window_stages": window_stages})
    randomize_lora_b(trainer)
    reference = reference_peft_model(trainer, tiny_llama_path, tmp_path / "ref")
    batch = full_batch(trainer, 0)
    output = reference(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"], labels=batch["labels"])
    output.loss.backward()
    run_until_optimizer(trainer)
    grads = {n: g.cpu() for n, g in lora_grads(trainer.split.peft_model).items()}
    assert max_abs_diff(grads, lora_grads(reference)) <= 1e-4
    trainer.run_one_unit()
    assert abs(trainer.stats().loss - float(output.loss.detach())) <= 1e-4
    assert all(p.device.type == "cuda" for p in trainer.trainable_params)


@pytest.mark.timeout(120)
def test_swapping_and_stream_switches_leave_results_unchanged(tiny_llama_path, tmp_path):
    steady = build(tiny_llama_path, tmp_path / "steady", harvest={"device": "cuda"})
    swapped = build(tiny_llama_path, tmp_path / "swapped", harvest={"device": "cuda", "window_stages": 2})
    randomize_lora_b(steady)
    randomize_lora_b(swapped)
    streams = [torch.cuda.Stream(), torch.cuda.Stream()]
    swapped.window.record_copy_timing = True
    index = 0
    while not steady.finished:
        steady.run_one_unit()
    while not swapped.finished:
        swapped.run_one_unit(stream=streams[index % 2])  # as if the gate moved it between SM levels
        index += 1
    torch.cuda.synchronize()
    assert swapped.window.copy_events, "W=2 must have copied stages on the copy stream"
    steady_params = {n: p.cpu() for n, p in lora_params(steady.split.peft_model).items()}
    swapped_params = {n: p.cpu() for n, p in lora_params(swapped.split.peft_model).items()}
    assert max_abs_diff(steady_params, swapped_params) <= 1e-6
