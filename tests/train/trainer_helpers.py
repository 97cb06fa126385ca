"""Helpers for the trainer tests: job dictionaries over the tiny models and the small
alpaca-format dataset in tests/train/data, trainers built through LlamaFactory, and the
plain PEFT reference they are compared with."""

from __future__ import annotations

import contextlib
import json
import os
import threading
from pathlib import Path

DATA_DIR = Path(__file__).resolve().parent / "data"

# How long a test waits for a trainer thread to park at its gate: the first units of a
# compiling trainer (make test-compiled turns auto on) include a cold compile, which on a
# loaded 2-core machine takes minutes. A parked trainer ends the wait at once.
PARK_TIMEOUT_S = 240 if os.environ.get("HARVEST_TEST_COMPILE") == "on" else 60


@contextlib.contextmanager
def trainer_thread(trainer, gate, **run_kwargs):
    """``trainer.run(gate, **run_kwargs)`` on a thread named "trainer"; yields the list its
    outcome is appended to, and on leaving waits for the run to end. When the block fails
    (an assertion), the gate is stopped first: a trainer left running behind a failed test
    changes the process's random generator under the next tests (a compile on its thread
    puts the generator back when it is done, dynamo does, replaying what they drew
    meanwhile), and they fail for no fault of theirs."""
    outcome: list = []
    worker = threading.Thread(target=lambda: outcome.append(trainer.run(gate, **run_kwargs)), name="trainer")
    worker.start()
    try:
        yield outcome
    except BaseException:
        gate.stop()
        worker.join(timeout=PARK_TIMEOUT_S)
        raise
    worker.join(timeout=PARK_TIMEOUT_S)
    assert not worker.is_alive(), f"the trainer thread still runs {PARK_TIMEOUT_S} s after the test let it go"


def job_dict(model_path, output_dir, **overrides) -> dict:
    """A small, deterministic LlamaFactory job on the tiny dataset."""
    harvest = {"micro_batch_size": 2, **overrides.pop("harvest", {})}
    job = dict(
        model_name_or_path=str(model_path), template="default", dataset="tiny_alpaca", dataset_dir=str(DATA_DIR),
        lora_rank=4, lora_alpha=8, lora_target="all", lora_dropout=0.0, cutoff_len=64, learning_rate=1e-3,
        per_device_train_batch_size=2, gradient_accumulation_steps=2, max_steps=4, output_dir=str(output_dir),
        save_steps=2, logging_steps=1, seed=0, harvest=harvest,
    )
    job.update(overrides)
    return job


def build(model_path, output_dir, compile_layers="auto", **overrides):
    from harvest.train.build import build_trainer
    from harvest.train.job import load_job

    return build_trainer(load_job(job_dict(model_path, output_dir, **overrides)), compile_layers=compile_layers)


def log_lines(output_dir) -> list[dict]:
    """The entries of a job's trainer_log.jsonl (LlamaFactory's format)."""
    return [json.loads(line) for line in (Path(output_dir) / "trainer_log.jsonl").read_text().splitlines()]


def offline_losses(job_path, output_dir) -> list[float]:
    """Every step's loss of a job file trained here, in this process (``harvest train``'s
    way), into ``output_dir`` instead of the file's: what a server's run is compared with."""
    import yaml

    from harvest.train.build import build_trainer
    from harvest.train.gate import Gate
    from harvest.train.job import load_job

    raw = yaml.safe_load(Path(job_path).read_text())
    raw["output_dir"] = str(output_dir)
    offline = build_trainer(load_job(raw))
    losses = []
    offline.step_callbacks.append(lambda entry: losses.append(entry["loss"]))
    assert offline.run(Gate()) == "finished"
    offline.close()
    return losses


def randomize_lora_b(trainer, seed: int = 1) -> None:
    """LoRA B starts at zero, which makes every LoRA A gradient zero; give it values so the
    gradient comparison covers both matrices."""
    import torch

    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in trainer.split.peft_model.named_parameters():
            if param.requires_grad and "lora_B" in name:
                param.copy_(torch.randn(param.shape, generator=generator) * 0.05)


def reference_peft_model(trainer, model_path, output_dir, **overrides):
    """The plain PEFT model LlamaFactory builds for the same job, with the trainer's LoRA weights."""
    import copy

    from harvest.train.job import import_llamafactory, load_job

    import_llamafactory()
    from llamafactory.model import load_model, load_tokenizer

    job = load_job(job_dict(model_path, output_dir, **overrides))
    model_args = copy.copy(job.model_args)
    model_args.device_map = {"": "cpu"}
    tokenizer = load_tokenizer(model_args)["tokenizer"]
    model = load_model(tokenizer, model_args, job.finetuning_args, is_trainable=True)
    trained = dict(trainer.split.peft_model.named_parameters())
    with __import__("torch").no_grad():
        for name, param in model.named_parameters():
            if param.requires_grad:
                param.copy_(trained[name])
    return model


def full_batch(trainer, step: int):
    """The step's samples collated as one batch (what a plain trainer would feed)."""
    features = [trainer.batches.dataset[i] for i in trainer.batches.step_indices(step)]
    return trainer.batches.collate(features)


def run_until_optimizer(trainer) -> None:
    from harvest.train.stats import UnitKind

    while trainer.next_unit().kind != UnitKind.OPTIMIZER:
        trainer.run_one_unit()


def lora_grads(model) -> dict:
    return {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.requires_grad}


def lora_params(model) -> dict:
    return {n: p.detach().clone() for n, p in model.named_parameters() if p.requires_grad}


def max_abs_diff(a: dict, b: dict) -> float:
    assert a.keys() == b.keys()
    return max(float((a[k] - b[k]).abs().max()) for k in a)


def stop_after_units(units: int):
    """A gate that runs ``units`` units, then stops the trainer (mid-step, as a server would)."""
    from harvest.train.gate import BaseGate, GateAction, GateDecision

    class StopAfterUnits(BaseGate):
        def __init__(self):
            self.left = units

        def acquire(self, while_parked=None) -> GateDecision:
            self.left -= 1
            return GateDecision(GateAction.STOP if self.left < 0 else GateAction.RUN)

    return StopAfterUnits()
