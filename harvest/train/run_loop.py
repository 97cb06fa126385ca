"""The trainer's run loop: units one at a time, each let through by a gate.

Before each unit the loop asks the gate (``BaseGate.acquire``: run now, on which stream,
or stop); tensor-parallel ranks then agree on one outcome for all of them; a periodic
fleet member first claims the global step it trains. While parked at the gate, the
trainer keeps following its lent-memory budget.
"""

from __future__ import annotations

import contextlib
import time
from typing import Callable

from harvest.train.errors import WindowMemoryUnavailable
from harvest.train.gate import BaseGate, GateAction, GateDecision
from harvest.train.stats import UnitKind, UnitRecord
from harvest.train.tensor_parallel import Vote


def run(trainer, gate: BaseGate, on_unit: Callable[[UnitRecord], None] | None = None) -> str:
    """Run ``trainer``'s units (harvest.train.trainer.LayerSplitTrainer) until finished
    ("finished") or the gate says stop ("stopped", after a checkpoint). On an exception
    the trainer checkpoints when that is safe and re-raises.

    When the window lives in lent memory (its allocator has a ``budget``), the trainer
    follows that budget while it runs: at every unit boundary, and while parked at the
    gate (the budget wakes the gate). When it leaves, it releases the window first:
    nobody would be there to give lent memory back."""
    trainer._set_state("running")
    follower = trainer.window_follower
    budget = trainer.window.allocator.budget
    unfollow = budget.follow(gate.wake) if budget is not None else None
    try:
        if trainer.fleet_link is not None:
            trainer.fleet_link.join()
        while not trainer.finished:
            decision = gate.acquire(while_parked=follower.follow)
            if decision.was_paused:
                with trainer._stats_lock:
                    trainer._counters["pauses"] += 1
                    trainer._counters["paused_s"] += decision.paused_s
            if trainer.tp is not None:
                agreed = _agree_on_unit(trainer, decision)
                if agreed is Vote.WAIT:
                    with trainer._stats_lock:
                        trainer._counters["starved"] += 1
                    time.sleep(0.001)
                    continue
                if agreed is Vote.STOP:
                    decision = GateDecision(GateAction.STOP)
            if decision.action == GateAction.STOP:
                trainer.save_checkpoint()
                trainer._set_state("stopped")
                return "stopped"
            if trainer._fleet_periodic and not trainer.fleet_link.claim():
                # Not joined yet, or every step is claimed and others still train theirs.
                follower.follow()
                time.sleep(0.02)
                continue
            try:
                record = trainer.run_one_unit(decision.stream)
            except WindowMemoryUnavailable:
                # Transient (decode holds the memory now): back off, ask the gate again.
                with trainer._stats_lock:
                    trainer._counters["starved"] += 1
                time.sleep(0.001)
                continue
            gate.unit_done(record)
            if on_unit is not None:
                on_unit(record)
            time.sleep(0)  # a unit boundary: let a co-located decode thread take the GIL
    except BaseException:
        trainer._set_state("failed")
        # A tensor-parallel checkpoint is collective: with a rank gone, the last one stands.
        if not trainer._in_optimizer_update and trainer.global_step > 0 and trainer.tp is None:
            with contextlib.suppress(Exception):
                trainer.save_checkpoint()
        raise
    finally:
        if trainer.fleet_link is not None:
            with contextlib.suppress(Exception):
                trainer.fleet_link.leave()
        if trainer.train_log is not None:
            with contextlib.suppress(Exception):
                trainer.train_log.end()  # flush the log's writer
        if unfollow is not None:
            try:
                with contextlib.suppress(Exception):  # what stays held, the memory side reports
                    trainer.release_window()
            finally:
                unfollow()
    trainer._set_state("finished")
    return "finished"


def _agree_on_unit(trainer, decision: GateDecision) -> Vote:
    """Tensor-parallel: this rank's vote (stop, wait: its window cannot hold the next
    unit's stage yet, run), and the ranks' agreement. The stage is made resident
    before voting to run, so no rank falls out of a unit its peers are in."""
    if decision.action == GateAction.STOP:
        vote = Vote.STOP
    else:
        vote = Vote.RUN if _prepare_next_unit(trainer) else Vote.WAIT
    return trainer.tp.agree(vote, while_waiting=trainer.window_follower.follow)


def _prepare_next_unit(trainer) -> bool:
    with trainer._unit_lock:
        trainer.window_follower.follow_locked()
        unit = trainer.peek_next_unit()
        if unit is None or unit.kind == UnitKind.OPTIMIZER or unit.stage < 0:
            return True
        try:
            trainer.window.prepare(unit.stage, iter(trainer._pass_stages),
                                   trainer._compute_stream(trainer._last_stream))
        except WindowMemoryUnavailable:
            return False
        return True
