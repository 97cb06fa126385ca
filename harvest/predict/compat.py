"""Does a profile describe the GPU, model and ladder that are running now?

A profile measured on another GPU, another model, another SM ladder or another
tensor-parallel degree predicts wrong latencies, and the scheduler would then break the QoS target or starve the trainer
without any error. So loading for use checks the running identity and refuses on a
mismatch, naming each differing field; ``allow_mismatch=True`` (the operator's explicit
override) turns the refusal into a warning.

It also says when a running job's units differ from those the profile's co-run stage ran
beside decode (:func:`corun_units_mismatch`): a server warns and shows it, never refuses.

The model is identified by a hash of the config fields that decide a decode step's cost
(:data:`LATENCY_CONFIG_KEYS`), not by path or weights: the same architecture with other
weights runs at the same speed, a checkpoint moved elsewhere is still the same model.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import warnings
from pathlib import Path

from harvest.ladder import Ladder
from harvest.predict.schema import Profile

LATENCY_CONFIG_KEYS = (
    "architectures",
    "model_type",
    "hidden_size",
    "intermediate_size",
    "num_hidden_layers",
    "num_attention_heads",
    "num_key_value_heads",
    "head_dim",
    "vocab_size",
    "tie_word_embeddings",
    "sliding_window",
    "num_experts",
    "num_experts_per_tok",
)


class ProfileMismatchError(ValueError):
    """The profile was measured for another GPU, model, ladder or TP degree than the running one."""


def model_config_hash(config: dict) -> str:
    """sha256 (first 16 hex digits) of the latency-relevant fields of a HF ``config.json``."""
    relevant = {key: config.get(key) for key in LATENCY_CONFIG_KEYS}
    text_config = config.get("text_config")  # multimodal wrappers nest the decoder's shape
    if isinstance(text_config, dict):
        relevant["text_config"] = {key: text_config.get(key) for key in LATENCY_CONFIG_KEYS}
    canonical = json.dumps(relevant, sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(canonical.encode()).hexdigest()[:16]


def model_config_hash_of_path(model_path: str | Path) -> str:
    path = Path(model_path) / "config.json"
    try:
        return model_config_hash(json.loads(path.read_text()))
    except (OSError, ValueError) as exc:
        raise ValueError(f"cannot read the model config {path}: {exc}") from exc


@dataclasses.dataclass(frozen=True)
class RuntimeIdentity:
    """What is running now, in the terms a profile records."""

    device_name: str
    sm_count: int
    model_config_hash: str
    model_dtype: str
    ladder: Ladder
    # Tensor-parallel ranks of the decode instance: each step's all-reduces, and each
    # rank's share of the weights and KV, make a step's latency depend on it.
    tp_size: int = 1


def mismatches(profile: Profile, running: RuntimeIdentity) -> list[str]:
    """Human-readable differences between the profile and the running system."""
    prov = profile.provenance
    found = []
    if prov.device_name != running.device_name:
        found.append(f"GPU: profile measured on {prov.device_name!r}, running on {running.device_name!r}")
    if prov.sm_count != running.sm_count:
        found.append(f"SM count: profile {prov.sm_count}, running device {running.sm_count}")
    model = model_mismatch(profile, running.model_config_hash)
    if model is not None:
        found.append(model)
    if prov.model.dtype != running.model_dtype:
        found.append(f"model dtype: profile {prov.model.dtype}, served {running.model_dtype}")
    if profile.ladder != running.ladder:
        found.append(f"SM ladder: profile has {profile.ladder.describe()}; running {running.ladder.describe()}")
    tp = tp_mismatch(profile, running.tp_size)
    if tp is not None:
        found.append(tp)
    return found


def tp_mismatch(profile: Profile, tp_size: int) -> str | None:
    """How the profile's tensor-parallel degree differs from the running one, or None.
    Needs only the server's ``--tp-size``: a launcher checks it before the model loads."""
    measured = profile.provenance.tp_size
    if measured == tp_size:
        return None
    return f"TP degree: profile measured at tp={measured}, running tp={tp_size} (`harvest profile --tp {tp_size}` measures one)"


def model_mismatch(profile: Profile, model_config_hash: str) -> str | None:
    """How the profile's model differs from the served one (by :func:`model_config_hash`),
    or None. Needs only the served checkpoint's config.json: a launcher checks it before
    the model loads."""
    model = profile.provenance.model
    if model.config_hash == model_config_hash:
        return None
    return (f"model: profile is for {model.name!r} (config hash {model.config_hash}), the served model's config "
            f"hash is {model_config_hash}")


def check_compatible(profile: Profile, running: RuntimeIdentity, allow_mismatch: bool = False, source: str = "profile") -> list[str]:
    """Raise ProfileMismatchError listing every mismatch, or with ``allow_mismatch`` warn
    (``RuntimeWarning``) and return them."""
    found = mismatches(profile, running)
    if not found:
        return found
    listing = "; ".join(found)
    if not allow_mismatch:
        raise ProfileMismatchError(
            f"{source} does not match the running system: {listing}. Re-run `harvest profile` on this "
            f"machine and model, or override with allow_mismatch (predictions will be off)"
        )
    warnings.warn(f"{source} does not match the running system (override in effect): {listing}", RuntimeWarning, stacklevel=2)
    return found


def load_for(path: str | Path, running: RuntimeIdentity, allow_mismatch: bool = False) -> Profile:
    """Load and validate ``path``, then check it against the running system."""
    profile = Profile.load(path)
    check_compatible(profile, running, allow_mismatch, source=f"profile {path}")
    return profile


# How far a job's micro-batches may differ in size from the co-run workload's before the
# server says the profile's co-run slow-down may not hold for it: a unit of twice the
# tokens runs kernels twice as long beside decode (the H200 run of 2026-11-26 measured
# 0.78 % steps over target with 4x the tokens; docs/gpu-validation.md).
CORUN_UNITS_TOLERANCE = 2.0


def corun_units_mismatch(profile: Profile, job_micro_batch_tokens: float, job: str = "the job") -> str | None:
    """How the job's micro-batches differ from those the profile's co-run stage ran
    beside decode (by mean non-padding tokens), when by more than
    :data:`CORUN_UNITS_TOLERANCE` times either way; None when they agree, or when the
    profile does not record its co-run micro-batches (written before it did)."""
    finetune = profile.provenance.finetune
    measured = finetune.micro_batch_tokens
    if measured is None or not job_micro_batch_tokens > 0:
        return None
    ratio = job_micro_batch_tokens / measured
    if 1 / CORUN_UNITS_TOLERANCE <= ratio <= CORUN_UNITS_TOLERANCE:
        return None
    return (f"{job}'s micro-batches carry {job_micro_batch_tokens:.0f} tokens, {ratio:.2g}x the {measured:.0f} the "
            f"profile's co-run stage ran beside decode ({finetune.workload}): the co-run slow-down the scheduler "
            f"predicts was measured with other units (larger ones press on decode harder: steps over target); "
            f"`harvest profile --finetune-job <this job file>` measures it with this job's units")
