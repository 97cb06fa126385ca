"""The trainer's log, in the formats LlamaFactory's and Hugging Face's tools read.

harvest keeps a `transformers.TrainerState` and drives the callbacks the Hugging Face
Trainer drives under ``llamafactory-cli train`` (LlamaFactory's ``LogCallback`` writing
``trainer_log.jsonl``; the ``report_to`` reporters), and writes ``trainer_state.json`` into
every checkpoint and output_dir, so nothing here re-implements their formats. Log lines
follow the Hugging Face Trainer's ``logging_*`` rules; resuming from checkpoint-N rolls the
log back to step N, so redone steps never appear twice.
Rules: docs/jobs.md, 'What a job leaves in output_dir'.
"""

from __future__ import annotations

import json
import logging
import math
import os
from pathlib import Path
from typing import Any

from harvest.train.errors import JobError
from harvest.train.llamafactory_env import import_llamafactory

logger = logging.getLogger(__name__)
TRAINER_LOG = "trainer_log.jsonl"  # LlamaFactory's name (llamafactory.extras.constants.TRAINER_LOG)
TRAINER_STATE = "trainer_state.json"  # Hugging Face's name (transformers.trainer.TRAINER_STATE_NAME)


def check_reporters(report_to: Any) -> None:
    """Refuse (before anything loads) a ``report_to`` reporter that is not installed here."""
    from transformers.integrations import get_reporting_integration_callbacks

    try:
        callbacks = get_reporting_integration_callbacks(report_to)
    except ValueError as exc:
        raise JobError(f"report_to: {exc}") from None
    for callback in callbacks:
        try:
            callback()
        except (RuntimeError, ImportError) as exc:
            raise JobError(f"report_to: {callback.__name__} cannot report here: {exc}") from None


class _MainProcessArgs:
    """The job's TrainingArguments as the callbacks see them, answering as the main
    process: asking the real ones (``should_save``) starts accelerate's process state,
    which would pick a CUDA device inside a decode server."""

    def __init__(self, args):
        self._args = args

    should_save = True
    should_log = True
    process_index = 0
    local_process_index = 0
    world_size = 1

    def __getattr__(self, name):
        return getattr(self._args, name)


