"""The co-location policies the replay compares, each answering one question per decode
step: how long does this step take, on which level, and how much finetune work runs
beside it?

``decode-only``, ``separate`` (Harli's SeparateMode), ``static`` (Harli's StaticMode) and
``harvest`` (the real QoS controller and predictor, charged the true latency and fed it
back as in serving). A tensor-parallel instance counts its N GPUs. The true latency is the
profile's prediction, scaled by ``error_scale`` when the trainer co-ran and perturbed by
``error_noise``; at the defaults the profile is the truth.

Rules: docs/design.md, 'The replay's policies (harvest/replay/policies.py)'.
"""

from __future__ import annotations

import abc
import math
import random

from harvest.replay.profile_source import ReplayProfile
from harvest.replay.trainer_model import TrainerModel
from harvest.schedule import QoSController, SchedulerConfig, SchedulerInput, TrainerState

DECODE_ONLY, SEPARATE, STATIC, HARVEST = "decode-only", "separate", "static", "harvest"
ALL_POLICIES = (HARVEST, SEPARATE, STATIC, DECODE_ONLY)
STATIC_DECODE_FRACTION = 0.6  # Harli (arXiv:2511.11729) §8.1: 60 % of the SMs and of the memory to inference
MIN_NOISE_FACTOR = 0.1
# No decode step takes an hour: a longer one comes from a broken profile (a coefficient
# off by orders of magnitude) or an absurd --error-scale/--error-noise, and such steps
# summed over a trace overflow the clock and the summaries into inf/NaN.
MAX_STEP_S = 3600.0


def step_too_long(latency_s: float) -> ValueError:
    return ValueError(f"a simulated decode step took {latency_s:.3g} s, over {MAX_STEP_S:g} s: the profile's prediction "
                      "times --error-scale and --error-noise is no decode step")


class PolicyRefused(ValueError):
    """The policy cannot run with this profile; the message says why and what to do."""


class LatencyErrors:
    """The gap between the profile (what the scheduler believes) and the simulated truth."""

    def __init__(self, scale: float = 1.0, noise: float = 0.0, seed: int = 0):
        if not (math.isfinite(scale) and scale > 0):
            raise ValueError(f"--error-scale={scale!r}: must be a number > 0 (1 = the stage-2 model is exact)")
        if not (math.isfinite(noise) and noise >= 0):
            raise ValueError(f"--error-noise={noise!r}: must be a number >= 0 (a relative standard deviation)")
        self.scale = scale
        self.noise = noise
        self._gauss = random.Random(seed).gauss

    def noise_factor(self) -> float:
        if self.noise == 0.0:
            return 1.0
        return max(MIN_NOISE_FACTOR, 1.0 + self._gauss(0.0, self.noise))


class BasePolicy(abc.ABC):
    """Contract: ``step(batch_size, sum_context)`` returns ``(true latency s, level index,
    trainer share during the step)``, the share one GPU of the decode instance gives the
    trainer; ``idle_share`` is that share while no decode step runs;
    ``dedicated_trainer_gpus`` GPUs train alone throughout; ``num_gpus`` counts them and
    the decode instance's (module doc)."""

    name: str
    gpus_per_rank = 1  # per tensor-parallel rank of the decode instance
    dedicated_trainer_gpus_per_rank = 0
    kv_fraction = 1.0
    idle_share = 0.0

    def __init__(self, profile: ReplayProfile, trainer: TrainerModel, errors: LatencyErrors):
        self.profile = profile
        self.trainer = trainer
        self.errors = errors

    @property
    def num_gpus(self) -> int:
        return self.gpus_per_rank * self.profile.tp_size

    @property
    def dedicated_trainer_gpus(self) -> int:
        return self.dedicated_trainer_gpus_per_rank * self.profile.tp_size

    @abc.abstractmethod
    def step(self, batch_size: int, sum_context: int) -> tuple[float, int, float]: ...

    def level_label(self) -> str:
        return ""

    def extra(self) -> dict:
        return {}


class DecodeOnlyPolicy(BasePolicy):
    name = DECODE_ONLY

    def __init__(self, profile: ReplayProfile, trainer: TrainerModel, errors: LatencyErrors):
        super().__init__(profile, trainer, errors)
        self.level = profile.ladder.whole_device_index
        self._solo = profile.solo[self.level]
        self._padded = profile.buckets.padded

    def step(self, batch_size: int, sum_context: int) -> tuple[float, int, float]:
        latency = self._solo.predict(self._padded(batch_size), sum_context) * self.errors.noise_factor()
        return latency, self.level, 0.0

    def level_label(self) -> str:
        level = self.profile.ladder.levels[self.level]
        return f"level {self.level} ({level.decode_sms} of {self.profile.ladder.total_sms} SMs)"


class SeparatePolicy(DecodeOnlyPolicy):
    """Decode exactly as decode-only, plus a second GPU per decode GPU that only trains."""

    name = SEPARATE
    gpus_per_rank = 2
    dedicated_trainer_gpus_per_rank = 1


def num_gpus(name: str, tp_size: int) -> int:
    """The GPUs policy ``name`` occupies beside a decode instance of ``tp_size`` ranks
    (for a policy that was refused, so never built)."""
    return (SeparatePolicy.gpus_per_rank if name == SEPARATE else BasePolicy.gpus_per_rank) * tp_size


