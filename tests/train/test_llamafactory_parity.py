"""`harvest train` trains what `llamafactory-cli train` trains, on the same YAML.

A Qwen2-style tiny model, `lora_target: q_proj,v_proj`, gradient accumulation 2, a cosine
schedule with warmup, weight decay, clipping and `disable_shuffling: true`: LlamaFactory's
own CLI (the Hugging Face Trainer) in a subprocess against harvest's layer-split trainer in
this process. Per-step losses and learning rates, and the final adapter, agree to 1e-5 —
with micro-batches equal to LlamaFactory's (2 samples) and with a different split (1).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from tests.train.trainer_helpers import DATA_DIR

TOLERANCE = 1e-5


def parity_job(model: Path, output_dir: Path, **overrides) -> dict:
    return dict(
        model_name_or_path=str(model), stage="sft", do_train=True, finetuning_type="lora", lora_target="q_proj,v_proj",
        lora_rank=4, lora_alpha=8, template="default", dataset="tiny_alpaca", dataset_dir=str(DATA_DIR),
        cutoff_len=64, per_device_train_batch_size=2, gradient_accumulation_steps=2, learning_rate=5e-3,
        lr_scheduler_type="cosine", warmup_steps=2, weight_decay=0.01, max_grad_norm=1.0, disable_shuffling=True,
        logging_steps=1, max_steps=6, save_steps=100, report_to="none", seed=3, output_dir=str(output_dir),
        overwrite_output_dir=True,
    ) | overrides


def llamafactory_cli_run(model: Path, work: Path, **overrides) -> tuple[list[dict], dict]:
    job = work / "llamafactory.yaml"
    job.write_text(yaml.safe_dump(parity_job(model, work / "llamafactory", **overrides)))
    cli = shutil.which("llamafactory-cli", path=str(Path(sys.executable).parent)) or "llamafactory-cli"
    env = {**os.environ, "DISABLE_VERSION_CHECK": "1", "CUDA_VISIBLE_DEVICES": "", "OMP_NUM_THREADS": "1",
           "HF_HUB_OFFLINE": "1", "WANDB_DISABLED": "true"}
    done = subprocess.run([cli, "train", str(job)], cwd=work, env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    state = json.loads((work / "llamafactory" / "trainer_state.json").read_text())
    steps = [entry for entry in state["log_history"] if "loss" in entry]
    return steps, _adapter(work / "llamafactory")


def harvest_run(model: Path, work: Path, micro_batch_size: int | None, on_trainer=None,
                **overrides) -> tuple[list[dict], dict]:
    """``micro_batch_size`` None: left to the trainer (auto); ``on_trainer`` sees the built trainer."""
    from harvest.train.build import build_trainer
    from harvest.train.gate import Gate
    from harvest.train.job import load_job

    out = work / f"harvest-mb{micro_batch_size}"
    options = {"device": "cpu"} | ({"micro_batch_size": micro_batch_size} if micro_batch_size is not None else {})
    job = {**parity_job(model, out, **overrides), "harvest": options}
    trainer = build_trainer(load_job(job))
    if on_trainer is not None:
        on_trainer(trainer)
    entries: list[dict] = []
    trainer.step_callbacks.append(entries.append)
    assert trainer.run(Gate()) == "finished"
    trainer.close()
    return entries, _adapter(out)


def _adapter(output_dir: Path) -> dict:
    from safetensors.torch import load_file

    return load_file(str(output_dir / "adapter_model.safetensors"))


@pytest.fixture(scope="module")
def llamafactory_reference(tmp_path_factory, tiny_qwen2_path):
    work = tmp_path_factory.mktemp("llamafactory-cli")
    return llamafactory_cli_run(Path(tiny_qwen2_path), work)


@pytest.mark.slow
@pytest.mark.timeout(900)
@pytest.mark.parametrize("micro_batch_size", [2, 1])
def test_same_losses_and_adapter_as_llamafactory_cli(micro_batch_size, llamafactory_reference, tiny_qwen2_path,
                                                     tmp_path):
    reference_steps, reference_adapter = llamafactory_reference
    entries, adapter = harvest_run(Path(tiny_qwen2_path), tmp_path, micro_batch_size)
    assert_same_training(reference_steps, reference_adapter, entries, adapter, f"micro_batch_size={micro_batch_size}")


# LlamaFactory's data semantics that reach the model through its collator. With cutoff_len
# 256 several tiny_alpaca samples share a packed row, so position ids restarting per sequence
# (packing) and the block-diagonal mask (neat_packing) both change the loss; with
# ignore_pad_token_for_loss: false the padding carries loss, so the micro-batches must pad as
# LlamaFactory's batches do (micro_batch_size auto takes per_device_train_batch_size).
DATA_SEMANTICS = {
    "packing": (dict(packing=True, cutoff_len=256), 1),
    "neat_packing": (dict(neat_packing=True, cutoff_len=256), 1),
    "padding_carries_loss": (dict(ignore_pad_token_for_loss=False), None),
}


@pytest.mark.slow
@pytest.mark.timeout(900)
@pytest.mark.parametrize("case", sorted(DATA_SEMANTICS))
def test_llamafactory_data_semantics(case, tiny_qwen2_path, tmp_path):
    overrides, micro_batch_size = DATA_SEMANTICS[case]
    reference_steps, reference_adapter = llamafactory_cli_run(Path(tiny_qwen2_path), tmp_path, **overrides)
    built = []
    entries, adapter = harvest_run(Path(tiny_qwen2_path), tmp_path, micro_batch_size, on_trainer=built.append,
                                   **overrides)
    assert_same_training(reference_steps, reference_adapter, entries, adapter, case)
    rows = built[0].batches.num_samples
    if "packing" in case:  # several samples per row, or the case would not test packing
        assert rows <= len(json.loads((DATA_DIR / "tiny_alpaca.json").read_text())) // 2, rows
    else:
        assert built[0].micro_batch_size == 2, built[0].unit_sizing  # LlamaFactory's batch, chosen by auto


def assert_same_training(reference_steps, reference_adapter, entries, adapter, label: str) -> None:
    assert [e["step"] for e in reference_steps] == [e["step"] for e in entries] == [1, 2, 3, 4, 5, 6]
    loss_diffs = [abs(ref["loss"] - ours["loss"]) for ref, ours in zip(reference_steps, entries)]
    lr_diffs = [abs(ref["learning_rate"] - ours["learning_rate"]) for ref, ours in zip(reference_steps, entries)]
    assert set(adapter) == set(reference_adapter)
    weight_diff = max(float((adapter[k] - reference_adapter[k]).abs().max()) for k in adapter)
    print(f"parity {label}: max |loss diff| {max(loss_diffs):.3g}, "
          f"max |lr diff| {max(lr_diffs):.3g}, max |adapter diff| {weight_diff:.3g}")
    assert max(loss_diffs) <= TOLERANCE, (reference_steps, entries)
    assert max(lr_diffs) <= 1e-12
    assert weight_diff <= TOLERANCE
    assert max(float(t.abs().max()) for k, t in adapter.items() if "lora_B" in k) > 1e-3  # it trained
