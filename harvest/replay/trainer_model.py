"""How much finetune work the trainer does on each SM level: the replay's trainer model.

Unit: whole-GPU trainer equivalents (1.0 is the job alone on a whole GPU); shares are one
GPU's, :mod:`harvest.replay.results` counts an instance's GPUs. Version-2 profiles give
each level's co-running and idle shares from the trainer rates ``harvest profile``
measured; version-1 profiles fall back to the SM-share model (an upper bound: memory
bandwidth contention is not modelled).

Rules: docs/design.md, 'The replay's trainer model (harvest/replay/trainer_model.py)'.
"""

from __future__ import annotations

import dataclasses
import math

from harvest.replay.profile_source import ReplayProfile

MEASURED_MODEL = (
    "measured (the profile's trainer section): trainer rate while decode co-runs = the co-run points' units/s, "
    "idle = the level's alone units/s, each over the whole-device alone units/s"
)
SM_SHARE_MODEL = (
    "SM-share model: trainer rate = solo rate × trainer SM share (disjoint SMs) or × (1 − 1/F) of shared SMs "
    "(F: the profile's stage-2 slowdown); trainer interference from decode not modelled (an upper bound)"
)


@dataclasses.dataclass(frozen=True)
class TrainerModel:
    """``colo_share[i]``: the trainer's rate (whole-GPU equivalents) while decode runs a
    step on level ``i`` (NaN: unknown without stage 2); ``idle_share[i]``: its rate on
    level ``i`` while no decode step runs."""

    colo_share: tuple[float, ...]
    idle_share: tuple[float, ...]
    tokens_per_gpu_s: float | None  # the job's solo rate on a whole GPU, if known
    rate_source: str  # where tokens_per_gpu_s came from (or why there is none)
    profile_note: str  # what the profile itself records about trainer throughput
    model: str = SM_SHARE_MODEL  # MEASURED_MODEL or SM_SHARE_MODEL

    @property
    def unit(self) -> str:
        return "tokens/s" if self.tokens_per_gpu_s is not None else "whole-GPU trainer equivalents"

    def to_tokens(self, gpu_equivalents: float) -> float | None:
        return None if self.tokens_per_gpu_s is None else gpu_equivalents * self.tokens_per_gpu_s

    def to_dict(self) -> dict:
        return {
            "model": self.model,
            "colo_share": [None if math.isnan(s) else s for s in self.colo_share],
            "idle_share": list(self.idle_share),
            "tokens_per_gpu_s": self.tokens_per_gpu_s,
            "rate_source": self.rate_source,
            "profile_note": self.profile_note,
        }


def build(profile: ReplayProfile, tokens_per_gpu_s: float | None = None) -> TrainerModel:
    """The trainer model of ``profile``'s ladder; ``tokens_per_gpu_s`` is the job's solo
    rate on a whole GPU (from the command line), None if unknown."""
    if tokens_per_gpu_s is not None and not (math.isfinite(tokens_per_gpu_s) and tokens_per_gpu_s > 0):
        raise ValueError(f"--trainer-tokens-per-s={tokens_per_gpu_s!r}: must be a finite number > 0")
    fallback = ""
    if profile.trainer_alone is not None:
        section = profile.trainer_alone
        whole = alternating_rate([r.units_per_s for r in section.records(section.whole_device_level)])
        if whole > 0:
            return _measured(profile, whole, tokens_per_gpu_s)
        # Every share is a rate over this one; profiles written before the alone window
        # was made to hold a unit may have counted none on a loaded host.
        fallback = (f"the profile's trainer section counted no unit alone on {_whole_device(section)} in some phase, "
                    "so its shares cannot be formed: the SM-share model instead; ")
    ladder = profile.ladder
    total = ladder.total_sms
    colo, idle = [], []
    for index, level in enumerate(ladder.levels):
        overlap = max(0, level.decode_sms + level.trainer_sms - total)
        exclusive = level.trainer_sms - overlap
        share = exclusive / total
        if overlap:
            if profile.corun is None:
                share = math.nan
            else:
                factor = profile.corun.factor(ladder.decode_fraction(index), ladder.trainer_fraction(index))
                share += overlap / total * max(0.0, 1.0 - 1.0 / factor) if factor > 0 else 0.0
        colo.append(share)
        idle.append(level.trainer_sms / total)
    if tokens_per_gpu_s is None:
        source = "none given (--trainer-tokens-per-s): finetune throughput is in whole-GPU trainer equivalents"
    else:
        source = f"--trainer-tokens-per-s {tokens_per_gpu_s:g} (the job alone on a whole GPU, from the command line)"
    return TrainerModel(tuple(colo), tuple(idle), tokens_per_gpu_s, source, fallback + _profile_note(profile))


