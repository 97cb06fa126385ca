"""Checkpoints: a PEFT adapter plus the state needed to resume exactly, written atomically.

``<output_dir>/checkpoint-<step>/`` holds the PEFT adapter (loadable by PEFT and SGLang's
LoRA serving), the optimizer, schedule and RNG state (not with ``save_only_model``), the
Hugging Face ``trainer_state.json`` and, written last, ``harvest_state.json`` (step, data
position, micro-batch size, job fingerprint, a SHA-256 of every other file). Invariants:
a kill at any moment leaves the complete checkpoint or none (written into a temporary
folder, fsynced, renamed); a resume refuses, with a message, a checkpoint whose state file
is missing or whose checksums disagree.

Rules: docs/jobs.md, 'Checkpoints that cannot lie'.
"""

from __future__ import annotations

import hashlib
import json
import os
import random
import re
import shutil
from pathlib import Path
from typing import Any

import numpy as np
import torch

from harvest.train.errors import CheckpointError

STATE_FILE = "harvest_state.json"
FORMAT_VERSION = 1
_ADAPTER_FILES = ("adapter_config.json", "adapter_model.safetensors")
_STATE_FILES = ("optimizer.pt", "scheduler.pt", "rng_state.pth")
_OPTIONAL_FILES = ("trainer_state.json",)
_CHECKPOINT_NAME = re.compile(r"^checkpoint-(\d+)$")


def capture_rng_state(device: torch.device) -> dict[str, Any]:
    state = {
        "python": random.getstate(),
        "numpy": _numpy_state_to_tensors(np.random.get_state()),
        "torch": torch.get_rng_state(),
    }
    if device.type == "cuda":
        state["cuda"] = torch.cuda.get_rng_state(device)
    return state


def restore_rng_state(state: dict[str, Any], device: torch.device) -> None:
    random.setstate(_to_tuple(state["python"]))
    kind, keys, pos, has_gauss, cached = state["numpy"]
    np.random.set_state((kind, keys.numpy(), int(pos), int(has_gauss), float(cached)))
    torch.set_rng_state(state["torch"])
    if device.type == "cuda" and "cuda" in state:
        torch.cuda.set_rng_state(state["cuda"], device)


def save_checkpoint(output_dir: Path, step: int, *, peft_model, optimizer, scheduler,
                    rng_state: dict[str, Any], state: dict[str, Any], save_total_limit: int | None = None,
                    text_files: dict[str, str] | None = None, model_only: bool = False) -> Path:
    """Write checkpoint-`step` atomically and return its path. ``text_files``: more files
    by name (trainer_state.json); ``model_only``: no optimizer, schedule or RNG state."""
    output_dir.mkdir(parents=True, exist_ok=True)
    final = output_dir / f"checkpoint-{step}"
    staging = output_dir / f".tmp-checkpoint-{step}-{os.getpid()}"
    shutil.rmtree(staging, ignore_errors=True)
    staging.mkdir()
    try:
        # The window's evicted weights are meta placeholders; save_pretrained only reads
        # the adapter's tensors. save_embedding_layers=False: no hub lookups, no base weights.
        peft_model.save_pretrained(str(staging), save_embedding_layers=False)
        names = list(_ADAPTER_FILES)
        if not model_only:
            torch.save(optimizer.state_dict(), staging / "optimizer.pt")
            torch.save(scheduler.state_dict(), staging / "scheduler.pt")
            torch.save(rng_state, staging / "rng_state.pth")
            names += _STATE_FILES
        for name, text in (text_files or {}).items():
            (staging / name).write_text(text)
            names.append(name)
        checksums = {name: _sha256(staging / name) for name in names}
        document = {"format_version": FORMAT_VERSION, "global_step": step, **state, "model_only": model_only,
                    "sha256": checksums}
        (staging / STATE_FILE).write_text(json.dumps(document, indent=2, sort_keys=True))
        for path in staging.iterdir():
            _fsync_file(path)
        _fsync_dir(staging)
        if final.exists():  # e.g. a stop right after a periodic save: replace it whole
            retired = output_dir / f".old-checkpoint-{step}-{os.getpid()}"
            os.rename(final, retired)
            os.rename(staging, final)
            shutil.rmtree(retired, ignore_errors=True)
        else:
            os.rename(staging, final)
        _fsync_dir(output_dir)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    if save_total_limit:
        _prune(output_dir, keep=save_total_limit)
    return final


