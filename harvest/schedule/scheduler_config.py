"""The QoS scheduler's configuration: one frozen object, validated once at the boundary.

Each knob is declared once, with its bounds and a one-line description
(:mod:`harvest.settings`); harvest.yaml's ``qos`` section is this object. A bad value
raises ``SettingError`` (a ``ValueError``) naming the field, the value and the fix, so a
misconfigured server refuses to start instead of misbehaving mid-serving. The defaults
are argued field by field below; all latencies are milliseconds, all margins fractions
of the TPOT target.
"""

from __future__ import annotations

import dataclasses
from typing import Any, ClassVar, Mapping

from harvest.settings import Integer, Number, from_mapping, invalid, setting, validate


@dataclasses.dataclass(frozen=True)
class SchedulerConfig:
    """Knobs of Harli's rule (§6.2) and of harvest's additions to it.

    The QoS target (``target_tpot_ms``), the feedback margin (``initial_margin``,
    ``max_margin``, ``margin_growth``, ``margin_decay``), hysteresis (``hysteresis_steps``,
    ``hysteresis_gain``), the minimum-progress floor (``floor_after_paused_steps``,
    ``floor_margin``), the backoff (``backoff_steps``, ``max_backoff_steps``) and
    ``ring_size``. Each field's description is its setting's; why the defaults are what they
    are: docs/design.md §4, 'The scheduler's knobs'.
    """

    # Set in harvest.yaml as ``qos.initial_margin``; an old file's ``qos.margin`` is refused
    # naming it rather than ignored.
    RENAMED_SETTINGS: ClassVar[Mapping[str, str]] = {"margin": "initial_margin"}

    target_tpot_ms: float = setting(40.0, "per-token latency target of every decode step, in ms",
                                    Number(minimum=0.0, exclusive_minimum=True))
    initial_margin: float = setting(0.05, "share of the target kept as headroom: decisions aim under "
                                    "target x (1 - margin); the margin's lower bound", Number(minimum=0.0, maximum=1.0,
                                                                                             exclusive_maximum=True))
    max_margin: float = setting(0.5, "the feedback margin's upper bound (>= initial_margin)",
                                Number(minimum=0.0, maximum=1.0, exclusive_maximum=True))
    margin_growth: float = setting(0.05, "margin added after each co-located step over the target (0: fixed margin)",
                                   Number(minimum=0.0))
    margin_decay: float = setting(0.00025, "margin removed after each co-located step within the target (0: fixed margin)",
                                  Number(minimum=0.0))
    hysteresis_steps: int = setting(3, "steps a better level must stay available before an optional level change "
                                    "(1: no hysteresis)", Integer(minimum=1))
    hysteresis_gain: float | None = setting(0.25, "an optional change skips the wait when it gains at least this share "
                                            "of the target (null: always wait)",
                                            Number(minimum=0.0, maximum=1.0, exclusive_minimum=True), nullable=True)
    floor_after_paused_steps: int | None = setting(20, "after this many steps with the trainer paused, run it one step on "
                                                   "the safest level predicting under the floor budget (null: no floor)",
                                                   Integer(minimum=1), nullable=True)
    floor_margin: float = setting(0.0, "the margin the floor keeps instead of initial_margin (<= initial_margin)",
                                  Number(minimum=0.0, maximum=1.0, exclusive_maximum=True))
    backoff_steps: int | None = setting(32, "decisions the trainer stays paused after a violation at the maximum "
                                        "margin, doubling while they repeat (null: no backoff)",
                                        Integer(minimum=1), nullable=True)
    max_backoff_steps: int = setting(1024, "the longest backoff in decisions (>= backoff_steps)", Integer(minimum=1))
    ring_size: int = setting(1024, "recent QoS decisions kept in memory for inspection (QoSController.recent_decisions)", Integer(minimum=1))

    def __post_init__(self) -> None:
        validate(self)
        if self.max_margin < self.initial_margin:
            raise invalid(self, "max_margin", f"a number >= initial_margin={self.initial_margin!r}; "
                          "raise max_margin or lower initial_margin")
        if self.floor_margin > self.initial_margin:
            raise invalid(self, "floor_margin", f"a number <= initial_margin={self.initial_margin!r}; "
                          "the floor relaxes the margin, a larger one would never fire")
        if self.backoff_steps is not None and self.max_backoff_steps < self.backoff_steps:
            raise invalid(self, "max_backoff_steps", f"an integer >= backoff_steps={self.backoff_steps!r}; "
                          "the longest backoff in decisions, e.g. 1024")

    # -- derived values and (de)serialisation ---------------------------------------------
    def budget_ms(self, margin: float) -> float:
        """The latency a co-located level must predict under with ``margin`` in force."""
        return self.target_tpot_ms * (1.0 - margin)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_mapping(cls, data: Mapping[str, Any], where: str = "scheduler") -> "SchedulerConfig":
        """Build from a parsed config section; unknown keys are refused, not dropped
        (a typo must not silently fall back to a default). ``where`` prefixes messages."""
        return from_mapping(cls, data, where=f"{where}: ")
