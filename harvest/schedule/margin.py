"""The feedback margin: how a measured step moves the headroom the rule keeps.

Invariants: only co-located steps move the margin; a violation adds ``margin_growth`` and
a step within target removes ``margin_decay`` (additive, so one outlier does not shut the
trainer out); the margin stays within [initial_margin, max_margin]. A violation at the
maximum margin starts a backoff (``backoff_after``) that doubles with each further one and
starts over once the margin has decayed a full growth step below its maximum.

Rules: docs/design.md §4, 'The feedback margin (harvest/schedule/margin.py)'.
"""

from __future__ import annotations

from harvest.schedule.scheduler_config import SchedulerConfig


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
