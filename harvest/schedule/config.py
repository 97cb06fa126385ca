"""The QoS scheduler's configuration: one frozen object, validated once at the boundary.

A bad value raises ``ValueError`` naming the field, the value and the fix, so a
misconfigured server refuses to start instead of misbehaving mid-serving. The defaults
are argued field by field below; all latencies are milliseconds, all margins fractions
of the TPOT target.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, Mapping


@dataclasses.dataclass(frozen=True)
class SchedulerConfig:
    """Knobs of Harli's rule (§6.2) and of harvest's additions to it.

    - ``target_tpot_ms``: the per-token decode latency target (Harli evaluates 40 ms).
    - ``initial_margin``: decisions aim under ``target × (1 − margin)``. 5% covers the
      stage-2 predictor's reported error (Harli §8.4: < 5%). It is also the margin's
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

    target_tpot_ms: float = 40.0
    initial_margin: float = 0.05
    max_margin: float = 0.5
    margin_growth: float = 0.05
    margin_decay: float = 0.00025
    hysteresis_steps: int = 3
    hysteresis_gain: float | None = 0.25
    floor_after_paused_steps: int | None = 20
    floor_margin: float = 0.0
    backoff_steps: int | None = 32
    max_backoff_steps: int = 1024
    ring_size: int = 1024

    def __post_init__(self) -> None:
        self._set_float("target_tpot_ms", low=0.0, low_open=True, fix="the per-token decode target in ms, e.g. 40")
        self._set_float("initial_margin", low=0.0, high=1.0, fix="a fraction of the target kept as headroom, e.g. 0.05")
        self._set_float(
            "max_margin",
            low=self.initial_margin,
            high=1.0,
            fix=f"raise it to at least initial_margin={self.initial_margin!r} (and under 1), or lower initial_margin",
        )
        self._set_float("margin_growth", low=0.0, fix="the margin added per measured violation, e.g. 0.05 (0: fixed)")
        self._set_float("margin_decay", low=0.0, fix="the margin removed per step on target, e.g. 0.00025 (0: fixed)")
        self._check_int("hysteresis_steps", low=1, fix="steps an optional level change waits, e.g. 3 (1: none)")
        if self.hysteresis_gain is not None:
            self._set_float(
                "hysteresis_gain",
                low=0.0,
                low_open=True,
                high=1.0,
                high_open=False,
                fix="a fraction of the target in (0, 1], e.g. 0.25, or null to always wait hysteresis_steps",
            )
        if self.floor_after_paused_steps is not None:
            self._check_int("floor_after_paused_steps", low=1, fix="a step count, e.g. 20, or null for no floor")
        self._set_float(
            "floor_margin",
            low=0.0,
            high=self.initial_margin,
            high_open=False,
            fix=f"a fraction in [0, initial_margin={self.initial_margin!r}]: the floor relaxes the margin, "
            "a larger one would never fire",
        )
        if self.backoff_steps is not None:
            self._check_int("backoff_steps", low=1, fix="decisions the trainer waits after a violation at the maximum "
                            "margin, e.g. 32, or null for no backoff")
        self._check_int("max_backoff_steps", low=self.backoff_steps or 1,
                        fix=f"the longest backoff in decisions, at least backoff_steps={self.backoff_steps!r}, e.g. 1024")
        self._check_int("ring_size", low=1, fix="the number of recent decisions kept, e.g. 1024")

    # -- validation helpers --------------------------------------------------------------
    def _reject(self, name: str, value: Any, fix: str) -> ValueError:
        return ValueError(f"SchedulerConfig.{name}={value!r}: {fix}")

    def _set_float(
        self,
        name: str,
        *,
        fix: str,
        low: float,
        low_open: bool = False,
        high: float | None = None,
        high_open: bool = True,
    ) -> None:
        value = getattr(self, name)
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
            raise self._reject(name, value, f"must be a finite number; {fix}")
        too_low = value <= low if low_open else value < low
        too_high = high is not None and (value >= high if high_open else value > high)
        if too_low or too_high:
            upper = "" if high is None else f", {high!r}{')' if high_open else ']'}"
            lower = f"{'(' if low_open else '['}{low!r}"
            interval = f"{lower}{upper}" if high is not None else f"{'>' if low_open else '>='} {low!r}"
            raise self._reject(name, value, f"must be in {interval}; {fix}")
        object.__setattr__(self, name, float(value))

    def _check_int(self, name: str, *, low: int, fix: str) -> None:
        value = getattr(self, name)
        if isinstance(value, bool) or not isinstance(value, int) or value < low:
            raise self._reject(name, value, f"must be an integer >= {low}; {fix}")

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
        if not isinstance(data, Mapping):
            raise ValueError(f"{where}: expected a mapping of scheduler settings, got {type(data).__name__}")
        known = [field.name for field in dataclasses.fields(cls)]
        unknown = sorted(str(key) for key in data if key not in known)
        if unknown:
            raise ValueError(f"{where}: unknown key(s) {', '.join(unknown)} (known: {', '.join(known)})")
        try:
            return cls(**data)
        except ValueError as error:
            raise ValueError(f"{where}: {error}") from None
