"""The QoS scheduler (Harli (arXiv:2511.11729) §6.2, docs/design.md §4): before every
decode step, choose the SM level whose predicted co-located latency is closest under the
TPOT target, or pause the trainer. Pure policy: standard library only (no torch, numpy or scikit-learn)."""

from harvest.schedule.scheduler_config import SchedulerConfig
from harvest.schedule.qos_controller import QoSController, SchedulerStats
from harvest.schedule.margin import backoff_after, is_violation, margin_after
from harvest.schedule.rule import advance, choose, closest_under, safest_under
from harvest.schedule.snapshots import (
    Decision,
    DecisionReason,
    SchedulerInput,
    SchedulerState,
    TrainerAction,
    TrainerState,
)

__all__ = [
    "Decision",
    "DecisionReason",
    "QoSController",
    "SchedulerConfig",
    "SchedulerInput",
    "SchedulerState",
    "SchedulerStats",
    "TrainerAction",
    "TrainerState",
    "advance",
    "backoff_after",
    "choose",
    "closest_under",
    "is_violation",
    "margin_after",
    "safest_under",
]
