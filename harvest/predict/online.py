"""Online refinement: measured decode steps correct the offline profile.

:meth:`OnlineRefiner.observe` is cheap and runs on the decode thread; a refit
(scikit-learn, holding the GIL) runs only where the caller calls :meth:`refit` or
:meth:`try_refit`, off the decode path and never on a thread of its own. A refit fits each
stage on a rolling window plus the rescaled profile samples and swaps the new coefficients
in atomically. Exported: the windowed error per stage and :attr:`drift` (the profile no
longer describes this machine).

Rules: docs/design.md §3, 'Online refinement (harvest/predict/online.py)'.
"""

from __future__ import annotations

import collections
import copy
import dataclasses
import math
import threading
from typing import Sequence

from harvest.logs import get_logger
from harvest.predict.fit import FitError, LatencySample, fit_corun, fit_solo
from harvest.predict.latency_model import LatencyPredictor
from harvest.settings import Integer, Number, setting, validate

logger = get_logger(__name__)


@dataclasses.dataclass(frozen=True)
class OnlineSettings:
    """How the online refiner keeps and refits its windows: harvest.yaml's ``online`` section."""

    window: int = setting(512, "observations kept per level and stage", Integer(minimum=8))
    refit_every: int = setting(128, "new observations between refits (the first refit: after min_observations)",
                               Integer(minimum=1))
    min_observations: int = setting(32, "observations before the windowed error is trusted (drift flag, first refit)",
                                    Integer(minimum=1))
    drift_threshold: float = setting(0.10, "windowed mean relative error that raises the drift flag",
                                     Number(minimum=0.0, exclusive_minimum=True))
    online_share: float = setting(0.5, "weight of the window against the profile's samples in a refit",
                                  Number(minimum=0.0, maximum=1.0, exclusive_minimum=True, exclusive_maximum=True))
    # The server refits between trainer units or when idle, and a scikit-learn refit holds
    # the GIL ~30 ms; this bounds how often decode can be kept waiting by one.
    refit_min_interval_s: float = setting(2.0, "least time between two refits by the server, in seconds",
                                          Number(minimum=0.0))

    def __post_init__(self) -> None:
        validate(self)


@dataclasses.dataclass(frozen=True)
class RefitReport:
    refitted_levels: tuple[int, ...]
    refitted_corun: tuple[str, ...]
    skipped: tuple[str, ...]  # why a level/phase kept its coefficients
    stage1_error: float
    stage2_error: float