class TrainLog:
    """What the trainer reports after each step, in trainer_log.jsonl / trainer_state.json."""

    def __init__(self, training_args, *, output_dir: Path, total_steps: int, steps_per_epoch: int,
                 samples_per_step: int, plot_loss: bool):
        import_llamafactory()
        from llamafactory.train.callbacks import LogCallback
        from transformers import TrainerControl, TrainerState
        from transformers.integrations import get_reporting_integration_callbacks
        from transformers.trainer_callback import CallbackHandler, DefaultFlowCallback

        self.args = _MainProcessArgs(training_args)
        self.output_dir = Path(output_dir)
        self.steps_per_epoch = steps_per_epoch
        self.plot_loss = plot_loss
        strategy = str(getattr(training_args.logging_strategy, "value", training_args.logging_strategy))
        self.strategy = strategy
        steps = training_args.logging_steps
        self.logging_steps = max(1, math.ceil(steps * total_steps) if steps < 1 else int(steps))
        self.logging_first_step = bool(training_args.logging_first_step)
        self.state = TrainerState(max_steps=total_steps, num_train_epochs=math.ceil(total_steps / steps_per_epoch),
                                  logging_steps=self.logging_steps, train_batch_size=samples_per_step)
        # DefaultFlowCallback: the Hugging Face Trainer always has it (the handler warns without);
        # harvest decides logging itself and reads none of the control flags it sets.
        callbacks = [DefaultFlowCallback(), LogCallback()] + [
            cls() for cls in get_reporting_integration_callbacks(training_args.report_to)]
        self.handler = CallbackHandler(callbacks, None, None, None, None)
        self.control = TrainerControl()
        self._since_last: list[float] = []
        self._begun = False
        self.handler.on_init_end(self.args, self.state, self.control)  # overwrite_output_dir: LogCallback starts afresh

    # -- the trainer's calls ------------------------------------------------------------
    def step_done(self, entry: dict[str, Any]) -> None:
        """After optimizer step ``entry["step"]`` (its loss, learning_rate, grad_norm, epoch, tokens)."""
        self._begin()
        step = int(entry["step"])
        self.state.global_step = step
        self.state.epoch = step / self.steps_per_epoch
        self.state.num_input_tokens_seen = int(entry.get("tokens_seen", 0))
        self._since_last.append(float(entry["loss"]))
        self.control = self.handler.on_step_end(self.args, self.state, self.control)
        if self._should_log(step):
            logs = {"loss": sum(self._since_last) / len(self._since_last)}
            if entry.get("grad_norm") is not None:
                logs["grad_norm"] = float(entry["grad_norm"])
            logs["learning_rate"] = entry["learning_rate"]
            self.log(logs)
            self._since_last = []

    def log(self, logs: dict[str, float]) -> None:
        """One log line (the Hugging Face Trainer's ``log``): training or evaluation metrics."""
        self._begin()
        logs = {**logs, "epoch": self.state.epoch}
        self.state.log_history.append({**logs, "step": self.state.global_step})
        self.control = self.handler.on_log(self.args, self.state, self.control, logs)

    def state_json(self) -> str:
        """trainer_state.json's content now (written into each checkpoint)."""
        import dataclasses

        return json.dumps(dataclasses.asdict(self.state), indent=2, sort_keys=True) + "\n"

    def saved(self) -> None:
        self.control = self.handler.on_save(self.args, self.state, self.control)

    def finished(self) -> None:
        """Training is complete: trainer_state.json in output_dir, the loss plot, callbacks closed."""
        self.output_dir.mkdir(parents=True, exist_ok=True)
        _write_atomically(self.output_dir / TRAINER_STATE, self.state_json())
        self.end()
        if self.plot_loss:
            from llamafactory.extras.ploting import plot_loss

            keys = ["loss"] + (["eval_loss"] if any("eval_loss" in e for e in self.state.log_history) else [])
            plot_loss(str(self.output_dir), keys=keys)

    def end(self) -> None:
        """The trainer stops (finished, stopped or failed): flush LogCallback's writer."""
        if self._begun:
            self.control = self.handler.on_train_end(self.args, self.state, self.control)
            self._begun = False

    def resumed(self, checkpoint: Path, step: int, drop_evaluation: bool = False) -> None:
        """Continue the log of checkpoint-``step``: its state's log history, and
        trainer_log.jsonl without the lines of steps after it (they will be redone), nor,
        with ``drop_evaluation``, an evaluation logged at that step (it runs again)."""
        from transformers import TrainerState

        saved = checkpoint / TRAINER_STATE
        if saved.is_file():
            self.state.log_history = TrainerState.load_from_json(str(saved)).log_history
        else:
            self.state.log_history = []
        self.state.global_step = step
        self.state.epoch = step / self.steps_per_epoch
        log_path = self.output_dir / TRAINER_LOG
        if log_path.is_file():
            def keep(entry: dict) -> bool:
                at = entry.get("current_steps", 0)
                return at < step or (at == step and not (drop_evaluation and "loss" not in entry))

            kept = [line for line in log_path.read_text().splitlines() if line.strip() and keep(json.loads(line))]
            _write_atomically(log_path, "".join(line + "\n" for line in kept))
            logger.info("resumed at step %d: %s rolled back to it", step, log_path)

    # -- internals -----------------------------------------------------------------------
    def _begin(self) -> None:
        if not self._begun:
            self._begun = True
            self.control = self.handler.on_train_begin(self.args, self.state, self.control)

    def _should_log(self, step: int) -> bool:
        if self.strategy == "no":
            return False
        if self.strategy == "epoch":
            return step % self.steps_per_epoch == 0 or step == self.state.max_steps
        return (step == 1 and self.logging_first_step) or step % self.logging_steps == 0


def _write_atomically(path: Path, text: str) -> None:
    staging = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    staging.write_text(text)
    os.replace(staging, path)
