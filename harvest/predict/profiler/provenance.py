"""Where and with what a profile is measured: device identity, versions, model identity.

The device is named by :func:`harvest.compute.device.device_identity`, the function a
serving process also uses to check the profile it is given, so the two sides describe a
device in the same words.
"""

from __future__ import annotations

import datetime
import importlib.metadata
import platform
import shlex
from pathlib import Path

import harvest
from harvest.compute.device import DeviceIdentity
from harvest.ladder import Ladder
from harvest.predict.compat import model_config_hash_of_path
from harvest.predict.schema import FinetuneIdentity, MeasurementSettings, ModelIdentity, Provenance


def _version(distribution: str) -> str | None:
    try:
        return importlib.metadata.version(distribution)
    except importlib.metadata.PackageNotFoundError:
        return None


def collect(
    device: DeviceIdentity,
    ladder: Ladder,
    engine: str,
    model: ModelIdentity,
    finetune: FinetuneIdentity,
    measurement: MeasurementSettings,
    argv: list[str],
    tp_size: int = 1,
) -> Provenance:
    import torch

    return Provenance(
        device_kind=device.kind,
        device_name=device.name,
        sm_count=ladder.total_sms,
        compute_capability=device.compute_capability,
        driver_version=device.driver_version,
        torch_version=torch.__version__,
        sglang_version=_version("sglang"),
        transformers_version=_version("transformers"),
        peft_version=_version("peft"),
        harvest_version=harvest.__version__,
        python_version=platform.python_version(),
        platform=platform.platform(),
        engine=engine,
        model=model,
        finetune=finetune,
        measurement=measurement,
        created_utc=datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ"),
        command_line=shlex.join(argv),
        tp_size=tp_size,
    )


def model_identity(model_path: str, dtype: str, random_weights: bool) -> ModelIdentity:
    return ModelIdentity(
        path=model_path,
        name=Path(model_path).name,
        config_hash=model_config_hash_of_path(model_path),
        dtype=dtype,
        random_weights=random_weights,
    )
