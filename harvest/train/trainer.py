"""The layer-split LoRA trainer: one optimizer step as a sequence of short, preemptible units.

A step runs, per group of ``microbatches_per_pass`` micro-batches, the forward of every
stage, then the backward of every trainable-or-above stage top-down, then (after the last
group) one optimizer unit. Units run one at a time, by `run_one_unit()` (the profiler) or
`run()` (harvest.train.run_loop, consulting a `BaseGate` before each unit). Invariants:
between units nothing is in flight but kept tensors, so a paused trainer resumes exactly
where it stopped; weights and optimizer change only in the optimizer unit, so a stop or
failure checkpoints the last completed step and resuming redoes the interrupted one
exactly. Its other concerns are parts sharing its state: ``checkpoints``, ``evals``,
``fleet_link``, ``window_follower``.
"""

from __future__ import annotations

import contextlib
import itertools
import math
import threading
import time
from pathlib import Path
from typing import Any, Callable

import torch

from harvest.compute.device import on_stream
from harvest.train import checkpoint, run_loop
from harvest.train.data import StepBatches
from harvest.train.errors import TrainingDiverged
from harvest.train.evaluation import EvalRunner
from harvest.train.fleet_link import FleetLink
from harvest.train.gate import BaseGate
from harvest.train.split_model import MicroBatch, SplitCausalLM
from harvest.train.stats import TrainerStats, Unit, UnitKind, UnitRecord
from harvest.train.trainer_checkpoint import TrainerCheckpoints
from harvest.train.window import WeightWindow
from harvest.train.window_follow import LentWindowFollower


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
    """The unit engine of one finetune job (built by harvest.train.build). Runs one unit at
    a time under ``_unit_lock``; every other thread's change to the window or the weights
    takes that lock too, so it lands between units. `stats()` and the `peek_*` methods
    are safe from any thread without waiting for a unit."""

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
        # How micro_batch_size was chosen (harvest.train.microbatch.UnitSizing.status; set by the build).
        self.unit_sizing: dict | None = None
        self.microbatches_per_pass = microbatches_per_pass
        self.device = torch.device(device)
        self.output_dir = Path(output_dir) if output_dir is not None else None
        self.max_grad_norm = max_grad_norm
        self.autocast_dtype = autocast_dtype
        self.train_log = train_log  # harvest.train.train_log.TrainLog: trainer_log.jsonl, trainer_state.json
        self.evaluation = evaluation  # harvest.train.evaluation.Evaluation, or None: never evaluates
        # harvest.train.tensor_parallel.ShardedModel: this rank's shard of a tensor-parallel
        # trainer (its peers run the same units); None: the whole model here.
        self.sharded = sharded
        self.tp = sharded.tp if sharded is not None and sharded.tp.size > 1 else None
        self.writes_files = self.tp is None or self.tp.rank == 0  # checkpoints, the final adapter
        # harvest.fleet.member.FleetMember: this trainer is one member of a job many servers
        # train (periodic: it trains the global steps it claims; every_step: its share of each).
        self.fleet = fleet
        self.fleet_link = FleetLink(self, fleet) if fleet is not None else None
        self._fleet_periodic = fleet is not None and not fleet.every_step
        self.record_device_events = record_device_events and self.device.type == "cuda"
        self.trainable_params = [p for p in split.causal_lm.parameters() if p.requires_grad]
        self.global_step = 0
        self._step: _Step | None = None
        self._in_optimizer_update = False
        self._updates_run = 0  # updates this trainer made (optimizer steps, fleet rounds)
        self._last_stream = None  # the CUDA stream the previous unit ran on
        self._pass_stages = split.pass_stages()
        self._unit_lock = threading.Lock()  # held while a unit runs; window changes take it too
        self._stats_lock = threading.Lock()
        self._state = "idle"
        self._counters = dict(samples_seen=0, tokens_seen=0, units_run=0, pauses=0, paused_s=0.0,
                              unit_s=0.0, session_tokens=0, load_wait_s=0.0, starved=0)
        self._last_loss: float | None = None
        self._last_lr: float | None = None
        self._trainable_state_bytes = self._measure_trainable_state_bytes()
        self.checkpoints = TrainerCheckpoints(self, save_steps=save_steps, save_total_limit=save_total_limit,
                                              save_only_model=save_only_model, fingerprint=fingerprint or {})
        self.evals = EvalRunner(self, evaluation)
        self.window_follower = LentWindowFollower(window, self._unit_lock)
        self.step_callbacks: list[Callable[[dict], None]] = []  # called with each step's log entry
        self.eval_callbacks: list[Callable[[dict], None]] = []  # called with each evaluation's metrics

    # -- driving -------------------------------------------------------------------------
    @property
    def finished(self) -> bool:
        if self._fleet_periodic:
            return self.fleet.done  # an attribute: the decode thread's peek asks this
        return self.global_step >= self.total_steps and not self.evals.in_progress

    def next_unit(self) -> Unit | None:
        """The unit `run_one_unit()` would run next (None when training is finished)."""
        if self.finished:
            return None
        with self._unit_lock:
            if self.evals.in_progress:
                return self.evals.next_unit()
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
        if self.evals.in_progress:
            return self.evals.next_unit()
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
                self.window_follower.follow_locked()
            record = self._run_unit_locked(stream)
            self.window_follower.follow_locked()  # memory wanted back leaves now, not a unit later
            return record

    def run(self, gate: BaseGate, on_unit: Callable[[UnitRecord], None] | None = None) -> str:
        """Run units until finished or the gate says stop: `harvest.train.run_loop.run`."""
        return run_loop.run(self, gate, on_unit)

    # -- the parts' operations, under the names callers use -------------------------------
    def save_checkpoint(self) -> Path | None:
        """`TrainerCheckpoints.save`: the last completed step's checkpoint."""
        return self.checkpoints.save()

    def resume_from(self, path: Path) -> dict[str, Any]:
        """`TrainerCheckpoints.resume`: load a checkpoint into this trainer."""
        return self.checkpoints.resume(path)

    def set_window_stages(self, num_stages: int) -> int:
        """`LentWindowFollower.set_stages`: change W between units."""
        return self.window_follower.set_stages(num_stages)

    def release_window(self) -> int:
        """`LentWindowFollower.release`: free the window's memory between units."""
        return self.window_follower.release()

    @property
    def holds_lent_window(self) -> bool:
        """Its frozen-weight window lives in lent KV memory (it follows the lending budget)."""
        return self.window_follower.holds_lent_window

    # -- inspection ------------------------------------------------------------------------
    def stats(self) -> TrainerStats:
        with self._stats_lock:
            c = dict(self._counters)
            state, loss, lr = self._state, self._last_loss, self._last_lr
            checkpoint_step, global_step = self.checkpoints.written_step, self.global_step
        fleet_view = self.fleet_link.stats_view() if self.fleet_link is not None else {}
        window_bytes = self.window.held_bytes
        return TrainerStats(**{
            "global_step": global_step, **fleet_view}, state=state, total_steps=self.total_steps,
            samples_seen=c["samples_seen"], tokens_seen=c["tokens_seen"], loss=loss, learning_rate=lr,
            tokens_per_s=c["session_tokens"] / c["unit_s"] if c["unit_s"] > 0 else 0.0,
            units_run=c["units_run"], pauses=c["pauses"], paused_s=c["paused_s"],
            window_stages=self.window.capacity, window_bytes=window_bytes,
            resident_bytes=window_bytes + self._trainable_state_bytes,
            micro_batch_size=self.micro_batch_size, load_wait_s=c["load_wait_s"], starved=c["starved"],
            eval_loss=next(iter(self.evals.last_metrics.values()), None), checkpoint_step=checkpoint_step,
            compile=self.split.compiled.status(), unit_sizing=self.unit_sizing)

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

    # -- the unit engine ---------------------------------------------------------------------
    def _current_step(self) -> _Step:
        if self._step is None or self._step.step != self.global_step:
            rng_state = checkpoint.capture_rng_state(self.device)
            data_step, shard = self.global_step, None
            if self._fleet_periodic:
                data_step = self.fleet_link.take_claim()
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
        if self.evals.in_progress:
            return self.evals.run_unit_locked(compute_stream, events)
        with on_stream(compute_stream):
            step = self._current_step()
            unit = step.plan[step.cursor]
            if unit.kind == UnitKind.OPTIMIZER:
                if events:
                    events[0].record()
                self._optimizer_unit(step)
            else:
                upcoming = (step.stage_sequence[i] for i in range(step.cursor + 1, len(step.stage_sequence)))
                load_s = self.window.prepare(unit.stage, itertools.chain(upcoming, self._pass_stages), compute_stream)
                if events:
                    events[0].record()  # after the wait for the stage's copy: device time is compute only
                mb = step.micro_batches[unit.micro_batch]
                num_tokens = mb.num_tokens
                if unit.kind == UnitKind.FORWARD:
                    with self.window.saved_tensor_hooks(weights_change_between_units=self.fleet is not None), \
                            self._autocast():
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
            raise TrainingDiverged.before_update(step.step, loss, first_update=step.step == 0 and self._updates_run == 0)
        self._in_optimizer_update = True
        if self.fleet is not None and not self._fleet_periodic:
            step.fleet_loss, _ = self.fleet.sum_gradients(self.trainable_params, step.num_label_tokens, loss)
        if self._fleet_periodic:
            self.fleet_link.set_lr(step.data_step)
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
        if self.fleet_link is not None:
            self.fleet_link.step_trained(step.data_step, tokens)
        entry = dict(step=self.global_step, loss=loss, learning_rate=self._last_lr, grad_norm=step.grad_norm,
                     tokens=tokens, samples=samples, tokens_seen=self._counters["tokens_seen"],
                     epoch=round(self.global_step / self.batches.steps_per_epoch, 4), time=time.time())
        if self.train_log is not None:
            self.train_log.step_done(entry)
        for callback in self.step_callbacks:
            callback(entry)
        if not self._fleet_periodic and self.checkpoints.due_after(self.global_step):
            self.save_checkpoint()
        self.evals.step_done(self.global_step)  # an evaluation due runs before the next step's units
        self._finalize_if_done()

    def _finalize_if_done(self) -> None:
        if self.finished and self.output_dir is not None and not self._fleet_periodic:
            with self._whole():
                if self.writes_files:
                    checkpoint.write_final_adapter(self.output_dir, self.split.peft_model)
            if self.train_log is not None:
                self.train_log.finished()

    def _compute_stream(self, stream):
        if self.device.type != "cuda":
            return None
        return stream if stream is not None else torch.cuda.current_stream(self.device)

    def _autocast(self):
        if self.autocast_dtype is None:
            return contextlib.nullcontext()
        return torch.autocast(self.device.type, dtype=self.autocast_dtype)

    def _whole(self, optimizer=None):
        return self.sharded.whole(optimizer) if self.tp is not None else contextlib.nullcontext()

    def _settle_device(self) -> None:
        if self._last_stream is not None:
            self._last_stream.synchronize()  # another thread reads or writes the weights next

    def _set_state(self, state: str) -> None:
        with self._stats_lock:
            self._state = state

    def _measure_trainable_state_bytes(self) -> int:
        # Parameters plus their gradients (present during every step), plus AdamW's state.
        total = sum(2 * p.numel() * p.element_size() for p in self.trainable_params)
        for state in self.optimizer.state.values():
            total += sum(v.numel() * v.element_size() for v in state.values() if torch.is_tensor(v))
        return total
