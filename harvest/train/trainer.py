"""The layer-split LoRA trainer: one optimizer step as a sequence of short, preemptible units.

A step with k micro-batches, grouped ``microbatches_per_pass`` at a time, runs for each
group: forward of every stage for each micro-batch of the group, then backward of every
trainable-or-above stage top-down, then (after the last group) one optimizer unit. Units
are run one at a time by `run_one_unit()` (the profiler drives it directly) or by `run()`,
which consults a `BaseGate` before each unit.

Between units nothing is in flight but kept tensors, so a paused trainer resumes exactly
where it stopped. A stop (or failure) checkpoints the state of the last completed step:
weights and optimizer change only in the optimizer unit, the RNG state is snapshotted at
every step start and the data position is the step number, so resuming redoes the
interrupted step exactly.
"""

from __future__ import annotations

import contextlib
import math
import threading
import time
from pathlib import Path
from typing import Any, Callable

import torch

from harvest.train import checkpoint
from harvest.train.data import StepBatches
from harvest.train.errors import TrainingDiverged, WindowMemoryUnavailable
from harvest.train.gate import BaseGate, GateAction, GateDecision
from harvest.train.split_model import MicroBatch, SplitCausalLM
from harvest.train.stats import TrainerStats, Unit, UnitKind, UnitRecord
from harvest.train.tensor_parallel import Vote
from harvest.train.window import WeightWindow


class _Step:
    def __init__(self, step: int, micro_batches: list[MicroBatch], plan: list[Unit], rng_state: dict,
                 data_step: int | None = None):
        self.step = step
        self.data_step = step if data_step is None else data_step  # whose samples and LR (a fleet's global step)
        self.fleet_loss: float | None = None  # every_step: the loss over every member's samples
        self.micro_batches = micro_batches
        self.plan = plan
        self.stage_sequence = [unit.stage for unit in plan if unit.kind != UnitKind.OPTIMIZER]
        self.cursor = 0
        self.num_label_tokens = sum(mb.num_label_tokens for mb in micro_batches)
        self.rng_state = rng_state
        self.losses: list[torch.Tensor] = []
        self.loss: float | None = None  # read from the device once, at the optimizer unit
        self.grad_norm: float | None = None


def order_after(stream, previous) -> None:
    """Make ``stream`` run after all work queued so far on ``previous`` (the trainer's last
    stream), on the device: the host does not wait.

    The trainer's streams (one per SM partition) carry only the trainer's work, and each
    switch orders the new stream after the last one, so all trainer work runs in one order
    as if on a single stream. That is what makes a tensor allocated on one stream and used
    or freed on another safe: its block goes back to its allocation stream's pool, and the
    next allocation from that pool is queued after everything before it."""
    if stream is not None and previous is not None and stream != previous:
        stream.wait_stream(previous)