class OnlineRefiner:
    """Rolling-window refit of a :class:`LatencyPredictor` (see module doc)."""

    def __init__(
        self,
        predictor: LatencyPredictor,
        solo_anchor: Sequence[LatencySample] = (),
        corun_anchor: Sequence[LatencySample] = (),
        settings: OnlineSettings = OnlineSettings(),
    ):
        self.predictor = predictor
        self.settings = settings
        # The coefficients the profile gave, kept to tell how far the machine has moved.
        self._profile_model = copy.copy(predictor)
        self._solo_anchor = tuple(solo_anchor)
        self._corun_anchor = tuple(corun_anchor)
        num_levels = predictor.ladder.num_levels
        self._solo_window = [collections.deque(maxlen=settings.window) for _ in range(num_levels)]
        self._corun_window = [collections.deque(maxlen=settings.window) for _ in range(num_levels)]
        self._solo_errors: collections.deque = collections.deque(maxlen=settings.window)
        self._corun_errors: collections.deque = collections.deque(maxlen=settings.window)
        self._lock = threading.Lock()  # guards the windows; held for appends and copies only
        self._since_refit = 0
        self.num_observations = 0
        self.num_rejected = 0  # non-finite or non-positive measurements ignored
        self.num_refits = 0
        self.num_refit_failures = 0

    @classmethod
    def from_profile(cls, profile, settings: OnlineSettings = OnlineSettings()) -> "OnlineRefiner":
        return cls(profile.predictor(), profile.solo_samples(), profile.corun_samples(), settings)

    # -- decode thread --------------------------------------------------------------------
    def observe(
        self,
        level: int,
        batch_size: int,
        sum_context: float,
        latency_s: float,
        phase: str | None = None,
        predicted_s: float | None = None,
    ) -> None:
        """Record one measured step; ``phase`` None means the trainer was not running.
        Pass the prediction the scheduler used as ``predicted_s`` to save recomputing it."""
        if not (latency_s > 0 and math.isfinite(latency_s)):
            self.num_rejected += 1
            return
        sample = LatencySample(level, batch_size, sum_context, latency_s, phase)
        phase_index = None if phase is None else self.predictor.phase_index(phase)
        if predicted_s is None:
            predicted_s = self.predictor.evaluate(level, batch_size, sum_context, phase_index)
        window = self._solo_window[level] if phase is None else self._corun_window[level]
        errors = self._solo_errors if phase is None else self._corun_errors
        with self._lock:
            window.append(sample)
            errors.append(abs(predicted_s - latency_s) / latency_s)
            self._since_refit += 1
            self.num_observations += 1

    # -- exported numbers -----------------------------------------------------------------
    @property
    def stage1_error(self) -> float:
        """Mean |predicted - measured| / measured over the recent solo steps (0 if none)."""
        return _mean(self._solo_errors)

    @property
    def stage2_error(self) -> float:
        return _mean(self._corun_errors)

    @property
    def error(self) -> float:
        """Mean relative error over the recent steps of both stages."""
        with self._lock:
            values = list(self._solo_errors) + list(self._corun_errors)
        return sum(values) / len(values) if values else 0.0

    @property
    def drift(self) -> bool:
        s = self.settings
        return any(
            len(errors) >= s.min_observations and _mean(errors) > s.drift_threshold
            for errors in (self._solo_errors, self._corun_errors)
        )

    def refit_due(self) -> bool:
        """``refit_every`` new observations since the last refit; the first refit comes
        after ``min_observations``: a profile never matches the serving engine exactly
        (its steps carry the server's own per-step work), and until the first refit every
        co-location decision uses the profile's numbers."""
        needed = self.settings.min_observations if self.num_refits == 0 else self.settings.refit_every
        return self._since_refit >= needed

    # -- off the decode path --------------------------------------------------------------
    def refit(self) -> RefitReport:
        """Fit both stages on (rescaled) profile samples + window; swap the result in."""
        with self._lock:
            solo_windows = [list(w) for w in self._solo_window]
            corun_windows = [list(w) for w in self._corun_window]
            self._since_refit = 0
        predictor = self.predictor
        solo = list(predictor.solo_coefficients)
        refitted_levels, skipped = [], []
        for level, window in enumerate(solo_windows):
            if not window:
                continue
            anchor = self._rescaled_anchor([s for s in self._solo_anchor if s.level == level], window, None)
            try:
                solo[level] = fit_solo(anchor + window, predictor.buckets, self._blend(len(anchor), len(window)),
                                       cross_validate=False)[0]
                refitted_levels.append(level)
            except FitError as exc:
                skipped.append(f"stage 1 level {level}: {exc}")
        corun = list(predictor.corun_coefficients.values())
        refitted_corun = []
        window_all = [s for w in corun_windows for s in w]
        for index, name in enumerate(predictor.phase_names):
            window = window_all if index == 0 else [s for s in window_all if s.phase == name]
            if not window:
                continue
            anchor = [s for s in self._corun_anchor if index == 0 or s.phase == name]
            anchor = self._rescaled_anchor(anchor, window, index)
            try:
                fitted = fit_corun(anchor + window, predictor.ladder, predictor.buckets, solo, self._blend(len(anchor), len(window)),
                                   cross_validate=False)
                corun[index] = fitted.coefficients
                refitted_corun.append(name)
            except FitError as exc:
                skipped.append(f"stage 2 {name}: {exc}")
        predictor.update(solo=solo, corun=corun)
        self.num_refits += 1
        self._recompute_errors(solo_windows, corun_windows)
        report = RefitReport(tuple(refitted_levels), tuple(refitted_corun), tuple(skipped), self.stage1_error, self.stage2_error)
        if skipped:
            logger.info("predictor refit kept some coefficients: %s", "; ".join(skipped))
        return report

    def _rescaled_anchor(self, anchor: list[LatencySample], window: list[LatencySample], model_index: int | None) -> list[LatencySample]:
        """The profile's samples scaled by how much slower or faster the window runs than
        the *profile's* model predicts (median ratio). A uniform drift (clocks, thermal
        throttling) then moves the whole model; the window still decides its shape where
        traffic is, and the scaled profile keeps it sensible where traffic is not.
        ``model_index``: None for stage 1, else the stage-2 model's phase index."""
        model = self._profile_model
        ratios = sorted(s.latency_s / model.evaluate(s.level, s.batch_size, s.sum_context, model_index) for s in window)
        scale = ratios[len(ratios) // 2]
        if not (scale > 0 and math.isfinite(scale)):
            return anchor
        return [dataclasses.replace(s, latency_s=s.latency_s * scale) for s in anchor]

    def _blend(self, num_anchor: int, num_window: int) -> list[float] | None:
        if num_anchor == 0:
            return None
        share = self.settings.online_share
        window_weight = share / (1.0 - share) * num_anchor / num_window
        return [1.0] * num_anchor + [window_weight] * num_window

    def _recompute_errors(self, solo_windows, corun_windows) -> None:
        """Errors of the recent observations under the *new* coefficients, so the
        exported error describes the model now in use."""
        p = self.predictor
        solo_errors = [abs(p.evaluate(s.level, s.batch_size, s.sum_context) - s.latency_s) / s.latency_s for w in solo_windows for s in w]
        corun_errors = [
            abs(p.evaluate(s.level, s.batch_size, s.sum_context, p.phase_index(s.phase)) - s.latency_s) / s.latency_s
            for w in corun_windows
            for s in w
        ]
        with self._lock:
            self._solo_errors.clear()
            self._solo_errors.extend(solo_errors[-self.settings.window:])
            self._corun_errors.clear()
            self._corun_errors.extend(corun_errors[-self.settings.window:])

    def try_refit(self) -> bool:
        """:meth:`refit`, a failure logged and counted instead of raised (the previous
        coefficients stay): for the serving process, where a refit must never stop decode."""
        try:
            self.refit()
            return True
        except Exception:  # noqa: BLE001 - a failed refit keeps the old model; serving goes on
            self.num_refit_failures += 1
            logger.exception("predictor refit failed; keeping the previous coefficients")
            return False


def _mean(values) -> float:
    snapshot = list(values)
    return sum(snapshot) / len(snapshot) if snapshot else 0.0
