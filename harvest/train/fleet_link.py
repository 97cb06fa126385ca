"""A trainer's side of a fleet job (harvest.fleet.member.FleetMember).

Periodic sync: the trainer trains the global steps it claims, at each step's learning
rate, and the member's sync thread averages the LoRA weights between units
(`fleet_snapshot` / `fleet_apply`) and has the fleet's checkpoints written
(`fleet_checkpoint`). every_step: the trainer trains its shard of every step and the
member sums the gradients (in the optimizer unit); nothing here runs between units.
"""

from __future__ import annotations

from pathlib import Path

import torch


class FleetLink:
    """Holds a trainer (harvest.train.trainer.LayerSplitTrainer) and its fleet member;
    implements harvest.fleet.member.FleetTrainer for the member's sync thread. Calls
    from that thread take the trainer's unit lock: they land between units."""

    def __init__(self, trainer, member):
        self.trainer = trainer
        self.member = member
        self.periodic = not member.every_step
        self.resumed_state: dict | None = None  # the checkpoint's fleet state: the queue starts from it
        self.claimed: int | None = None  # periodic: the global step claimed for the next step
        self.steps_trained = 0  # by this member, this session
        self._unsynced_steps: list[int] = []  # periodic: global steps trained since the last round
        self._unsynced_tokens = 0

    # -- the trainer's thread ------------------------------------------------------------
    def join(self) -> None:
        """Join the fleet (run() starts with it); the fleet's rank 0 writes the files."""
        self.member.start(self, self.resumed_state)
        self.trainer.writes_files = self.member.rank == 0

    def leave(self) -> None:
        self.member.leave()

    def claim(self) -> bool:
        """Periodic: whether a step is in hand (in progress, or claimed now)."""
        trainer = self.trainer
        if self.claimed is not None or (trainer._step is not None and trainer._step.step == trainer.global_step):
            return True
        self.claimed = self.member.claim()
        return self.claimed is not None

    def take_claim(self) -> int:
        """Periodic: the claimed global step, for the step starting now."""
        data_step, self.claimed = self.claimed, None
        return data_step

    def step_trained(self, data_step: int, tokens: int) -> None:
        self.steps_trained += 1
        if self.periodic:
            self._unsynced_steps.append(data_step)
            self._unsynced_tokens += tokens

    def set_lr(self, data_step: int) -> None:
        """Periodic: the learning rate a one-process run has at ``data_step``."""
        optimizer, scheduler = self.trainer.optimizer, self.trainer.scheduler
        scheduler.last_epoch = data_step
        for group, base_lr, factor in zip(optimizer.param_groups, scheduler.base_lrs, scheduler.lr_lambdas):
            group["lr"] = base_lr * factor(data_step)
        scheduler._last_lr = [group["lr"] for group in optimizer.param_groups]

    def stats_view(self) -> dict:
        """A fleet member's stats; periodic: progress is the fleet's (committed steps plus
        this member's unsynced ones), not this member's step count."""
        view = self.member.stats()
        view["steps_trained"] = self.steps_trained
        if self.periodic:
            total = self.trainer.total_steps
            return dict(fleet=view, global_step=min(total, view["committed_steps"] + view["unsynced_steps"]))
        return dict(fleet=view)

    # -- the member's sync thread (FleetTrainer) --------------------------------------------
    def fleet_snapshot(self):
        """(LoRA weights as one host vector, tokens and global steps trained since the last
        call): between two units, so the weights are those after whole optimizer steps."""
        from harvest.fleet.averaging import flatten

        trainer = self.trainer
        with trainer._unit_lock:
            trainer._settle_device()
            steps, self._unsynced_steps = self._unsynced_steps, []
            tokens, self._unsynced_tokens = self._unsynced_tokens, 0
            return flatten(trainer.trainable_params), tokens, steps

    def fleet_apply(self, result, snapshot) -> None:
        """The round's weights, plus what this member trained since its snapshot."""
        from harvest.fleet.averaging import flatten, unflatten_into

        trainer = self.trainer
        with trainer._unit_lock, torch.no_grad():
            trainer._settle_device()
            unflatten_into(result + (flatten(trainer.trainable_params) - snapshot), trainer.trainable_params)
            trainer._updates_run += 1  # the fleet's update: weights no longer as loaded
            if trainer.device.type == "cuda":
                # The copies ran on this (the sync) thread's stream; the next unit runs on the
                # trainer's: done before the unit lock is let go.
                torch.cuda.current_stream(trainer.device).synchronize()

    def fleet_checkpoint(self, fleet_state: dict, final: bool) -> Path | None:
        """The fleet's checkpoint: `TrainerCheckpoints.save_fleet`."""
        return self.trainer.checkpoints.save_fleet(fleet_state, final)
