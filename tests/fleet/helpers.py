"""Fleet test helpers: job files on the demo data, `harvest train` member processes."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import yaml

from harvest.colocation_config import DEMO_DATA

PROJECT = Path(__file__).resolve().parents[2]


def write_fleet_job(directory: Path, model_path: Path, *, port: int | None, max_steps: int, batch: int = 4,
                    fleet: dict | None = None, name: str = "job", **job_keys) -> Path:
    directory.mkdir(parents=True, exist_ok=True)
    harvest = {"micro_batch_size": 2}
    if port is not None:
        # dead_after_s as the SGLang fleet test's: members are CPU trainers sharing a few cores
        # with the store and pytest, where a heartbeat thread can stall for seconds; a live
        # member taken for dead is dropped and its steps are trained twice.
        harvest["fleet"] = {"rendezvous": f"127.0.0.1:{port}", "job_id": "fleet-test", "heartbeat_s": 0.5,
                            "dead_after_s": 10.0, "collective_timeout_s": 30.0, **(fleet or {})}
    job = {
        "model_name_or_path": str(model_path), "template": "default", "dataset": "demo_alpaca",
        "dataset_dir": str(DEMO_DATA), "finetuning_type": "lora", "lora_rank": 4, "lora_alpha": 8,
        "lora_target": "all", "lora_dropout": 0.0, "cutoff_len": 64, "learning_rate": 1e-3,
        "per_device_train_batch_size": batch, "gradient_accumulation_steps": 1, "max_steps": max_steps,
        "output_dir": str(directory / "adapter"), "save_steps": 1000, "seed": 0, "harvest": harvest, **job_keys,
    }
    path = directory / f"{name}.yaml"
    path.write_text(yaml.safe_dump(job, sort_keys=False))
    return path


def member_env() -> dict:
    return {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1", "DISABLE_VERSION_CHECK": "1",
            "PYTHONPATH": str(PROJECT)}


def start_member(job: Path, log: Path) -> subprocess.Popen:
    handle = log.open("w")
    return subprocess.Popen([sys.executable, "-m", "harvest.cli", "train", str(job), "--no-progress"], cwd=PROJECT,
                            env=member_env(), stdout=handle, stderr=subprocess.STDOUT, text=True)


def adapter_tensors(output_dir: Path) -> dict:
    from safetensors.torch import load_file

    return load_file(str(output_dir / "adapter_model.safetensors"))


def adapter_loss(job_path: Path, adapter_dir: Path, steps: range) -> float:
    """Mean token loss of the adapter in ``adapter_dir`` over the samples of ``steps`` of
    the job (the one-process trainer's batches, no fleet), computed without training."""
    import dataclasses

    import torch
    import torch.nn.functional as F
    from peft import set_peft_model_state_dict

    from harvest.train.build import build_trainer
    from harvest.train.data import IGNORE_INDEX
    from harvest.train.job import load_job

    job = load_job(job_path)
    job = dataclasses.replace(job, harvest=dataclasses.replace(job.harvest, fleet=dataclasses.replace(
        job.harvest.fleet, rendezvous=None)))
    trainer = build_trainer(job, resume=False)
    set_peft_model_state_dict(trainer.split.peft_model, adapter_tensors(adapter_dir))
    total, count = 0.0, 0
    for step in steps:
        for mb in trainer.batches.micro_batches(step, 2, torch.device("cpu")):
            logits = trainer.logits(mb.input_ids, mb.attention_mask).float()
            labels = mb.labels[:, 1:]
            losses = F.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]), labels.reshape(-1),
                                     ignore_index=IGNORE_INDEX, reduction="sum")
            total += float(losses)
            count += int((labels != IGNORE_INDEX).sum())
    trainer.close()
    return total / count
