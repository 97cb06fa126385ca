"""The scheduling rule as pure functions: ``choose`` a decision for one decode step and
``advance`` the scheduler's state past it. Nothing here mutates anything, so the whole
policy can be replayed and tested step by step (query first, mutate second).

Harli's rule (§6.2): run the SM level whose predicted co-located latency is closest to,
but under, the QoS target; if none fits, pause the trainer and give decode the whole
device. harvest adds a feedback margin (``margin.py``), hysteresis on level changes QoS
does not require, a minimum-progress floor for a paused trainer and a backoff after
violations the margin could not absorb. A change QoS requires always happens at once.

Rules: docs/design.md §4, 'The scheduling rule (harvest/schedule/rule.py)'.
"""

from __future__ import annotations

import math

from harvest.ladder import Ladder
from harvest.schedule.scheduler_config import SchedulerConfig
from harvest.schedule.snapshots import (
    Decision,
    DecisionReason,
    SchedulerInput,
    SchedulerState,
    TrainerAction,
    TrainerState,
)

_RUN, _PAUSE = TrainerAction.RUN, TrainerAction.PAUSE
_FITS, _HOLD, _FLOOR, _NONE_FITS, _BACKOFF = (
    DecisionReason.FITS,
    DecisionReason.HYSTERESIS_HOLD,
    DecisionReason.FLOOR,
    DecisionReason.NONE_FITS,
    DecisionReason.QOS_BACKOFF,
)
_REASON_WHEN_TRAINER_CANNOT_RUN = {
    TrainerState.STARVED: DecisionReason.TRAINER_STARVED,
    TrainerState.PAUSED: DecisionReason.TRAINER_PAUSED,
    TrainerState.BUILDING: DecisionReason.NO_TRAINER,  # no trainer to run yet
    TrainerState.FINISHED: DecisionReason.TRAINER_STOPPED,
    TrainerState.STOPPED: DecisionReason.TRAINER_STOPPED,
    TrainerState.FAILED: DecisionReason.TRAINER_STOPPED,
    TrainerState.ABSENT: DecisionReason.NO_TRAINER,
}


def closest_under(ladder: Ladder, colo_ms: tuple[float, ...], budget_ms: float) -> int | None:
    """Harli's choice: the trainer level with the highest predicted latency ≤ ``budget_ms``,
    or None if none fits. Ties go to more trainer SMs, then the lower index. Predictions
    that are NaN, ±inf or ≤ 0 never fit (the chained comparison is False for them)."""
    trainer_sms = ladder.trainer_sms
    best, best_ms, best_sms = None, -math.inf, -1
    for level in ladder.trainer_levels:
        ms = colo_ms[level]
        if 0.0 < ms <= budget_ms and (ms > best_ms or (ms == best_ms and trainer_sms[level] > best_sms)):
            best, best_ms, best_sms = level, ms, trainer_sms[level]
    return best


def safest_under(ladder: Ladder, colo_ms: tuple[float, ...], budget_ms: float) -> int | None:
    """The floor's choice: the trainer level with the lowest predicted latency ≤
    ``budget_ms`` (the least QoS risk), or None. Ties as in :func:`closest_under`."""
    trainer_sms = ladder.trainer_sms
    best, best_ms, best_sms = None, math.inf, -1
    for level in ladder.trainer_levels:
        ms = colo_ms[level]
        if 0.0 < ms <= budget_ms and (ms < best_ms or (ms == best_ms and trainer_sms[level] > best_sms)):
            best, best_ms, best_sms = level, ms, trainer_sms[level]
    return best


def floor_budget_ms(config: SchedulerConfig, margin: float) -> float:
    """The floor's relaxed target: ``target × (1 − floor_margin)``, less what the feedback
    margin has learned above its initial value. The floor drops the headroom kept by
    default, not the measured under-prediction: co-located steps that ran over the target
    tighten the floor as they tighten the rule (else, with a predictor biased low, the
    floor's steps are the ones that violate)."""
    learned = margin - config.initial_margin
    return config.target_tpot_ms * (1.0 - config.floor_margin - learned)