def static_level(profile: ReplayProfile, decode_fraction: float = STATIC_DECODE_FRACTION) -> int:
    """The level giving decode the SM fraction closest to ``decode_fraction`` among those
    where the trainer runs (ties: the one with more decode SMs)."""
    ladder = profile.ladder
    candidates = [i for i, level in enumerate(ladder.levels) if level.trainer_sms > 0]
    if not candidates:
        raise PolicyRefused(f"static: the profile's ladder ({ladder.describe()}) has no level where the trainer runs")
    return min(candidates, key=lambda i: (abs(ladder.decode_fraction(i) - decode_fraction), -ladder.levels[i].decode_sms))


class StaticPolicy(BasePolicy):
    name = STATIC
    kv_fraction = STATIC_DECODE_FRACTION

    def __init__(self, profile: ReplayProfile, trainer: TrainerModel, errors: LatencyErrors):
        super().__init__(profile, trainer, errors)
        if profile.predictor is None:
            raise PolicyRefused(f"static needs the co-location (stage-2) model: {profile.stage2_missing}")
        self.level = static_level(profile)
        self.share = trainer.colo_share[self.level]
        self.idle_share = trainer.idle_share[self.level]
        self._predict_colo = profile.predictor.predict_colo

    def step(self, batch_size: int, sum_context: int) -> tuple[float, int, float]:
        errors = self.errors
        latency = self._predict_colo(self.level, batch_size, sum_context) * errors.scale * errors.noise_factor()
        return latency, self.level, self.share

    def level_label(self) -> str:
        level = self.profile.ladder.levels[self.level]
        total = self.profile.ladder.total_sms
        return f"level {self.level}: decode {level.decode_sms}/{total} SMs ({100 * level.decode_sms / total:.0f} %), trainer {level.trainer_sms}"


class HarvestPolicy(BasePolicy):
    """Harli's rule through harvest's real scheduler and predictor. Idle trainer: on the
    level with the most trainer SMs (the runtime keeps the ladder's partitions).

    It decides as the runtime does, with the worst per-phase stage-2 model when the
    profile has them (any trainer phase may run during a step); a co-located step then
    takes the combined model's latency, the profile's expectation over phases."""

    name = HARVEST

    def __init__(self, profile: ReplayProfile, trainer: TrainerModel, errors: LatencyErrors, config: SchedulerConfig):
        super().__init__(profile, trainer, errors)
        if profile.predictor is None:
            raise PolicyRefused(f"harvest needs the co-location (stage-2) model: {profile.stage2_missing}")
        try:
            self.qos = QoSController(config, profile.ladder)
        except ValueError as exc:
            raise PolicyRefused(f"harvest: {exc}") from exc
        self.predictor = profile.predictor
        self.whole_level = profile.ladder.whole_device_index
        levels = profile.ladder.levels
        self.idle_share = max(trainer.idle_share[i] for i in range(len(levels)) if levels[i].trainer_sms > 0)
        self._num_levels = len(levels)
        self._solo = [0.0] * self._num_levels
        self._colo = [0.0] * self._num_levels
        self._shares = trainer.colo_share
        self._decision_model = self.predictor.worst_phase

    def step(self, batch_size: int, sum_context: int) -> tuple[float, int, float]:
        solo, colo, errors = self._solo, self._colo, self.errors
        self.predictor.predict_levels(batch_size, sum_context, solo, colo, self._decision_model)
        whole_s = solo[self.whole_level]
        decision = self.qos.decide(
            SchedulerInput(tuple([c * 1e3 for c in colo]), TrainerState.RUNNING, whole_s * 1e3)
        )
        level = decision.level_index
        if not decision.runs_trainer:
            latency, share = whole_s * errors.noise_factor(), 0.0
        else:
            expected = self.predictor.predict_colo(level, batch_size, sum_context)  # combined model
            latency, share = expected * errors.scale * errors.noise_factor(), self._shares[level]
        if not latency <= MAX_STEP_S:  # before the scheduler logs and backs off over it
            raise step_too_long(latency)
        self.qos.observe_measurement(latency * 1e3)
        return latency, level, share

    def level_label(self) -> str:
        return f"chosen per step from {self._num_levels} levels ({self.profile.ladder.describe()})"

    def extra(self) -> dict:
        return {"scheduler": self.qos.stats().to_dict(), "scheduler_config": self.qos.config.to_dict()}


def make_policy(
    name: str, profile: ReplayProfile, trainer: TrainerModel, errors: LatencyErrors, scheduler: SchedulerConfig
) -> BasePolicy:
    """Build policy ``name``; raises PolicyRefused when the profile cannot support it."""
    if name == HARVEST:
        return HarvestPolicy(profile, trainer, errors, scheduler)
    if name == STATIC:
        return StaticPolicy(profile, trainer, errors)
    if name == SEPARATE:
        return SeparatePolicy(profile, trainer, errors)
    if name == DECODE_ONLY:
        return DecodeOnlyPolicy(profile, trainer, errors)
    raise ValueError(f"policy {name!r}: one of {', '.join(ALL_POLICIES)}")
