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

    - ``target_tpot_ms``: the per-token decode latency target (Harli evaluates 40 ms).
    - ``initial_margin``: decisions aim under ``target × (1 − margin)``. 5% covers the
      stage-2 predictor's reported error (Harli (arXiv:2511.11729) §8.4: < 5%). It is also the margin's
      lower bound: feedback only ever adds to it.
    - ``max_margin``: the feedback margin never exceeds this, so one bad stretch cannot
      shut the trainer out indefinitely.
    - ``margin_growth`` / ``margin_decay``: added after each measured violation of a
      co-located step / removed after each co-located step within target. If the margin
      governs violations, it settles where violations happen with probability
      ``decay / (growth + decay)``: the defaults give ≈ 0.5%, half the 1% violation
      rate the co-location benchmark allows.
    - ``hysteresis_steps``: a level change that QoS does not require (the current level
      still fits) waits until a better level has been available for this many
      consecutive steps; 1 disables hysteresis. 3 steps ≈ 120 ms at 40 ms, close to the
      ~100 ms between adjustments Harli shows in §8.6 (Fig. 14).
    - ``hysteresis_gain``: ... unless the better level predicts at least this fraction of
      the target more latency than the current one (the current level wastes that much
      of the budget); ``None``: never skip the wait.
    - ``floor_after_paused_steps``: after this many consecutive steps in which the
      trainer had work but was paused, run it for one step on the safest level that
      predicts under ``target × (1 − floor_margin − (margin − initial_margin))``: without
      the initial headroom, but with what the feedback margin learned from violations (a
      minimum-progress floor of one step in ``K + 1`` while predicted slack exists);
      ``None`` disables the floor.
    - ``floor_margin``: the margin the floor keeps (≤ ``initial_margin``; 0 = the raw
      predicted target).
    - ``backoff_steps``: a co-located violation the margin cannot absorb (it was already
      within half a growth step of ``max_margin``) keeps the trainer paused for this
      many decisions, floor included: the predictor is off by more than the margin can
      cover (a slowed machine, a load the profile never saw) and co-locating on its
      word would keep violating. Each further such violation doubles the backoff, up to
      ``max_backoff_steps``; it starts from ``backoff_steps`` again once co-located
      steps on target have decayed the margin a full growth step below its maximum.
      32 steps ≈ 1.3 s at 40 ms: long enough for the online predictor to see solo steps
      of the changed machine. ``None``: no backoff (the margin is the only feedback).
    - ``ring_size``: how many recent decisions are kept for inspection.
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
