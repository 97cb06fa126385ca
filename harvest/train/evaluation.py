"""Evaluation on the trainer's own units: when it is due, one pass over the eval sets, and
running a pass's units between the trainer's steps.

When and what follow the Hugging Face Trainer (``DefaultFlowCallback``, ``evaluation_loop``):
``eval_strategy``, ``eval_steps``, ``eval_delay``, ``eval_on_start``, ``do_eval``;
``eval_loss`` per set (``eval_<name>_loss`` with ``eval_on_each_dataset``). A pass is a
list of units, one (stage, eval micro-batch) forward each without gradients, so decode
preempts evaluation exactly as it preempts training. Invariant: evaluation uses no random
numbers and changes no weights, so training is the same with or without it.
Semantics: docs/jobs.md, 'Evaluation'.
"""

from __future__ import annotations

import dataclasses
import itertools
import math
import time
from typing import Any, Callable, Mapping, Sequence

import torch

from harvest.compute.device import on_stream
from harvest.train.data import micro_batch_from
from harvest.train.split_model import MicroBatch
from harvest.train.stats import Unit, UnitKind, UnitRecord


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
                self.micro_batches.append((prefix, micro_batch_from(batch, len(self.micro_batches), device)))
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


class EvalRunner:
    """A trainer's evaluations (harvest.train.trainer.LayerSplitTrainer): whether one is
    owed, the pass in progress and its units, and the last metrics. An owed evaluation's
    units run before the next step's; ``evaluation`` None: never evaluates."""

    def __init__(self, trainer, evaluation: Evaluation | None):
        self.trainer = trainer
        self.evaluation = evaluation
        self.owed = evaluation is not None and evaluation.due_after(0)  # eval_on_start
        self.eval_pass: EvalPass | None = None  # the evaluation in progress
        self.done_step: int | None = None  # the step after which the last evaluation completed
        self.last_metrics: dict[str, float] = {}

    @property
    def in_progress(self) -> bool:
        return self.owed or self.eval_pass is not None

    def step_done(self, step: int) -> None:
        """After optimizer step ``step``: owe an evaluation when one is due."""
        if self.evaluation is not None and self.evaluation.due_after(step):
            self.owed = True

    def resumed(self, step: int, done_step: int | None) -> bool:
        """From a checkpoint of ``step`` whose last evaluation completed after ``done_step``:
        an evaluation due after ``step`` that had not completed runs again. Returns whether
        one is owed."""
        self.done_step = done_step
        self.owed = self.evaluation is not None and self.evaluation.due_after(step) and done_step != step
        self.eval_pass = None
        return self.owed

    def next_unit(self) -> Unit:
        eval_pass = self.eval_pass
        if eval_pass is None:
            return Unit(UnitKind.EVAL, 0, 0)  # built by the unit itself, on the trainer's stream
        plan, cursor = eval_pass.plan, eval_pass.cursor
        # A lock-free peek (the decode thread) can land between the last unit's cursor
        # step and the pass's end: the pass's last unit stands for it.
        return plan[min(cursor, len(plan) - 1)]

    def run_unit_locked(self, compute_stream, events) -> UnitRecord:
        """Run the pass's next unit, as the trainer's `_run_unit_locked` runs a training unit."""
        t = self.trainer
        started = time.perf_counter()
        with on_stream(compute_stream):
            if self.eval_pass is None:
                self.eval_pass = self.evaluation.new_pass(t.split.num_stages, t.device)
                self.owed = False
            eval_pass = self.eval_pass
            unit = eval_pass.plan[eval_pass.cursor]
            upcoming = (u.stage for u in eval_pass.plan[eval_pass.cursor + 1:])
            load_s = t.window.prepare(unit.stage, itertools.chain(upcoming, t._pass_stages), compute_stream)
            if events:
                events[0].record()
            mb = eval_pass.micro_batch(unit.micro_batch)
            model = t.split.peft_model
            was_training = model.training
            model.eval()  # no LoRA dropout, as the Hugging Face Trainer evaluates
            try:
                with t._autocast():
                    t.split.evaluate(unit.stage, mb)
            finally:
                model.train(was_training)
            if unit.stage == t.split.head_stage:
                eval_pass.head_done(unit.micro_batch)
            if events:
                events[1].record()
        eval_pass.cursor += 1
        elapsed = time.perf_counter() - started
        with t._stats_lock:
            t._counters["units_run"] += 1
            t._counters["load_wait_s"] += load_s
        if eval_pass.done:
            self._finish(eval_pass)
        return UnitRecord(t.global_step, unit.kind, unit.stage, t.split.stage_names[unit.stage],
                          unit.micro_batch, mb.num_tokens, elapsed * 1e3, load_s * 1e3, events)

    def _finish(self, eval_pass: EvalPass) -> None:
        t = self.trainer
        metrics = eval_pass.metrics()
        self.eval_pass = None
        self.done_step = t.global_step
        self.last_metrics = metrics
        if t.train_log is not None:
            t.train_log.log(metrics)
        entry = {**metrics, "step": t.global_step}
        for callback in t.eval_callbacks:
            callback(entry)
        t._finalize_if_done()
