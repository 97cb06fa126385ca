"""Evaluation on the trainer's own units: when it is due, and one pass over the eval sets.

The Hugging Face Trainer's semantics (``DefaultFlowCallback``): ``eval_strategy: steps``
evaluates after every ``eval_steps`` steps (a fraction < 1 of the run; unset: the logging
interval) once ``eval_delay`` steps have passed, and after the last step; ``epoch`` at
each epoch end; ``eval_on_start`` before the first step. ``eval_loss`` is the mean over
samples of their batch's mean token loss, batches of ``per_device_eval_batch_size`` in
dataset order (its ``evaluation_loop``); with several eval sets (``eval_on_each_dataset``)
each gets ``eval_<name>_loss``. ``do_eval`` evaluates after the last step as well (where
``llamafactory-cli train`` calls ``trainer.evaluate()``; harvest logs that evaluation once).

A pass is a list of units, one (stage, eval micro-batch) forward each, without
gradients, so decode preempts evaluation exactly as it preempts training. Evaluation
uses no random numbers and changes no weights: training is the same with or without it.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, Callable, Mapping, Sequence

import torch

from harvest.train.data import IGNORE_INDEX
from harvest.train.split_model import MicroBatch
from harvest.train.stats import Unit, UnitKind


@dataclasses.dataclass(frozen=True)
class EvalSettings:
    strategy: str = "no"  # no | steps | epoch
    steps: float = 1.0  # >= 1: steps; < 1: fraction of the run (strategy steps)
    delay: float = 0.0  # steps (strategy steps) or epochs (strategy epoch) before the first evaluation
    on_start: bool = False
    at_end: bool = False  # do_eval: after the last step too (llamafactory-cli evaluates after training)
    batch_size: int = 8


class Evaluation:
    """The eval sets of a job and when to evaluate them."""

    def __init__(self, eval_sets: Mapping[str, Sequence[dict[str, Any]]], collate: Callable[[list], dict],
                 settings: EvalSettings, *, total_steps: int, steps_per_epoch: int, microbatches_per_pass: int):
        self.eval_sets = {prefix: data for prefix, data in eval_sets.items() if len(data)}
        self.collate = collate
        self.settings = settings
        self.total_steps = total_steps
        self.steps_per_epoch = steps_per_epoch
        self.microbatches_per_pass = microbatches_per_pass
        steps = settings.steps
        self.interval = max(1, math.ceil(steps * total_steps) if steps < 1 else int(steps))

    def due_after(self, step: int) -> bool:
        """Whether an evaluation runs after optimizer step ``step`` (0: before the first)."""
        s = self.settings
        if not self.eval_sets:
            return False
        if step == 0:
            return s.on_start
        if step == self.total_steps and s.at_end:
            return True
        if s.strategy == "steps":
            return s.delay <= step and (step % self.interval == 0 or step == self.total_steps)
        if s.strategy == "epoch":
            return (step % self.steps_per_epoch == 0 or step == self.total_steps) and \
                s.delay <= step / self.steps_per_epoch
        return False

    def new_pass(self, num_stages: int, device: torch.device) -> "EvalPass":
        return EvalPass(self, num_stages, device)


class EvalPass:
    """One evaluation: its units in order, and the loss sums they build."""

    def __init__(self, evaluation: Evaluation, num_stages: int, device: torch.device):
        size = evaluation.settings.batch_size
        self.micro_batches: list[tuple[str, MicroBatch]] = []
        for prefix, data in evaluation.eval_sets.items():
            for start in range(0, len(data), size):
                batch = evaluation.collate([data[i] for i in range(start, min(start + size, len(data)))])
                labels = batch["labels"]
                self.micro_batches.append((prefix, MicroBatch(
                    index=len(self.micro_batches), input_ids=batch["input_ids"].to(device),
                    attention_mask=batch["attention_mask"].to(device), labels=labels.to(device),
                    num_tokens=int(batch["attention_mask"].sum()),
                    num_label_tokens=int((labels[:, 1:] != IGNORE_INDEX).sum()))))
        self.plan: list[Unit] = []
        group = evaluation.microbatches_per_pass
        for first in range(0, len(self.micro_batches), group):
            members = range(first, min(first + group, len(self.micro_batches)))
            self.plan += [Unit(UnitKind.EVAL, stage, mb) for stage in range(num_stages) for mb in members]
        self.cursor = 0
        self._sums = {prefix: [0.0, 0] for prefix in evaluation.eval_sets}  # sum of batch loss x samples, samples

    @property
    def done(self) -> bool:
        return self.cursor >= len(self.plan)

    def micro_batch(self, index: int) -> MicroBatch:
        return self.micro_batches[index][1]

    def head_done(self, index: int) -> None:
        """The head stage of micro-batch ``index`` has run: add its loss."""
        prefix, mb = self.micro_batches[index]
        sums = self._sums[prefix]
        sums[0] += float(mb.loss) * mb.input_ids.shape[0]
        sums[1] += mb.input_ids.shape[0]
        mb.loss = None

    def metrics(self) -> dict[str, float]:
        return {f"{prefix}_loss": total / count for prefix, (total, count) in self._sums.items() if count}
