"""Where and with what a profile is measured: device identity, versions, model identity.

:func:`device_identity` is also what a serving process should call to build the
:class:`~harvest.predict.compat.RuntimeIdentity` a profile is checked against, so the
two sides describe a device in the same words.
"""

from __future__ import annotations

import dataclasses
import datetime
import importlib.metadata
import os
import platform
import shlex
import sys
from pathlib import Path

import harvest
from harvest.predict.compat import RuntimeIdentity, model_config_hash_of_path
from harvest.ladder import Ladder
from harvest.predict.schema import FinetuneIdentity, MeasurementSettings, ModelIdentity, Provenance


@dataclasses.dataclass(frozen=True)
class DeviceIdentity:
    kind: str  # "cuda" or "cpu"
    name: str
    compute_capability: str | None
    driver_version: str | None


def _cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def device_identity(device: str) -> DeviceIdentity:
    """The device as profiles name it. A CPU's name includes its core count, since that,
    not an SM ladder, decides how fast it decodes."""
    if device == "cpu":
        return DeviceIdentity("cpu", f"{_cpu_name()} ({os.cpu_count()} logical cores)", None, None)
    import torch

    index = torch.device(device).index or 0
    props = torch.cuda.get_device_properties(index)
    driver = None
    try:
        from harvest import doctor

        _, _, driver_version = doctor.probe_gpus()
        driver = str(driver_version) if driver_version is not None else None
    except Exception:  # noqa: BLE001 - the driver version is informative, not required
        driver = None
    return DeviceIdentity("cuda", props.name, f"{props.major}.{props.minor}", driver)


def running_identity(device: str, model_path: str, model_dtype: str, ladder: Ladder) -> RuntimeIdentity:
    """What a profile must match to be used on this device with this model and ladder."""
    return RuntimeIdentity(
        device_name=device_identity(device).name,
        sm_count=ladder.total_sms,
        model_config_hash=model_config_hash_of_path(model_path),
        model_dtype=model_dtype,
        ladder=ladder,
    )


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
    )


def model_identity(model_path: str, dtype: str, random_weights: bool) -> ModelIdentity:
    return ModelIdentity(
        path=model_path,
        name=Path(model_path).name,
        config_hash=model_config_hash_of_path(model_path),
        dtype=dtype,
        random_weights=random_weights,
    )


def python_switch_interval() -> float:
    return sys.getswitchinterval()