class LayerSplitTrainer:
    def __init__(self, *, split: SplitCausalLM, window: WeightWindow, batches: StepBatches, optimizer, scheduler,
                 total_steps: int, micro_batch_size: int, device: torch.device, output_dir: Path | None,
                 microbatches_per_pass: int = 1, save_steps: int | None = None, save_total_limit: int | None = None,
                 max_grad_norm: float = 0.0, autocast_dtype: torch.dtype | None = None,
                 fingerprint: dict | None = None, record_device_events: bool = False, train_log=None,
                 save_only_model: bool = False, evaluation=None, sharded=None, fleet=None):
        self.split = split
        self.window = window
        self.batches = batches
        self.optimizer = optimizer
        self.scheduler = scheduler
        self.total_steps = total_steps
        self.micro_batch_size = micro_batch_size
        self.microbatches_per_pass = microbatches_per_pass
        self.device = torch.device(device)
        self.output_dir = Path(output_dir) if output_dir is not None else None
        self.save_steps = save_steps
        self.save_total_limit = save_total_limit
        self.max_grad_norm = max_grad_norm
        self.autocast_dtype = autocast_dtype
        self.fingerprint = fingerprint or {}
        self.train_log = train_log  # harvest.train.train_log.TrainLog: trainer_log.jsonl, trainer_state.json
        self.save_only_model = save_only_model
        self.evaluation = evaluation  # harvest.train.evaluation.Evaluation, or None: never evaluates
        # harvest.train.tensor_parallel.ShardedModel: this rank's shard of a tensor-parallel
        # trainer (its peers run the same units); None: the whole model here.
        self.sharded = sharded
        self.tp = sharded.tp if sharded is not None and sharded.tp.size > 1 else None
        self.writes_files = self.tp is None or self.tp.rank == 0  # checkpoints, the final adapter
        # harvest.fleet.member.FleetMember: this trainer is one member of a job many servers
        # train (periodic: it trains the global steps it claims; every_step: its share of each).
        self.fleet = fleet
        self._fleet_periodic = fleet is not None and not fleet.every_step
        self._claimed: int | None = None  # periodic: the global step claimed for the next step
        self._fleet_steps: list[int] = []  # periodic: global steps trained since the last round
        self._fleet_tokens = 0
        self._resumed_fleet_state: dict | None = None
        self._eval_owed = evaluation is not None and evaluation.due_after(0)  # eval_on_start
        self._eval_pass = None  # the evaluation in progress (harvest.train.evaluation.EvalPass)
        self._eval_done_step: int | None = None  # the step after which the last evaluation completed
        self._last_eval: dict[str, float] = {}
        self.eval_callbacks: list[Callable[[dict], None]] = []  # called with each evaluation's metrics
        self.record_device_events = record_device_events and self.device.type == "cuda"
        self.trainable_params = [p for p in split.causal_lm.parameters() if p.requires_grad]
        self.global_step = 0
        self._step: _Step | None = None
        self._last_saved_step: int | None = None
        self._last_saved_eval: int | None = None
        self._checkpoint_step: int | None = None  # stats().checkpoint_step: set once the write has completed
        self._in_optimizer_update = False
        self._updates_run = 0  # updates this trainer made (optimizer steps, fleet rounds)
        self._last_stream = None  # the CUDA stream the previous unit ran on
        self._pass_stages = split.pass_stages()
        self._unit_lock = threading.Lock()  # held while a unit runs; window changes take it too
        self._budget_generation = -1  # the lent-memory budget's generation the window last applied
        self._stats_lock = threading.Lock()
        self._state = "idle"
        self._counters = dict(samples_seen=0, tokens_seen=0, units_run=0, pauses=0, paused_s=0.0,
                              unit_s=0.0, session_tokens=0, load_wait_s=0.0, starved=0, fleet_steps=0)
        self._last_loss: float | None = None
        self._last_lr: float | None = None
        self._trainable_state_bytes = self._measure_trainable_state_bytes()
        self.step_callbacks: list[Callable[[dict], None]] = []  # called with each step's log entry

    # -- driving -------------------------------------------------------------------------
    @property
    def finished(self) -> bool:
        if self._fleet_periodic:
            return self.fleet.done  # an attribute: the decode thread's peek asks this
        return self.global_step >= self.total_steps and not self._evaluating

    @property
    def _evaluating(self) -> bool:
        return self._eval_owed or self._eval_pass is not None

    def next_unit(self) -> Unit | None:
        """The unit `run_one_unit()` would run next (None when training is finished)."""
        if self.finished:
            return None
        with self._unit_lock:
            if self._evaluating:
                return self._next_eval_unit()
            if self._step is None or self._step.step != self.global_step:
                # Not built here: building copies the micro-batches to the device, which must
                # happen on the trainer's stream, not the stream of whoever asks.
                return Unit(UnitKind.FORWARD, 0, 0)
            return self._step.plan[self._step.cursor]

    def peek_next_unit(self) -> Unit | None:
        """Like `next_unit()` but without the unit lock, so a caller on another thread (the
        decode step) never waits for the unit in flight. May be one unit stale while a unit
        is finishing; the scheduler only uses it to pick the stage-2 model and to tell
        whether the trainer is starved."""
        if self.finished:
            return None
        if self._evaluating:
            return self._next_eval_unit()
        step = self._step
        if step is None or step.step != self.global_step:
            return Unit(UnitKind.FORWARD, 0, 0)
        plan, cursor = step.plan, step.cursor
        return plan[cursor] if cursor < len(plan) else None

    def peek_next_unit_ready(self) -> bool:
        """Lock-free `next_unit_ready()` (see `peek_next_unit`)."""
        unit = self.peek_next_unit()
        return unit is None or unit.kind == UnitKind.OPTIMIZER or self.window.is_ready(unit.stage)

    def next_unit_ready(self) -> bool:
        """False while the next unit's stage is still being copied in (the trainer is starved)."""
        unit = self.next_unit()
        return unit is None or unit.kind == UnitKind.OPTIMIZER or self.window.is_ready(unit.stage)

    def run_one_unit(self, stream=None) -> UnitRecord | None:
        """Run exactly one unit on `stream` (CUDA; None = current stream) and describe it.
        Returns None when training is finished."""
        if self.finished:
            return None
        with self._unit_lock:
            if self.tp is None:  # tensor-parallel: followed before the vote (the stage stays resident)
                self._follow_lent_memory_locked()
            record = self._run_unit_locked(stream)
            self._follow_lent_memory_locked()  # memory wanted back leaves now, not a unit later
            return record

    def run(self, gate: BaseGate, on_unit: Callable[[UnitRecord], None] | None = None) -> str:
        """Run units until finished ("finished") or the gate says stop ("stopped",
        after a checkpoint). On an exception the trainer checkpoints when that is safe and
        re-raises.

        When the window lives in lent memory (its allocator has a ``budget``), the trainer
        follows that budget while it runs: at every unit boundary, and while parked at the
        gate (the budget wakes the gate). When it leaves, it releases the window first:
        nobody would be there to give lent memory back."""
        self._set_state("running")
        budget = self.window.allocator.budget
        unfollow = budget.follow(gate.wake) if budget is not None else None
        try:
            if self.fleet is not None:
                self.fleet.start(self, self._resumed_fleet_state)
                self.writes_files = self.fleet.rank == 0
            while not self.finished:
                decision = gate.acquire(while_parked=self._follow_lent_memory)
                if decision.was_paused:
                    with self._stats_lock:
                        self._counters["pauses"] += 1
                        self._counters["paused_s"] += decision.paused_s
                if self.tp is not None:
                    agreed = self._agree_on_unit(decision)
                    if agreed is Vote.WAIT:
                        with self._stats_lock:
                            self._counters["starved"] += 1
                        time.sleep(0.001)
                        continue
                    if agreed is Vote.STOP:
                        decision = GateDecision(GateAction.STOP)
                if decision.action == GateAction.STOP:
                    self.save_checkpoint()
                    self._set_state("stopped")
                    return "stopped"
                if self._fleet_periodic and not self._claim_fleet_step():
                    # Not joined yet, or every step is claimed and others still train theirs.
                    self._follow_lent_memory()
                    time.sleep(0.02)
                    continue
                try:
                    record = self.run_one_unit(decision.stream)
                except WindowMemoryUnavailable:
                    # Transient (decode holds the memory now): back off, ask the gate again.
                    with self._stats_lock:
                        self._counters["starved"] += 1
                    time.sleep(0.001)
                    continue
                gate.unit_done(record)
                if on_unit is not None:
                    on_unit(record)
                time.sleep(0)  # a unit boundary: let a co-located decode thread take the GIL
        except BaseException:
            self._set_state("failed")
            # A tensor-parallel checkpoint is collective: with a rank gone, the last one stands.
            if not self._in_optimizer_update and self.global_step > 0 and self.tp is None:
                with contextlib.suppress(Exception):
                    self.save_checkpoint()
            raise
        finally:
            if self.fleet is not None:
                with contextlib.suppress(Exception):
                    self.fleet.leave()
            if self.train_log is not None:
                with contextlib.suppress(Exception):
                    self.train_log.end()  # flush the log's writer
            if unfollow is not None:
                try:
                    with contextlib.suppress(Exception):  # what stays held, the memory side reports
                        self.release_window()
                finally:
                    unfollow()
        self._set_state("finished")
        return "finished"

    def _agree_on_unit(self, decision) -> "Vote":
        """Tensor-parallel: this rank's vote (stop, wait: its window cannot hold the next
        unit's stage yet, run), and the ranks' agreement. The stage is made resident
        before voting to run, so no rank falls out of a unit its peers are in."""
        if decision.action == GateAction.STOP:
            vote = Vote.STOP
        else:
            vote = Vote.RUN if self._prepare_next_unit() else Vote.WAIT
        return self.tp.agree(vote, while_waiting=self._follow_lent_memory)

    def _prepare_next_unit(self) -> bool:
        with self._unit_lock:
            self._follow_lent_memory_locked()
            unit = self.peek_next_unit()
            if unit is None or unit.kind == UnitKind.OPTIMIZER or unit.stage < 0:
                return True
            try:
                self.window.prepare(unit.stage, iter(self._pass_stages), self._compute_stream(self._last_stream))
            except WindowMemoryUnavailable:
                return False
            return True

    # -- fleet ---------------------------------------------------------------------------------
    def _claim_fleet_step(self) -> bool:
        """Periodic fleet: whether a step is in hand (in progress, or claimed now)."""
        if self._claimed is not None or (self._step is not None and self._step.step == self.global_step):
            return True
        self._claimed = self.fleet.claim()
        return self._claimed is not None

    def fleet_snapshot(self):
        """(LoRA weights as one host vector, tokens and global steps trained since the last
        call): between two units, so the weights are those after whole optimizer steps."""
        from harvest.fleet.averaging import flatten

        with self._unit_lock:
            self._settle_device()
            steps, self._fleet_steps = self._fleet_steps, []
            tokens, self._fleet_tokens = self._fleet_tokens, 0
            return flatten(self.trainable_params), tokens, steps

    def fleet_apply(self, result, snapshot) -> None:
        """The round's weights, plus what this member trained since its snapshot."""
        from harvest.fleet.averaging import flatten, unflatten_into

        with self._unit_lock, torch.no_grad():
            self._settle_device()
            unflatten_into(result + (flatten(self.trainable_params) - snapshot), self.trainable_params)
            self._updates_run += 1  # the fleet's update: weights no longer as loaded
            if self.device.type == "cuda":
                # The copies ran on this (the sync) thread's stream; the next unit runs on the
                # trainer's: done before the unit lock is let go.
                torch.cuda.current_stream(self.device).synchronize()

    def fleet_checkpoint(self, fleet_state: dict, final: bool) -> Path | None:
        """The fleet's checkpoint (this member wrote the round's weights first): named by
        the fleet's committed steps; ``final``: the finished job's adapter too."""
        if self.output_dir is None:
            return None
        step = sum(last - first + 1 for first, last in fleet_state["committed_steps"])
        with self._unit_lock:
            self._settle_device()
            with self._stats_lock:
                state = dict(samples_seen=self._counters["samples_seen"], tokens_seen=self._counters["tokens_seen"],
                             loss=self._last_loss)
            state.update(micro_batch_size=self.micro_batch_size, total_steps=self.total_steps, job=self.fingerprint,
                         fleet=fleet_state, eval_done_step=None)
            path = checkpoint.save_checkpoint(
                self.output_dir, step, peft_model=self.split.peft_model, optimizer=self.optimizer,
                scheduler=self.scheduler, rng_state=checkpoint.capture_rng_state(self.device), state=state,
                save_total_limit=self.save_total_limit, model_only=self.save_only_model)
            with self._stats_lock:
                self._checkpoint_step = step
            if final:
                checkpoint.write_final_adapter(self.output_dir, self.split.peft_model)
        return path

    def _settle_device(self) -> None:
        if self._last_stream is not None:
            self._last_stream.synchronize()  # another thread reads or writes the weights next

    def _set_fleet_lr(self, data_step: int) -> None:
        """Periodic fleet: the learning rate a one-process run has at ``data_step``."""
        self.scheduler.last_epoch = data_step
        for group, base_lr, factor in zip(self.optimizer.param_groups, self.scheduler.base_lrs,
                                          self.scheduler.lr_lambdas):
            group["lr"] = base_lr * factor(data_step)
        self.scheduler._last_lr = [group["lr"] for group in self.optimizer.param_groups]

    # -- window ----------------------------------------------------------------------------
    def set_window_stages(self, num_stages: int) -> int:
        """Change W between units (waits for the running unit, at most one). Shrinking frees
        memory before returning; growing takes effect as the next units run. Returns the
        bytes the window holds afterwards."""
        with self._unit_lock:
            self.window.set_capacity(num_stages)
            return self.window.held_bytes

    def _follow_lent_memory(self) -> None:
        """Apply the lent-memory budget now (the trainer thread, parked at its gate)."""
        with self._unit_lock:
            self._follow_lent_memory_locked()

    def _follow_lent_memory_locked(self) -> None:
        """Under the unit lock: fit the window to the latest published budget, once per
        generation. W becomes the most stages whose worst case fits ``limit_bytes``; if the
        memory wanted back is still not free as whole chunks (the window's buffers straddle
        them), the window empties (the next unit loads its stage again). Then acknowledge:
        an urgent reclaim waits for exactly that."""
        allocator = self.window.allocator
        budget = allocator.budget
        if budget is None:
            return
        snapshot = budget.snapshot
        if snapshot.generation == self._budget_generation:
            return
        stages = self.window.capacity_for_bytes(snapshot.limit_bytes)
        if stages >= 1 and stages != self.window.capacity:
            self.window.set_capacity(stages)
        if snapshot.wanted_back_bytes and allocator.reclaimable_bytes() < snapshot.wanted_back_bytes:
            self.window.evict_all()
        self._budget_generation = snapshot.generation
        budget.acknowledge(snapshot.generation)

    @property
    def holds_lent_window(self) -> bool:
        """Its frozen-weight window lives in lent KV memory (it follows the lending budget)."""
        return self.window.allocator.budget is not None

    def release_window(self) -> int:
        """Free all of the window's memory between units (a unit that needs a stage loads it
        again). Returns the bytes the window holds afterwards (0 unless weights are shared)."""
        with self._unit_lock:
            self.window.evict_all()
            return self.window.held_bytes

    # -- checkpoints -----------------------------------------------------------------------
    def save_checkpoint(self) -> Path | None:
        """Checkpoint the state of the last completed step (mid-step work is redone on
        resume). Returns its path, or None when there is nothing to save."""
        if self.output_dir is None or self.global_step == 0 or self._fleet_periodic:
            return None  # a periodic fleet member's checkpoints are the fleet's (fleet_checkpoint)
        if self._last_saved_step == self.global_step and self._last_saved_eval == self._eval_done_step:
            return self.output_dir / f"checkpoint-{self.global_step}"
        rng_state = self._step.rng_state if self._step is not None else checkpoint.capture_rng_state(self.device)
        epoch, offset = self.batches.position(self.global_step)
        with self._stats_lock:
            state = dict(samples_seen=self._counters["samples_seen"], tokens_seen=self._counters["tokens_seen"],
                         loss=self._last_loss)
        state.update(epoch=epoch, sample_offset=offset, micro_batch_size=self.micro_batch_size,
                     total_steps=self.total_steps, job=self.fingerprint, eval_done_step=self._eval_done_step)
        text_files = {"trainer_state.json": self.train_log.state_json()} if self.train_log is not None else None
        path = self.output_dir / f"checkpoint-{self.global_step}"
        with self._whole(self.optimizer):  # tensor-parallel: what a tp = 1 run writes, by rank 0
            if self.writes_files:
                path = checkpoint.save_checkpoint(
                    self.output_dir, self.global_step, peft_model=self.split.peft_model, optimizer=self.optimizer,
                    scheduler=self.scheduler, rng_state=rng_state, state=state,
                    save_total_limit=self.save_total_limit, text_files=text_files, model_only=self.save_only_model)
                with self._stats_lock:
                    self._checkpoint_step = self.global_step  # on disk now (written atomically)
        if self.tp is not None:
            # No rank returns before rank 0's write is on disk: a rank whose process stops
            # next cannot take the server (and rank 0's write) down half-way.
            with self._stats_lock:
                mine = -1 if self._checkpoint_step is None else self._checkpoint_step
            written = int(self.tp.max_float(float(mine)))
            with self._stats_lock:
                self._checkpoint_step = written if written >= 0 else None
        self._last_saved_step, self._last_saved_eval = self.global_step, self._eval_done_step
        if self.train_log is not None:
            self.train_log.saved()
        return path

    def resume_from(self, path: Path) -> dict[str, Any]:
        """Load a checkpoint (verified first by `checkpoint.check_resumable`, as build_trainer
        already did before the model loaded) into this trainer."""
        state = checkpoint.check_resumable(path, total_steps=self.total_steps, fingerprint=self.fingerprint)
        with self._whole(self.optimizer):  # a checkpoint holds whole tensors; each rank keeps its slice
            rng_state = checkpoint.load_checkpoint_tensors(path, self.split.peft_model, self.optimizer, self.scheduler)
        checkpoint.restore_rng_state(rng_state, self.device)
        self.global_step = int(state["global_step"])
        self._resumed_fleet_state = state.get("fleet")
        self._last_saved_step = self.global_step
        with self._stats_lock:
            self._checkpoint_step = self.global_step
        self._eval_done_step = self._last_saved_eval = state.get("eval_done_step")
        # An evaluation due after this step that had not completed when it was saved runs again.
        self._eval_owed = (self.evaluation is not None and self.evaluation.due_after(self.global_step)
                           and self._eval_done_step != self.global_step)
        self._eval_pass = None
        self._step = None
        self._last_loss = state.get("loss")
        with self._stats_lock:
            self._counters["samples_seen"] = int(state.get("samples_seen", 0))
            self._counters["tokens_seen"] = int(state.get("tokens_seen", 0))
        self._trainable_state_bytes = self._measure_trainable_state_bytes()
        if self.train_log is not None:
            self.train_log.resumed(path, self.global_step, drop_evaluation=self._eval_owed)
        return state

    def _whole(self, optimizer=None):
        return self.sharded.whole(optimizer) if self.tp is not None else contextlib.nullcontext()

    # -- inspection ------------------------------------------------------------------------
    def stats(self) -> TrainerStats:
        with self._stats_lock:
            c = dict(self._counters)
            state, loss, lr, checkpoint_step = self._state, self._last_loss, self._last_lr, self._checkpoint_step
            global_step = self.global_step
        window_bytes = self.window.held_bytes
        return TrainerStats(**{
            "global_step": global_step, **self._fleet_view()}, state=state, total_steps=self.total_steps,
            samples_seen=c["samples_seen"], tokens_seen=c["tokens_seen"], loss=loss, learning_rate=lr,
            tokens_per_s=c["session_tokens"] / c["unit_s"] if c["unit_s"] > 0 else 0.0,
            units_run=c["units_run"], pauses=c["pauses"], paused_s=c["paused_s"],
            window_stages=self.window.capacity, window_bytes=window_bytes,
            resident_bytes=window_bytes + self._trainable_state_bytes,
            micro_batch_size=self.micro_batch_size, load_wait_s=c["load_wait_s"], starved=c["starved"],
            eval_loss=next(iter(self._last_eval.values()), None), checkpoint_step=checkpoint_step,
            compile=self.split.compiled.status())

    def _fleet_view(self) -> dict:
        """A fleet member's stats; periodic: progress is the fleet's (committed steps plus
        this member's unsynced ones), not this member's step count."""
        if self.fleet is None:
            return {}
        view = self.fleet.stats()
        with self._stats_lock:
            view["steps_trained"] = self._counters["fleet_steps"]  # by this member, this session
        if self._fleet_periodic:
            return dict(fleet=view, global_step=min(self.total_steps, view["committed_steps"] + view["unsynced_steps"]))
        return dict(fleet=view)

    def logits(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        """Inference logits of the current model (base + adapter), through the window."""
        with self._unit_lock:
            order = list(range(self.split.num_stages))

            def prepare(stage):
                self.window.prepare(stage, iter(order[stage + 1:] + order), self._compute_stream(None))

            model = self.split.peft_model
            was_training = model.training
            model.eval()  # no LoRA dropout
            try:
                with self._autocast():
                    return self.split.logits(input_ids.to(self.device), attention_mask.to(self.device), prepare)
            finally:
                model.train(was_training)

    def close(self) -> None:
        with self._unit_lock:
            self._step = None
            self.window.close()
        if self.train_log is not None:
            self.train_log.end()

    # -- internals ---------------------------------------------------------------------------
    def _current_step(self) -> _Step:
        if self._step is None or self._step.step != self.global_step:
            rng_state = checkpoint.capture_rng_state(self.device)
            data_step, shard = self.global_step, None
            if self._fleet_periodic:
                data_step, self._claimed = self._claimed, None
            elif self.fleet is not None:
                shard = (self.fleet.rank, self.fleet.size)
            micro_batches = self.batches.micro_batches(data_step, self.micro_batch_size, self.device, shard=shard)
            self._step = _Step(self.global_step, micro_batches, self._plan(len(micro_batches)), rng_state, data_step)
        return self._step

    def _plan(self, num_micro_batches: int) -> list[Unit]:
        plan = []
        for first in range(0, num_micro_batches, self.microbatches_per_pass):
            group = range(first, min(first + self.microbatches_per_pass, num_micro_batches))
            plan += [Unit(UnitKind.FORWARD, s, mb) for s in range(self.split.num_stages) for mb in group]
            plan += [Unit(UnitKind.BACKWARD, s, mb) for s in self.split.backward_stages() for mb in group]
        return plan + [Unit(UnitKind.OPTIMIZER, -1, -1)]

    def _run_unit_locked(self, stream) -> UnitRecord:
        compute_stream = self._compute_stream(stream)
        order_after(compute_stream, self._last_stream)
        self._last_stream = compute_stream
        events = None
        if self.record_device_events:
            events = (torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))
        started = time.perf_counter()
        load_s, num_tokens = 0.0, 0
        if self._evaluating:
            return self._run_eval_unit_locked(compute_stream, events)
        with torch.cuda.stream(compute_stream) if compute_stream is not None else contextlib.nullcontext():
            step = self._current_step()
            unit = step.plan[step.cursor]
            if unit.kind == UnitKind.OPTIMIZER:
                if events:
                    events[0].record()
                self._optimizer_unit(step)
            else:
                upcoming = (step.stage_sequence[i] for i in range(step.cursor + 1, len(step.stage_sequence)))
                load_s = self.window.prepare(unit.stage, _chain(upcoming, self._pass_stages), compute_stream)
                if events:
                    events[0].record()  # after the wait for the stage's copy: device time is compute only
                mb = step.micro_batches[unit.micro_batch]
                num_tokens = mb.num_tokens
                if unit.kind == UnitKind.FORWARD:
                    with self.window.saved_tensor_hooks(), self._autocast():
                        self.split.forward(unit.stage, mb, step.num_label_tokens)
                    if unit.stage == self.split.head_stage:
                        step.losses.append(mb.loss)
                else:
                    self.split.backward(unit.stage, mb)
            if events:
                events[1].record()
        elapsed = time.perf_counter() - started
        step.cursor += 1
        with self._stats_lock:
            self._counters["units_run"] += 1
            self._counters["unit_s"] += elapsed
            self._counters["load_wait_s"] += load_s
        if unit.kind == UnitKind.OPTIMIZER:
            self._finish_step(step)
        return UnitRecord(step.step, unit.kind, unit.stage,
                          "optimizer" if unit.stage < 0 else self.split.stage_names[unit.stage],
                          unit.micro_batch, num_tokens, elapsed * 1e3, load_s * 1e3, events)

    def _optimizer_unit(self, step: _Step) -> None:
        clip = bool(self.max_grad_norm and self.max_grad_norm > 0)
        # One process's gradients (no every-step fleet, no tensor parallelism): the norm is
        # computed, and the gradients clipped, before the loss is checked, so a single read
        # of the device brings both (a non-finite loss still raises before the update).
        local = self.tp is None and (self.fleet is None or self._fleet_periodic)
        loss_on_device = torch.stack(step.losses).sum().float() if step.losses else None
        norm_on_device = (torch.nn.utils.clip_grad_norm_(self.trainable_params, self.max_grad_norm)
                          if local and clip else None)
        if loss_on_device is None:
            loss = 0.0
        elif norm_on_device is None:
            loss = float(loss_on_device)
        else:
            loss, step.grad_norm = torch.stack([loss_on_device, norm_on_device.float()]).tolist()
        step.loss = loss
        if not math.isfinite(loss):
            # Before the update: the weights stay those of the last good step, which is what
            # run() checkpoints on the way out.
            if step.step == 0 and self._updates_run == 0:
                # No update ever: the rate cannot be the cause. (After a resume the last
                # run's update may be, so that case keeps the learning_rate message.)
                raise TrainingDiverged(
                    f"model_name_or_path: step 1 has a non-finite loss ({loss}) before any weight was updated, so "
                    f"not because of learning_rate: the model as loaded gives it on this data (check the base "
                    f"model's weights and dtype, the adapter it starts from, and the data)")
            raise TrainingDiverged(
                f"learning_rate: step {step.step + 1} has a non-finite loss ({loss}); training stopped before "
                f"the update, the checkpoint keeps step {step.step} (lower learning_rate, or check the data)")
        self._in_optimizer_update = True
        if self.fleet is not None and not self._fleet_periodic:
            step.fleet_loss, _ = self.fleet.sum_gradients(self.trainable_params, step.num_label_tokens, loss)
        if self._fleet_periodic:
            self._set_fleet_lr(step.data_step)
        if self.tp is not None:
            self.sharded.sum_replicated_gradients()
        if clip and not local:
            if self.tp is not None:
                step.grad_norm = self.sharded.clip_grad_norm(self.trainable_params, self.max_grad_norm)
            else:
                step.grad_norm = float(torch.nn.utils.clip_grad_norm_(self.trainable_params, self.max_grad_norm))
        self._last_lr = float(self.scheduler.get_last_lr()[0])
        self.optimizer.step()
        self._updates_run += 1
        if not self._fleet_periodic:  # a fleet member sets the claimed step's rate itself
            self.scheduler.step()
        self.optimizer.zero_grad(set_to_none=True)
        self._in_optimizer_update = False

    def _finish_step(self, step: _Step) -> None:
        loss = step.loss if step.losses else float("nan")
        if step.fleet_loss is not None:
            loss = step.fleet_loss
        tokens = sum(mb.num_tokens for mb in step.micro_batches)
        samples = sum(mb.input_ids.shape[0] for mb in step.micro_batches)
        self._step = None
        with self._stats_lock:  # the step and its counts change together for stats()
            self.global_step += 1
            self._last_loss = loss
            self._counters["samples_seen"] += samples
            self._counters["tokens_seen"] += tokens
            self._counters["session_tokens"] += tokens
        if step.step == 0:
            self._trainable_state_bytes = self._measure_trainable_state_bytes()  # AdamW state now exists
        if self.fleet is not None:
            with self._stats_lock:
                self._counters["fleet_steps"] += 1
        if self._fleet_periodic:
            self._fleet_steps.append(step.data_step)
            self._fleet_tokens += tokens
        entry = dict(step=self.global_step, loss=loss, learning_rate=self._last_lr, grad_norm=step.grad_norm,
                     tokens=tokens, samples=samples, tokens_seen=self._counters["tokens_seen"],
                     epoch=round(self.global_step / self.batches.steps_per_epoch, 4), time=time.time())
        if self.train_log is not None:
            self.train_log.step_done(entry)
        for callback in self.step_callbacks:
            callback(entry)
        due = self.save_steps and self.global_step % self.save_steps == 0
        if (due or self.global_step >= self.total_steps) and not self._fleet_periodic:
            self.save_checkpoint()
        if self.evaluation is not None and self.evaluation.due_after(self.global_step):
            self._eval_owed = True  # its units run before the next step's
        self._finalize_if_done()

    def _finalize_if_done(self) -> None:
        if self.finished and self.output_dir is not None and not self._fleet_periodic:
            with self._whole():
                if self.writes_files:
                    checkpoint.write_final_adapter(self.output_dir, self.split.peft_model)
            if self.train_log is not None:
                self.train_log.finished()

    # -- evaluation --------------------------------------------------------------------------
    def _next_eval_unit(self) -> Unit:
        eval_pass = self._eval_pass
        if eval_pass is None:
            return Unit(UnitKind.EVAL, 0, 0)  # built by the unit itself, on the trainer's stream
        plan, cursor = eval_pass.plan, eval_pass.cursor
        # A lock-free peek (the decode thread) can land between the last unit's cursor
        # step and the pass's end: the pass's last unit stands for it.
        return plan[min(cursor, len(plan) - 1)]

    def _run_eval_unit_locked(self, compute_stream, events) -> UnitRecord:
        started = time.perf_counter()
        with torch.cuda.stream(compute_stream) if compute_stream is not None else contextlib.nullcontext():
            if self._eval_pass is None:
                self._eval_pass = self.evaluation.new_pass(self.split.num_stages, self.device)
                self._eval_owed = False
            eval_pass = self._eval_pass
            unit = eval_pass.plan[eval_pass.cursor]
            upcoming = (u.stage for u in eval_pass.plan[eval_pass.cursor + 1:])
            load_s = self.window.prepare(unit.stage, _chain(upcoming, self._pass_stages), compute_stream)
            if events:
                events[0].record()
            mb = eval_pass.micro_batch(unit.micro_batch)
            model = self.split.peft_model
            was_training = model.training
            model.eval()  # no LoRA dropout, as the Hugging Face Trainer evaluates
            try:
                with self._autocast():
                    self.split.evaluate(unit.stage, mb)
            finally:
                model.train(was_training)
            if unit.stage == self.split.head_stage:
                eval_pass.head_done(unit.micro_batch)
            if events:
                events[1].record()
        eval_pass.cursor += 1
        elapsed = time.perf_counter() - started
        with self._stats_lock:
            self._counters["units_run"] += 1
            self._counters["load_wait_s"] += load_s
        if eval_pass.done:
            self._finish_eval(eval_pass)
        return UnitRecord(self.global_step, unit.kind, unit.stage, self.split.stage_names[unit.stage],
                          unit.micro_batch, mb.num_tokens, elapsed * 1e3, load_s * 1e3, events)

    def _finish_eval(self, eval_pass) -> None:
        metrics = eval_pass.metrics()
        self._eval_pass = None
        self._eval_done_step = self.global_step
        self._last_eval = metrics
        if self.train_log is not None:
            self.train_log.log(metrics)
        entry = {**metrics, "step": self.global_step}
        for callback in self.eval_callbacks:
            callback(entry)
        self._finalize_if_done()

    def _compute_stream(self, stream):
        if self.device.type != "cuda":
            return None
        return stream if stream is not None else torch.cuda.current_stream(self.device)

    def _autocast(self):
        if self.autocast_dtype is None:
            return contextlib.nullcontext()
        return torch.autocast(self.device.type, dtype=self.autocast_dtype)

    def _set_state(self, state: str) -> None:
        with self._stats_lock:
            self._state = state

    def _measure_trainable_state_bytes(self) -> int:
        # Parameters plus their gradients (present during every step), plus AdamW's state.
        total = sum(2 * p.numel() * p.element_size() for p in self.trainable_params)
        for state in self.optimizer.state.values():
            total += sum(v.numel() * v.element_size() for v in state.values() if torch.is_tensor(v))
        return total


def _chain(first, second):
    yield from first
    yield from second
