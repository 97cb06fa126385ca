"""The one place harvest reads ``HARVEST_*`` environment variables.

Every other module asks here, so the full list of knobs is this file, and a bad value is
rejected with the variable's name instead of being silently ignored.
"""

from __future__ import annotations

import os
from pathlib import Path

from harvest import addresses

PROJECT_ROOT = Path(__file__).resolve().parent.parent


def cache_dir() -> Path:
    """HARVEST_CACHE_DIR: where built artefacts (tiny models, ...) are cached.

    Default: ``<project>/.cache`` for a source checkout, ``~/.cache/harvest`` otherwise.
    """
    value = os.environ.get("HARVEST_CACHE_DIR")
    if value:
        return Path(value).expanduser()
    if (PROJECT_ROOT / "pyproject.toml").is_file():
        return PROJECT_ROOT / ".cache"
    return Path.home() / ".cache" / "harvest"


def native_lib_dir() -> Path | None:
    """HARVEST_NATIVE_DIR: a directory holding libharvest_*.so, searched first."""
    value = os.environ.get("HARVEST_NATIVE_DIR")
    if not value:
        return None
    path = Path(value).expanduser()
    if not path.is_dir():
        raise ValueError(f"HARVEST_NATIVE_DIR={value!r} is not a directory")
    return path


_LOG_LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR")


def log_level() -> str:
    """HARVEST_LOG_LEVEL: one of DEBUG, INFO (default), WARNING, ERROR."""
    value = os.environ.get("HARVEST_LOG_LEVEL", "INFO").upper()
    if value not in _LOG_LEVELS:
        raise ValueError(f"HARVEST_LOG_LEVEL={value!r} is not one of {', '.join(_LOG_LEVELS)}")
    return value


# Set by the plugin in the launcher process (from --enable-harvest/--harvest-config) so that
# SGLang's scheduler subprocesses, which inherit the environment, know harvest is on.
ENABLED_VAR = "HARVEST_ENABLED"
CONFIG_VAR = "HARVEST_CONFIG"


def harvest_enabled() -> bool:
    """HARVEST_ENABLED: "1" turns co-location on in SGLang processes (set by --enable-harvest)."""
    value = os.environ.get(ENABLED_VAR, "0")
    if value not in ("0", "1"):
        raise ValueError(f"{ENABLED_VAR}={value!r} must be 0 or 1")
    return value == "1"


def harvest_config_path() -> Path | None:
    """HARVEST_CONFIG: path of harvest.yaml (set by --harvest-config); None = defaults."""
    value = os.environ.get(CONFIG_VAR)
    return Path(value) if value else None


# Set by the plugin in the launcher: the CUDA_DEVICE_MAX_CONNECTIONS harvest's SGLang
# processes must start CUDA with (the operator's value, else 32). SGLang's launcher
# overwrites CUDA_DEVICE_MAX_CONNECTIONS with 8 before it spawns the schedulers, so the
# value travels under this name and the plugin puts it back in each scheduler process.
CUDA_CONNECTIONS_VAR = "HARVEST_CUDA_DEVICE_MAX_CONNECTIONS"


def cuda_connections() -> str | None:
    """HARVEST_CUDA_DEVICE_MAX_CONNECTIONS: a positive integer, or None when unset."""
    value = os.environ.get(CUDA_CONNECTIONS_VAR)
    if not value:
        return None
    if not value.isdigit() or int(value) < 1:
        raise ValueError(f"{CUDA_CONNECTIONS_VAR}={value!r} must be a positive integer")
    return value


def fault_after_units() -> int | None:
    """HARVEST_FAULT_AFTER_UNITS: test knob; the co-located trainer raises after this many
    units (fault-isolation tests). Unset in production."""
    value = os.environ.get("HARVEST_FAULT_AFTER_UNITS")
    if not value:
        return None
    if not value.isdigit():
        raise ValueError(f"HARVEST_FAULT_AFTER_UNITS={value!r} must be a non-negative integer")
    return int(value)


def fault_rank() -> int | None:
    """HARVEST_FAULT_RANK: test knob with HARVEST_FAULT_AFTER_UNITS; only this tensor-parallel
    rank's trainer raises (unset: every rank's)."""
    value = os.environ.get("HARVEST_FAULT_RANK")
    if not value:
        return None
    if not value.isdigit():
        raise ValueError(f"HARVEST_FAULT_RANK={value!r} must be a non-negative integer")
    return int(value)


# Per-instance overrides of harvest.yaml's metrics.port / metrics.host: several SGLang
# servers on one host (one per GPU) share a harvest.yaml but not a port. The plugin sets
# them in the launcher from --harvest-metrics-port / --harvest-metrics-host (the command
# line wins over the environment), and SGLang's scheduler processes inherit them.
METRICS_PORT_VAR = "HARVEST_METRICS_PORT"
METRICS_HOST_VAR = "HARVEST_METRICS_HOST"


def metrics_port() -> int | None:
    """HARVEST_METRICS_PORT: 1..65535 or 0 (endpoint off), or None when unset."""
    value = os.environ.get(METRICS_PORT_VAR)
    if not value:
        return None
    try:
        return addresses.parse_port(value, zero="off")
    except addresses.AddressError as error:
        raise ValueError(addresses.named(METRICS_PORT_VAR, error)) from None


def metrics_host() -> str | None:
    """HARVEST_METRICS_HOST: the address harvest's endpoint listens on (an IPv6 one without
    brackets), or None when unset."""
    value = os.environ.get(METRICS_HOST_VAR)
    if value is None or not value.strip():
        return None
    try:
        return addresses.parse_host(value)
    except addresses.AddressError as error:
        raise ValueError(addresses.named(METRICS_HOST_VAR, error)) from None


CLIENT_API_KEY_VAR = "HARVEST_API_KEY"


def client_api_key() -> str | None:
    """HARVEST_API_KEY: the key `harvest ctl` and `harvest top` send to a server's control
    endpoint (SGLang's admin key, or its API key when it has no admin key). Not the
    server's own setting: a server takes its keys from SGLang's --api-key/--admin-api-key."""
    return os.environ.get(CLIENT_API_KEY_VAR) or None
