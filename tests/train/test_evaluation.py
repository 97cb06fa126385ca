"""Evaluation runs on the trainer's own preemptible units, computes the Hugging Face
Trainer's eval_loss, runs when it is due, and never changes what is trained."""

from __future__ import annotations

import json

import pytest
import torch

from harvest.train.gate import BaseGate, Gate, GateAction, GateDecision
from harvest.train.stats import UnitKind
from tests.train.trainer_helpers import build, lora_params, max_abs_diff, reference_peft_model, stop_after_units

EVAL = dict(val_size=0.25, eval_strategy="steps", eval_steps=2, per_device_eval_batch_size=3)


def hf_eval_loss(model, eval_set, collate, batch_size: int) -> float:
    """transformers' evaluation_loop: each batch's mean token loss, repeated per sample, averaged."""
    model.eval()
    losses = []
    with torch.no_grad():
        for start in range(0, len(eval_set), batch_size):
            batch = collate([eval_set[i] for i in range(start, min(start + batch_size, len(eval_set)))])
            loss = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"],
                         labels=batch["labels"]).loss
            losses += [float(loss)] * batch["input_ids"].shape[0]
    return sum(losses) / len(losses)


@pytest.mark.parametrize("window_stages", ["all", 1])
def test_eval_loss_is_the_hugging_face_trainers(window_stages, tiny_llama_path, tmp_path):
    trainer = build(tiny_llama_path, tmp_path / "out", max_steps=2, lora_dropout=0.1,
                    harvest={"window_stages": window_stages}, **EVAL)
    results = []
    trainer.eval_callbacks.append(results.append)
    assert trainer.run(Gate()) == "finished"
    eval_set = trainer.evaluation.eval_sets["eval"]
    assert len(eval_set) == 4 and trainer.batches.num_samples == 12  # LlamaFactory's split of 16
    reference = reference_peft_model(trainer, tiny_llama_path, tmp_path / "ref", max_steps=2, **EVAL)
    expected = hf_eval_loss(reference, eval_set, trainer.batches.collate, batch_size=3)  # batches of 3 and 1
    assert [r["step"] for r in results] == [2]
    assert abs(results[0]["eval_loss"] - expected) <= 1e-5
    assert trainer.stats().eval_loss == results[0]["eval_loss"]
    trainer.close()


def test_eval_runs_when_due_and_is_logged(tiny_llama_path, tmp_path):
    out = tmp_path / "out"
    trainer = build(tiny_llama_path, out, max_steps=5, eval_on_start=True, **EVAL)
    steps = []
    trainer.eval_callbacks.append(lambda entry: steps.append(entry["step"]))
    trainer.run(Gate())
    trainer.close()
    assert steps == [0, 2, 4, 5]  # on start, every 2 steps, and after the last
    lines = [json.loads(line) for line in (out / "trainer_log.jsonl").read_text().splitlines()]
    assert [line["current_steps"] for line in lines if "eval_loss" in line] == [0, 2, 4, 5]
    history = json.loads((out / "trainer_state.json").read_text())["log_history"]
    assert [entry["step"] for entry in history if "eval_loss" in entry] == [0, 2, 4, 5]


def test_training_is_the_same_with_and_without_evaluation(tiny_llama_path, tmp_path):
    with_eval = build(tiny_llama_path, tmp_path / "a", max_steps=4, lora_dropout=0.1, **EVAL)
    without = build(tiny_llama_path, tmp_path / "b", max_steps=4, lora_dropout=0.1, val_size=0.25)
    losses_a, losses_b = [], []
    with_eval.step_callbacks.append(lambda e: losses_a.append(e["loss"]))
    without.step_callbacks.append(lambda e: losses_b.append(e["loss"]))
    for trainer in (with_eval, without):  # one process: both start from the same global RNG (LoRA dropout)
        torch.manual_seed(0)
        trainer.run(Gate())
    assert without.evaluation is None or not without.evaluation.due_after(2)
    assert losses_a == losses_b
    assert max_abs_diff(lora_params(with_eval.split.peft_model), lora_params(without.split.peft_model)) == 0.0


class CountingGate(BaseGate):
    """Runs everything, remembering the kind of unit the trainer asked to run next."""

    def __init__(self, trainer):
        self.trainer = trainer
        self.asked = []

    def acquire(self, while_parked=None) -> GateDecision:
        self.asked.append(self.trainer.peek_next_unit().kind)
        return GateDecision(GateAction.RUN)


def test_eval_units_pass_the_gate_one_stage_at_a_time(tiny_llama_path, tmp_path):
    trainer = build(tiny_llama_path, tmp_path / "out", max_steps=2, **EVAL)
    gate = CountingGate(trainer)
    trainer.run(gate)
    # 4 eval samples in micro-batches of 3 and 1, each through every stage: 2 x num_stages units.
    assert gate.asked.count(UnitKind.EVAL) == 2 * trainer.split.num_stages


def test_an_interrupted_evaluation_runs_again_after_resume(tiny_llama_path, tmp_path):
    out = tmp_path / "out"
    overrides = dict(max_steps=4, save_steps=2, **EVAL)
    first = build(tiny_llama_path, out, **overrides)
    units_per_step = len(first._plan(2))
    first.run(stop_after_units(2 * units_per_step + 3))  # steps 1-2 done, the eval after step 2 half run
    first.close()
    assert first.stats().eval_loss is None
    resumed = build(tiny_llama_path, out, **overrides)
    assert resumed.global_step == 2 and resumed.next_unit().kind == UnitKind.EVAL
    steps = []
    resumed.eval_callbacks.append(lambda entry: steps.append(entry["step"]))
    assert resumed.run(Gate()) == "finished"
    resumed.close()
    assert steps == [2, 4]
    lines = [json.loads(line) for line in (out / "trainer_log.jsonl").read_text().splitlines()]
    assert [line["current_steps"] for line in lines if "eval_loss" in line] == [2, 4]  # never twice


def test_eval_on_each_dataset_reports_each(tiny_llama_path, tmp_path):
    trainer = build(tiny_llama_path, tmp_path / "out", max_steps=2, eval_dataset="tiny_alpaca,tiny_alpaca_copy",
                    eval_on_each_dataset=True, eval_strategy="steps", eval_steps=2, per_device_eval_batch_size=4)
    results = []
    trainer.eval_callbacks.append(results.append)
    trainer.run(Gate())
    trainer.close()
    assert set(results[0]) == {"eval_tiny_alpaca_loss", "eval_tiny_alpaca_copy_loss", "step"}
    assert results[0]["eval_tiny_alpaca_loss"] == pytest.approx(results[0]["eval_tiny_alpaca_copy_loss"], abs=1e-6)
