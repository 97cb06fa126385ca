"""Write a ready co-location setup for the tiny local model: a LoRA job and harvest.yaml.

Used by `harvest demo`, the co-location tests and scripts/bench_colocate.py, so all three
exercise the same files an operator would write. The job trains LoRA adapters on the small
alpaca-format dataset shipped in harvest/data/demo; the profile is the committed CPU
profile of the tiny model (``allow_profile_mismatch`` because the CPU it was measured on
may differ from this one; online refinement corrects the coefficients as steps are seen).
"""

from __future__ import annotations

from pathlib import Path

import yaml

from harvest.config_env import PROJECT_ROOT

DEMO_DATA = Path(__file__).resolve().parent / "data" / "demo"
CPU_PROFILE = PROJECT_ROOT / "profiles" / "cpu-tiny-llama-sglang.json"


def write(directory: Path, model_path: Path, *, target_tpot_ms: float = 40.0, max_steps: int = 100_000,
          metrics_port: int = 0, profile: Path = CPU_PROFILE, save_steps: int = 500,
          share_served_weights: bool = False, job_keys: dict | None = None, jobs: dict | None = None,
          config_keys: dict | None = None) -> Path:
    """Write the job file(s) and ``harvest.yaml`` into ``directory``; return harvest.yaml's path.

    The job's base is the served model, so by default sharing is turned off here: the
    demo and the tests then exercise the general path (frozen weights swapped through a
    window of lent KV memory), which a job on another base model always takes. ``job_keys``:
    more LlamaFactory keys for the job (or replacements). ``jobs``: several jobs instead of
    ``job.yaml``, as ``{name: harvest-section keys}`` (weight, serve_as, ...): each is
    ``job-<name>.yaml`` writing to ``adapter-<name>``. ``config_keys``: more harvest.yaml
    sections (queue, ...)."""
    directory.mkdir(parents=True, exist_ok=True)
    names = []
    for name, harvest_keys in (jobs or {None: {}}).items():
        names.append(write_job(directory, model_path, name, max_steps=max_steps, save_steps=save_steps,
                               job_keys=job_keys, harvest_keys=harvest_keys).name)
    config = {
        "qos": {"target_tpot_ms": target_tpot_ms},
        "profile": str(profile),
        "allow_profile_mismatch": True,
        "jobs": names,
        "share_served_weights": share_served_weights,
        "metrics": {"port": metrics_port},
        **(config_keys or {}),
    }
    path = directory / "harvest.yaml"
    path.write_text(yaml.safe_dump(config, sort_keys=False))
    return path


def write_job(directory: Path, model_path: Path, name: str | None = None, *, max_steps: int = 100_000,
              save_steps: int = 500, job_keys: dict | None = None, harvest_keys: dict | None = None) -> Path:
    """One LoRA job on the demo data: ``job.yaml`` (no name) or ``job-<name>.yaml``,
    named ``name`` in the server; returns its path."""
    directory.mkdir(parents=True, exist_ok=True)
    suffix = "" if name is None else f"-{name}"
    job = {
        "model_name_or_path": str(model_path), "template": "default",
        "dataset": "demo_alpaca", "dataset_dir": str(DEMO_DATA), "finetuning_type": "lora",
        "lora_rank": 4, "lora_alpha": 8, "lora_target": "all", "cutoff_len": 64, "learning_rate": 1e-3,
        "per_device_train_batch_size": 2, "gradient_accumulation_steps": 1, "max_steps": max_steps,
        "output_dir": str(directory / f"adapter{suffix}"), "save_steps": save_steps, "seed": 0,
        "harvest": {"micro_batch_size": 2, **({"name": name} if name else {}), **(harvest_keys or {})},
        **(job_keys or {}),
    }
    path = directory / f"job{suffix}.yaml"
    path.write_text(yaml.safe_dump(job, sort_keys=False))
    return path