def read_checkpoint_state(path: Path) -> dict[str, Any]:
    """The verified state document of a checkpoint. Raises `CheckpointError` if the
    checkpoint is incomplete or any file's checksum disagrees."""
    state_path = path / STATE_FILE
    if not path.is_dir():
        raise CheckpointError(f"checkpoint {str(path)!r} does not exist")
    if not state_path.is_file():
        raise CheckpointError(f"checkpoint {str(path)!r} has no {STATE_FILE}: it is not a harvest checkpoint or was "
                              "not completely written; refusing to resume (delete it to resume from an earlier "
                              "checkpoint, or set overwrite_output_dir: true to start over)")
    try:
        state = json.loads(state_path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise CheckpointError(
            f"checkpoint {str(path)!r}: {STATE_FILE} is corrupt ({exc}); refusing to resume") from None
    if state.get("format_version") != FORMAT_VERSION:
        raise CheckpointError(f"checkpoint {str(path)!r} has format version {state.get('format_version')!r}, "
                              f"this harvest reads {FORMAT_VERSION}; refusing to resume")
    for name, expected in state.get("sha256", {}).items():
        file_path = path / name
        if not file_path.is_file():
            raise CheckpointError(f"checkpoint {str(path)!r} is missing {name}; refusing to resume")
        if _sha256(file_path) != expected:
            raise CheckpointError(f"checkpoint {str(path)!r} is corrupt: {name} does not match its recorded "
                                  "SHA-256; refusing to resume (delete the checkpoint to resume from an earlier "
                                  "one, or set overwrite_output_dir: true to start over)")
    listed = set(state.get("sha256", {}))
    required = set(_ADAPTER_FILES) | (set() if state.get("model_only") else set(_STATE_FILES))
    if not required <= listed <= required | set(_OPTIONAL_FILES):
        raise CheckpointError(f"checkpoint {str(path)!r} does not list all of its files; refusing to resume")
    if state.get("model_only"):
        raise CheckpointError(f"checkpoint {str(path)!r} was saved with save_only_model: true (adapter only, no "
                              "optimizer, schedule or RNG state): it cannot be resumed exactly; set "
                              "overwrite_output_dir: true to start over, or resume_from_checkpoint to an earlier one")
    return state


def check_resumable(path: Path, *, total_steps: int, fingerprint: dict[str, Any]) -> dict[str, Any]:
    """The verified state of a checkpoint a job of ``total_steps`` steps and this
    `TrainJob.fingerprint` can resume; `CheckpointError` if it is torn, corrupt, beyond the
    job's steps or written by a different job. Reads the state and checksums, no tensors:
    `harvest train --check` and the build (before the model loads) decide with it."""
    state = read_checkpoint_state(path)
    if int(state["global_step"]) > total_steps:
        raise CheckpointError(
            f"checkpoint {str(path)!r} is at step {state['global_step']}, beyond this job's {total_steps} "
            "steps: it was written by another run; set overwrite_output_dir: true to start over (its "
            "checkpoints are removed) or delete it")
    mismatched = [key for key, value in state.get("job", {}).items() if fingerprint.get(key) != value]
    if mismatched:
        key = mismatched[0]
        raise CheckpointError(
            f"checkpoint {str(path)!r} was written by a different job: {key} was {state['job'][key]!r}, "
            f"the job says {fingerprint.get(key)!r}; refusing to resume")
    return state


def load_checkpoint_tensors(path: Path, peft_model, optimizer, scheduler) -> dict[str, Any]:
    """Load adapter, optimizer and scheduler state from a verified checkpoint; return its RNG state."""
    from peft import set_peft_model_state_dict
    from safetensors.torch import load_file

    adapter_state = load_file(str(path / "adapter_model.safetensors"))
    result = set_peft_model_state_dict(peft_model, adapter_state)
    expected = {name for name, p in peft_model.named_parameters() if p.requires_grad}
    missing = sorted(n for n in getattr(result, "missing_keys", []) if n in expected)
    if missing:
        raise CheckpointError(f"checkpoint {str(path)!r} lacks adapter weights for {missing[0]!r} "
                              f"(and {len(missing) - 1} more): was it written for another LoRA configuration?")
    optimizer.load_state_dict(torch.load(path / "optimizer.pt", weights_only=True))
    scheduler.load_state_dict(torch.load(path / "scheduler.pt", weights_only=True))
    return torch.load(path / "rng_state.pth", weights_only=True)


def list_checkpoints(output_dir: Path) -> list[Path]:
    """Complete-by-name checkpoints, oldest first."""
    if not output_dir.is_dir():
        return []
    found = [(int(m.group(1)), p) for p in output_dir.iterdir() if (m := _CHECKPOINT_NAME.match(p.name)) and p.is_dir()]
    return [p for _, p in sorted(found)]


def write_final_adapter(output_dir: Path, peft_model) -> None:
    """The finished adapter in output_dir itself (as LlamaFactory leaves it), each file
    replaced atomically."""
    staging = output_dir / f".tmp-final-{os.getpid()}"
    shutil.rmtree(staging, ignore_errors=True)
    peft_model.save_pretrained(str(staging), save_embedding_layers=False)
    for path in staging.iterdir():
        _fsync_file(path)
        os.replace(path, output_dir / path.name)
    shutil.rmtree(staging, ignore_errors=True)
    _fsync_dir(output_dir)


def _prune(output_dir: Path, keep: int) -> None:
    for old in list_checkpoints(output_dir)[:-keep]:
        shutil.rmtree(old, ignore_errors=True)


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        for block in iter(lambda: handle.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def _fsync_file(path: Path) -> None:
    with open(path, "rb") as handle:
        os.fsync(handle.fileno())


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _numpy_state_to_tensors(state) -> tuple:
    kind, keys, pos, has_gauss, cached = state
    return (kind, torch.from_numpy(keys.astype(np.int64)), int(pos), int(has_gauss), float(cached))


def _to_tuple(value):
    return tuple(_to_tuple(v) for v in value) if isinstance(value, (list, tuple)) else value
