"""When and what a trainer checkpoints, and resuming from a checkpoint.

A checkpoint holds the state of the last completed step: weights and optimizer change
only in the optimizer unit, the RNG state is snapshotted at every step start and the
data position is the step number, so resuming redoes an interrupted step exactly. The
files themselves are harvest.train.checkpoint's.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from harvest.train import checkpoint


class TrainerCheckpoints:
    """The checkpoints of one trainer (harvest.train.trainer.LayerSplitTrainer): every
    ``save_steps`` steps and at the end; ``written_step`` is the newest one on disk
    (stats().checkpoint_step), read and written under the trainer's stats lock."""

    def __init__(self, trainer, *, save_steps: int | None, save_total_limit: int | None, save_only_model: bool,
                 fingerprint: dict):
        self.trainer = trainer
        self.save_steps = save_steps
        self.save_total_limit = save_total_limit
        self.save_only_model = save_only_model
        self.fingerprint = fingerprint  # the job's: a resume checks it
        self.written_step: int | None = None
        self._last_saved: tuple[int | None, int | None] = (None, None)  # (global step, evaluation done step)

    def due_after(self, step: int) -> bool:
        """Whether optimizer step ``step`` ends with a checkpoint (every save_steps, and the last)."""
        return bool(self.save_steps and step % self.save_steps == 0) or step >= self.trainer.total_steps

    def save(self) -> Path | None:
        """Checkpoint the state of the last completed step (mid-step work is redone on
        resume). Returns its path, or None when there is nothing to save."""
        t = self.trainer
        if t.output_dir is None or t.global_step == 0 or t._fleet_periodic:
            return None  # a periodic fleet member's checkpoints are the fleet's (save_fleet)
        eval_done_step = t.evals.done_step
        if self._last_saved == (t.global_step, eval_done_step):
            return t.output_dir / f"checkpoint-{t.global_step}"
        rng_state = t._step.rng_state if t._step is not None else checkpoint.capture_rng_state(t.device)
        epoch, offset = t.batches.position(t.global_step)
        state = self._progress_state(epoch=epoch, sample_offset=offset)
        state.update(eval_done_step=eval_done_step)
        text_files = {"trainer_state.json": t.train_log.state_json()} if t.train_log is not None else None
        path = t.output_dir / f"checkpoint-{t.global_step}"
        with t._whole(t.optimizer):  # tensor-parallel: what a tp = 1 run writes, by rank 0
            if t.writes_files:
                path = self._write(t.global_step, rng_state, state, text_files)
        if t.tp is not None:
            # No rank returns before rank 0's write is on disk: a rank whose process stops
            # next cannot take the server (and rank 0's write) down half-way.
            with t._stats_lock:
                mine = -1 if self.written_step is None else self.written_step
            written = int(t.tp.max_float(float(mine)))
            with t._stats_lock:
                self.written_step = written if written >= 0 else None
        self._last_saved = (t.global_step, eval_done_step)
        if t.train_log is not None:
            t.train_log.saved()
        return path

    def save_fleet(self, fleet_state: dict, final: bool) -> Path | None:
        """The fleet's checkpoint (this member wrote the round's weights first): named by
        the fleet's committed steps; ``final``: the finished job's adapter too."""
        t = self.trainer
        if t.output_dir is None:
            return None
        step = sum(last - first + 1 for first, last in fleet_state["committed_steps"])
        with t._unit_lock:
            t._settle_device()
            state = self._progress_state()
            state.update(fleet=fleet_state, eval_done_step=None)
            path = self._write(step, checkpoint.capture_rng_state(t.device), state, None)
            if final:
                checkpoint.write_final_adapter(t.output_dir, t.split.peft_model)
        return path

    def resume(self, path: Path) -> dict[str, Any]:
        """Load a checkpoint (verified first by `checkpoint.check_resumable`, as build_trainer
        already did before the model loaded) into the trainer."""
        t = self.trainer
        state = checkpoint.check_resumable(path, total_steps=t.total_steps, fingerprint=self.fingerprint)
        with t._whole(t.optimizer):  # a checkpoint holds whole tensors; each rank keeps its slice
            rng_state = checkpoint.load_checkpoint_tensors(path, t.split.peft_model, t.optimizer, t.scheduler)
        checkpoint.restore_rng_state(rng_state, t.device)
        t.global_step = int(state["global_step"])
        if t.fleet_link is not None:
            t.fleet_link.resumed_state = state.get("fleet")
        with t._stats_lock:
            self.written_step = t.global_step
        eval_done_step = state.get("eval_done_step")
        self._last_saved = (t.global_step, eval_done_step)
        eval_owed = t.evals.resumed(t.global_step, eval_done_step)
        t._step = None
        t._last_loss = state.get("loss")
        with t._stats_lock:
            t._counters["samples_seen"] = int(state.get("samples_seen", 0))
            t._counters["tokens_seen"] = int(state.get("tokens_seen", 0))
        t._trainable_state_bytes = t._measure_trainable_state_bytes()
        if t.train_log is not None:
            t.train_log.resumed(path, t.global_step, drop_evaluation=eval_owed)
        return state

    def _progress_state(self, **position) -> dict:
        """The trainer's progress as a checkpoint's state records it (``position``: where
        in the data, for a checkpoint that resumes by itself)."""
        t = self.trainer
        with t._stats_lock:
            state = dict(samples_seen=t._counters["samples_seen"], tokens_seen=t._counters["tokens_seen"],
                         loss=t._last_loss)
        state.update(**position, micro_batch_size=t.micro_batch_size, total_steps=t.total_steps, job=self.fingerprint)
        return state

    def _write(self, step: int, rng_state, state: dict, text_files) -> Path:
        t = self.trainer
        path = checkpoint.save_checkpoint(
            t.output_dir, step, peft_model=t.split.peft_model, optimizer=t.optimizer, scheduler=t.scheduler,
            rng_state=rng_state, state=state, save_total_limit=self.save_total_limit, text_files=text_files,
            model_only=self.save_only_model)
        with t._stats_lock:
            self.written_step = step  # on disk now (written atomically)
        return path
