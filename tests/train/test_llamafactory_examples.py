"""LlamaFactory 0.9.5's own LoRA example jobs, as a user would run them: only the model path
(a tiny model the project builds, with the chat templates' special tokens) and the dataset
(a small local one) are rewritten. SFT LoRA jobs pass `harvest train --check` and train;
the others are refused before anything loads, naming the key."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml

from tests.train.trainer_helpers import DATA_DIR

EXAMPLES = Path(__file__).resolve().parent / "data" / "llamafactory_examples"

# example file -> None (checks and trains) or the start of the refusal (after "job file '...': ")
EXPECTED = {
    "qwen3_lora_sft.yaml": None,
    "qwen3_preprocess.yaml": None,
    "qwen3_lora_sft_ray.yaml": None,  # ray_num_workers: noted (harvest does not launch through Ray)
    "qwen3_lora_sft_ds3.yaml": "deepspeed: 'examples/deepspeed/ds_z3_config.json' is not supported by harvest",
    "qwen3_lora_pretrain.yaml": "stage: 'pt' is not supported",
    "qwen3_lora_dpo.yaml": "stage: 'dpo' is not supported",
    "qwen3_lora_kto.yaml": "stage: 'kto' is not supported",
    "qwen3_lora_reward.yaml": "stage: 'rm' is not supported",
    "qwen3vl_lora_dpo.yaml": "stage: 'dpo' is not supported",
    "qwen3vl_lora_sft.yaml": "template: 'qwen3_vl_nothink' is a multimodal template",
}


def test_every_vendored_example_has_an_expectation():
    assert sorted(p.name for p in EXAMPLES.glob("*.yaml")) == sorted(EXPECTED)


@pytest.fixture(scope="module")
def tiny_chat_model():
    from harvest.tiny_model import TINY_CHAT_LLAMA, ensure_tiny_model

    return ensure_tiny_model(TINY_CHAT_LLAMA)


def rewritten(example: str, model: Path, folder: Path) -> Path:
    """The example with only the model path and the dataset made local; written into
    ``folder`` (its relative output_dir and tokenized_path land there)."""
    job = yaml.safe_load((EXAMPLES / example).read_text())
    job["model_name_or_path"] = str(model)
    job["dataset"] = "tiny_alpaca"
    job["dataset_dir"] = str(DATA_DIR)
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / example
    path.write_text(yaml.safe_dump(job, sort_keys=False))
    return path


@pytest.mark.parametrize("example", sorted(EXPECTED))
def test_example_checks_trains_or_is_refused(example, tiny_chat_model, tmp_path, capsys):
    from harvest.cli import main

    job_file = rewritten(example, tiny_chat_model, tmp_path / "jobs")
    refusal = EXPECTED[example]
    rc = main(["train", "--check", str(job_file)])
    out, err = capsys.readouterr()
    if refusal is not None:
        assert rc == 2
        assert f"harvest train: job file '{job_file}': {refusal}" in err, err
        assert "Traceback" not in err
        return
    assert rc == 0, err
    assert "is ready to train" in out
    assert main(["train", "--no-progress", str(job_file)]) == 0
    job = yaml.safe_load(job_file.read_text())
    output_dir = job_file.parent / job["output_dir"]  # relative: beside the job file
    assert (output_dir / "adapter_model.safetensors").is_file()
    state = json.loads((output_dir / "trainer_state.json").read_text())
    assert state["global_step"] == state["max_steps"] == 6  # 16 samples, 8 per step, 3 epochs
    # logging_steps 10 > 6 steps: no loss line, so LlamaFactory's plot_loss draws nothing (as under
    # llamafactory-cli); test_outputs.py covers the plot.
    logged = [entry for entry in state["log_history"] if "loss" in entry]
    assert (output_dir / "training_loss.png").is_file() == bool(job.get("plot_loss") and logged)
    if job.get("tokenized_path"):
        assert (job_file.parent / job["tokenized_path"]).is_dir()  # LlamaFactory saved the tokenized set