def choose(
    config: SchedulerConfig, ladder: Ladder, state: SchedulerState, snapshot: SchedulerInput
) -> Decision:
    """The decision for the next decode step. Pure: raises ValueError on a snapshot that
    does not match the ladder, and changes nothing either way. A pause decision's level
    is the ladder's whole-device level."""
    colo = snapshot.predicted_colo_ms
    if len(colo) != len(ladder.trainer_sms):
        raise ValueError(
            f"SchedulerInput.predicted_colo_ms has {len(colo)} entries for a ladder of "
            f"{len(ladder.trainer_sms)} levels; give one prediction per level (NaN where there is none)"
        )
    margin = state.margin
    budget = config.target_tpot_ms * (1.0 - margin)
    trainer_state = snapshot.trainer_state
    if trainer_state is not TrainerState.RUNNING:
        # The class check refuses plain strings, which compare equal to str-valued enums.
        reason = None
        if trainer_state.__class__ is TrainerState:
            reason = _REASON_WHEN_TRAINER_CANNOT_RUN.get(trainer_state)
        if reason is None:
            raise ValueError(
                f"SchedulerInput.trainer_state={trainer_state!r}: must be a TrainerState "
                f"({', '.join(s.name for s in TrainerState)})"
            )
        return Decision(
            state.step, ladder.whole_device_index, _PAUSE, reason, margin, budget, snapshot.predicted_whole_device_ms
        )
    try:
        best = closest_under(ladder, colo, budget)
    except TypeError:
        raise ValueError(
            f"SchedulerInput.predicted_colo_ms={colo!r}: every entry must be a number "
            "(NaN where there is no prediction)"
        ) from None

    if state.step < state.backoff_until:
        return Decision(
            state.step, ladder.whole_device_index, _PAUSE, _BACKOFF, margin, budget, snapshot.predicted_whole_device_ms
        )
    if best is None:
        return _floor_or_pause(config, ladder, state, snapshot, budget, _NONE_FITS)
    reference = state.reference_level
    if best == reference:
        return Decision(state.step, best, _RUN, _FITS, margin, budget, colo[best])
    if reference is None:
        # Resuming after a QoS pause: wait out the hysteresis, so a load hovering at the
        # threshold does not pause and resume the trainer on alternate steps.
        if state.hold_streak + 1 >= config.hysteresis_steps:
            return Decision(state.step, best, _RUN, _FITS, margin, budget, colo[best])
        return _floor_or_pause(config, ladder, state, snapshot, budget, _HOLD)
    reference_ms = colo[reference]
    if not 0.0 < reference_ms <= budget:
        # QoS first: the level in force is predicted over budget, move now.
        return Decision(state.step, best, _RUN, _FITS, margin, budget, colo[best])
    gain = config.hysteresis_gain
    if state.hold_streak + 1 >= config.hysteresis_steps or (
        gain is not None and colo[best] - reference_ms >= gain * config.target_tpot_ms
    ):
        return Decision(state.step, best, _RUN, _FITS, margin, budget, colo[best])
    return Decision(state.step, reference, _RUN, _HOLD, margin, budget, reference_ms)


def _floor_or_pause(
    config: SchedulerConfig,
    ladder: Ladder,
    state: SchedulerState,
    snapshot: SchedulerInput,
    budget: float,
    reason: DecisionReason,
) -> Decision:
    """Pause a runnable trainer for ``reason`` — unless it has been paused long enough for
    the floor and some level predicts under the floor's relaxed target."""
    after = config.floor_after_paused_steps
    if after is not None and state.paused_steps >= after:
        floor_budget = floor_budget_ms(config, state.margin)
        level = safest_under(ladder, snapshot.predicted_colo_ms, floor_budget)
        if level is not None:
            return Decision(
                state.step, level, _RUN, _FLOOR, state.margin, floor_budget, snapshot.predicted_colo_ms[level]
            )
    return Decision(
        state.step, ladder.whole_device_index, _PAUSE, reason, state.margin, budget, snapshot.predicted_whole_device_ms
    )


def advance(state: SchedulerState, decision: Decision) -> SchedulerState:
    """The state after ``decision`` was applied (the margin and the backoff change only
    with measurements, see :mod:`harvest.schedule.margin`)."""
    reason, step = decision.reason, state.step + 1
    margin, until, length = state.margin, state.backoff_until, state.backoff_length
    if reason is _FITS or reason is _FLOOR:
        return SchedulerState(step, decision.level_index, 0, 0, margin, until, length)
    if reason is _HOLD:
        paused_steps = state.paused_steps + 1 if decision.trainer_action is _PAUSE else 0
        return SchedulerState(step, state.reference_level, state.hold_streak + 1, paused_steps, margin, until, length)
    if reason is _NONE_FITS:
        return SchedulerState(step, None, 0, state.paused_steps + 1, margin, until, length)
    if reason is _BACKOFF:
        # Like a QoS pause, but the floor's count starts afresh when the backoff ends: the
        # floor's steps are the riskiest, the last thing to run right after one.
        return SchedulerState(step, None, 0, 0, margin, until, length)
    # The trainer could not run: neither a QoS pause nor progress, so the hysteresis and
    # floor counters stand still and the trainer returns to its level when it can.
    return SchedulerState(step, state.reference_level, state.hold_streak, state.paused_steps, margin, until, length)
