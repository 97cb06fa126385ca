"""Checkpoints: kill-and-resume reproduces the loss curve, the adapter loads in PEFT with
the same logits, and a corrupt or foreign checkpoint is refused with a message."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from harvest.train.errors import CheckpointError
from harvest.train.gate import Gate
from tests.train.trainer_helpers import build, job_dict

PROJECT = Path(__file__).resolve().parents[2]
DRIVER = Path(__file__).resolve().parent / "pausing_driver.py"


def write_job(path: Path, job: dict) -> Path:
    import yaml

    path.write_text(yaml.safe_dump(job))
    return path


def losses(output_dir: Path) -> dict[int, float]:
    entries = [json.loads(line) for line in (output_dir / "trainer_log.jsonl").read_text().splitlines()]
    return {entry["current_steps"]: entry["loss"] for entry in entries}


def subprocess_env() -> dict:
    # One intra-op thread, as in-process (conftest): same summation order, same floats.
    return {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1", "DISABLE_VERSION_CHECK": "1"}


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_sigkill_then_resume_reproduces_the_uninterrupted_run(tiny_llama_path, tmp_path):
    overrides = dict(max_steps=6, save_steps=2, lora_dropout=0.1, harvest={"window_stages": 2})
    job_path = write_job(tmp_path / "job.yaml", job_dict(tiny_llama_path, tmp_path / "run", **overrides))

    # A real kill: the trainer process completed steps 1-3 (checkpoint-2 on disk), is in
    # step 4's backward pass, and gets SIGKILL.
    driver = subprocess.Popen([sys.executable, str(DRIVER), str(job_path), "3"], cwd=PROJECT, env=subprocess_env(),
                              stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    try:
        deadline = time.monotonic() + 180
        for line in driver.stdout:
            if line.startswith("PARKED") or time.monotonic() > deadline:
                break
        assert line.startswith("PARKED"), "the driver never reached step 4's backward pass"
        os.kill(driver.pid, signal.SIGKILL)
    finally:
        driver.kill()
        driver.wait(timeout=30)
    assert driver.returncode == -signal.SIGKILL
    run_dir = tmp_path / "run"
    assert sorted(p.name for p in run_dir.glob("checkpoint-*")) == ["checkpoint-2"]
    assert sorted(losses(run_dir)) == [1, 2, 3]

    # Resume with the ordinary command: LlamaFactory picks checkpoint-2; steps 3-6 run again.
    resumed = subprocess.run([sys.executable, "-m", "harvest.cli", "train", str(job_path), "--no-progress"],
                             cwd=PROJECT, env=subprocess_env(), capture_output=True, text=True, timeout=180)
    assert resumed.returncode == 0, resumed.stderr[-2000:]
    assert "finished at step 6/6" in resumed.stdout

    uninterrupted = build(tiny_llama_path, tmp_path / "straight", **overrides)
    assert uninterrupted.run(Gate()) == "finished"
    expected, got = losses(tmp_path / "straight"), losses(run_dir)
    assert sorted(got) == list(range(1, 7))
    assert max(abs(expected[step] - got[step]) for step in expected) <= 1e-6

    # The finished adapter loads in PEFT and gives the trainer's logits.
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(tiny_llama_path, dtype=torch.float32)
    peft_model = PeftModel.from_pretrained(base, str(run_dir)).eval()
    features = [uninterrupted.batches.dataset[i] for i in range(3)]
    batch = uninterrupted.batches.collate(features)
    with torch.no_grad():
        expected_logits = peft_model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
    logits = uninterrupted.logits(batch["input_ids"], batch["attention_mask"])
    mask = batch["attention_mask"].bool()
    assert float((expected_logits - logits)[mask].abs().max()) <= 1e-5
    assert (run_dir / "checkpoint-6" / "adapter_config.json").is_file()


@pytest.fixture()
def checkpointed(tiny_llama_path, tmp_path):
    """An output_dir holding checkpoint-2 of a finished 2-step run."""
    trainer = build(tiny_llama_path, tmp_path / "run", max_steps=2, save_steps=2)
    assert trainer.run(Gate()) == "finished"
    return tmp_path / "run"


def test_corrupt_checkpoint_is_refused(checkpointed, tiny_llama_path):
    optimizer_file = checkpointed / "checkpoint-2" / "optimizer.pt"
    data = bytearray(optimizer_file.read_bytes())
    data[len(data) // 2] ^= 0xFF
    optimizer_file.write_bytes(bytes(data))
    with pytest.raises(CheckpointError, match=r"corrupt: optimizer\.pt"):
        build(tiny_llama_path, checkpointed, max_steps=4, save_steps=2)


def test_checkpoint_without_state_file_is_refused(checkpointed, tiny_llama_path):
    (checkpointed / "checkpoint-2" / "harvest_state.json").unlink()
    with pytest.raises(CheckpointError, match="harvest_state.json.*refusing to resume"):
        build(tiny_llama_path, checkpointed, max_steps=4, save_steps=2)


def test_checkpoint_of_another_job_is_refused(checkpointed, tiny_llama_path):
    with pytest.raises(CheckpointError, match="seed"):
        build(tiny_llama_path, checkpointed, max_steps=4, save_steps=2, seed=7)


def test_torn_staging_directory_is_ignored_and_overwrite_starts_over(checkpointed, tiny_llama_path):
    torn = checkpointed / ".tmp-checkpoint-3-12345"
    torn.mkdir()
    (torn / "adapter_model.safetensors").write_bytes(b"\x00" * 10)  # a write cut off by a kill
    resumed = build(tiny_llama_path, checkpointed, max_steps=4, save_steps=2)
    assert resumed.global_step == 2
    fresh = build(tiny_llama_path, checkpointed, max_steps=4, save_steps=2, overwrite_output_dir=True)
    assert fresh.global_step == 0
    assert fresh.run(Gate()) == "finished"
    assert json.loads((checkpointed / "checkpoint-2" / "harvest_state.json").read_text())["global_step"] == 2


def test_the_reported_checkpoint_step_is_on_disk_before_it_shows(tiny_llama_path, tmp_path, monkeypatch):
    """stats().checkpoint_step (the job status's, what `harvest ctl publish` of a running job
    waits for) names a checkpoint already written: global_step counts a step before its due
    checkpoint is, so a caller that waited for the step found no checkpoint yet."""
    from harvest.train import checkpoint

    trainer = build(tiny_llama_path, tmp_path / "run", max_steps=4, save_steps=2)
    assert trainer.stats().checkpoint_step is None
    seen_while_writing = []
    real_save = checkpoint.save_checkpoint

    def save(output_dir, step, **kwargs):
        stats = trainer.stats()
        seen_while_writing.append((step, stats.global_step, stats.checkpoint_step))
        return real_save(output_dir, step, **kwargs)

    monkeypatch.setattr(checkpoint, "save_checkpoint", save)
    reported = []

    def on_step(entry):
        step = trainer.stats().checkpoint_step
        reported.append(step)
        assert step is None or (tmp_path / "run" / f"checkpoint-{step}" / "adapter_config.json").is_file()

    trainer.step_callbacks.append(on_step)
    assert trainer.run(Gate()) == "finished"
    # While checkpoint-N is written the step already counts; the checkpoint step does not.
    assert seen_while_writing == [(2, 2, None), (4, 4, 2)]
    assert reported == [None, None, 2, 2] and trainer.stats().checkpoint_step == 4
    resumed = build(tiny_llama_path, tmp_path / "run", max_steps=6, save_steps=2)
    assert resumed.stats().checkpoint_step == 4  # the checkpoint it resumed from