def _whole_device(section) -> str:
    return "the whole device" if section.whole_device_level is None else f"level {section.whole_device_level} (every SM)"


def alternating_rate(rates: list[float]) -> float:
    """Units/s of a trainer running one unit of each phase in turn, from per-phase rates."""
    if not rates or any(r <= 0 for r in rates):
        return 0.0
    return len(rates) / sum(1.0 / r for r in rates)


def _measured(profile: ReplayProfile, whole: float, tokens_override: float | None) -> TrainerModel:
    """``whole``: the workload's units/s alone on every SM, > 0."""
    section, levels = profile.trainer_alone, profile.ladder.levels
    corun = {r.level: alternating_rate([p.units_per_s for p in r.phases]) for r in profile.trainer_records}
    colo, idle, capped = [], [], []
    for index, level in enumerate(levels):
        if level.trainer_sms == 0:
            colo.append(0.0)
            idle.append(0.0)
            continue
        # A trainer cannot outrun itself alone on every SM, nor beside decode itself alone
        # on the same SMs: a measured share above either bound is noise of short windows
        # (or, in older profiles, a co-run window that left out the host's time between
        # steps), and counting it would credit harvest with work no GPU did.
        alone = alternating_rate([r.units_per_s for r in section.records(index)]) / whole
        if alone > 1.0:
            capped.append(f"level {index} alone {alone:.3g} to 1")
            alone = 1.0
        beside = corun[index] / whole if index in corun else math.nan
        if beside > alone:
            capped.append(f"level {index} beside decode {beside:.3g} to its alone {alone:.3g}")
            beside = alone
        colo.append(beside)
        idle.append(alone)
    measured_tokens = whole * section.tokens_per_unit
    where = _whole_device(section)
    if tokens_override is None:
        tokens, source = measured_tokens, (
            f"measured: {whole:.4g} units/s alone on {where} x {section.tokens_per_unit:.4g} tokens/unit "
            f"= {measured_tokens:.4g} tokens/s (the profile's trainer section)"
        )
    else:
        tokens, source = tokens_override, (
            f"--trainer-tokens-per-s {tokens_override:g} (from the command line; the profile measured "
            f"{measured_tokens:.4g} tokens/s for its own workload)"
        )
    note = "the profile's trainer section: " + "; ".join(
        f"level {r.level}: {corun.get(r.level, 0.0):.4g} units/s beside decode over {r.num_points} points"
        for r in profile.trainer_records
    ) + f"; alone on {where}: {whole:.4g} units/s"
    if capped:
        note += "; shares capped (a trainer beside decode at most as fast as alone on the same SMs, alone at most as " \
                "fast as on every SM): " + ", ".join(capped)
    return TrainerModel(tuple(colo), tuple(idle), tokens, source, note, MEASURED_MODEL)


def _profile_note(profile: ReplayProfile) -> str:
    if not profile.trainer_records:
        return "the profile records no trainer units for its co-run points; nothing to cross-check"
    rates = ", ".join(
        f"level {r.level} ({profile.ladder.levels[r.level].trainer_sms} trainer SMs): {r.units_per_s:.3g} units/s "
        f"over {r.num_points} points"
        for r in profile.trainer_records
    )
    return (
        f"the profile's co-run points record trainer units beside decode ({rates}) but no solo trainer rate and no "
        "tokens per unit, so they are reported, not used"
    )
