"""The feedback margin: how a measured step moves the headroom the rule keeps.

The predictor is wrong sometimes (Harli (arXiv:2511.11729) §8.4: stage 2 within 5% on average, more on
unseen loads, and a Python trainer thread adds GIL noise the profile never saw). A
measured violation of a co-located step adds ``margin_growth``; a co-located step within
target removes ``margin_decay``; the margin stays within [initial_margin, max_margin].

Additive steps, not a jump to the margin that would have avoided the violation: a single
outlier (a GC pause, the trainer holding the GIL) would otherwise shut the trainer out
for as long as the decay takes to undo it, while a systematic under-prediction repeats
and is caught after a few violations anyway.

Only co-located steps move the margin: it decides which co-located level fits, and a
step with the trainer paused says nothing about the co-location prediction's error.

The margin is bounded, the predictor's error is not: once the margin is at its maximum,
a co-located violation starts a backoff (``backoff_after``): the trainer stays paused for
``backoff_steps`` decisions, twice as long after each further such violation, and the
length starts over once co-located steps on target have decayed the margin a full growth
step below its maximum (multiplicative increase, slow decrease: a machine that stays
slower than its profile costs a violation per doubling, not one per co-located step).
"""

from __future__ import annotations

from harvest.schedule.config import SchedulerConfig


def is_violation(config: SchedulerConfig, measured_ms: float) -> bool:
    """A measured step over the TPOT target (a step exactly on target meets it)."""
    return measured_ms > config.target_tpot_ms


def margin_after(config: SchedulerConfig, margin: float, measured_ms: float, colocated: bool) -> float:
    """The margin in force after a step measured at ``measured_ms``; ``colocated``: the
    trainer ran during the step."""
    if not colocated:
        return margin
    if measured_ms > config.target_tpot_ms:
        return min(config.max_margin, margin + config.margin_growth)
    return max(config.initial_margin, margin - config.margin_decay)


def margin_saturated(config: SchedulerConfig, margin: float) -> bool:
    """The margin in force cannot grow by half a growth step: it is (about) at its maximum."""
    return margin >= config.max_margin - config.margin_growth / 2


def backoff_after(
    config: SchedulerConfig, margin: float, measured_ms: float, colocated: bool, length: int
) -> tuple[int, bool]:
    """(the backoff length, whether a backoff of that many decisions starts now) after a
    step measured at ``measured_ms`` with ``margin`` in force; ``length``: the last
    backoff's (0: none since the last reset)."""
    if not colocated or config.backoff_steps is None:
        return length, False
    if measured_ms > config.target_tpot_ms:
        if not margin_saturated(config, margin):
            return length, False
        return (config.backoff_steps if length == 0 else min(config.max_backoff_steps, 2 * length)), True
    if length and margin_after(config, margin, measured_ms, True) <= config.max_margin - config.margin_growth:
        return 0, False
    return length, False
