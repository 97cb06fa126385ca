"""Entry point of harvest's SGLang plugin (group ``sglang.srt.plugins``).

SGLang calls :func:`load` in every process it starts. It registers harvest's command-line
flags, the pre-flight check around ``ServerArgs.from_cli_args`` (its job check awaited
around the launcher's wait for its schedulers) and the co-location hooks of
:mod:`harvest.sglang.hooks`. Invariants: a server without ``--enable-harvest`` is never
affected; with it, a wrong SGLang version or an unresolved hook target refuses start-up
from ``from_cli_args`` or ``Scheduler.__init__`` (SGLang swallows exceptions from ``load``
itself); each scheduler subprocess gets back the CUDA_DEVICE_MAX_CONNECTIONS harvest needs.

Rules: docs/sglang-integration.md, 'The plugin's entry point (harvest/sglang/plugin.py)'.
"""

from __future__ import annotations

import importlib.metadata
import os
import pkgutil
from pathlib import Path

from harvest import addresses, config_env
from harvest.logs import get_logger
from harvest.sglang import SUPPORTED_SGLANG_VERSION

logger = get_logger(__name__)

LOADED_MESSAGE = "harvest plugin loaded"

SERVER_ARGS = "sglang.srt.server_args.ServerArgs"
# The launcher's wait for its schedulers' "ready" (the model loaded), where it awaits
# harvest's job check.
SCHEDULERS_READY_WAIT = "sglang.srt.entrypoints.engine._wait_for_scheduler_ready"


class HarvestStartupError(RuntimeError):
    """harvest is enabled but cannot run on this server: refuse to start."""


def version_problem(version: str) -> str | None:
    """Why harvest cannot hook this SGLang version, or None when it can."""
    if version == SUPPORTED_SGLANG_VERSION:
        return None
    # Hooks target SGLang internals that move between versions: never guess.
    return (
        f"harvest supports sglang=={SUPPORTED_SGLANG_VERSION}, found {version}; "
        "install the supported version or run without --enable-harvest"
    )


def unresolvable_targets(targets: list[str]) -> list[str]:
    missing = []
    for target in targets:
        try:
            pkgutil.resolve_name(target)
        except (ImportError, AttributeError, ValueError):
            missing.append(target)
    return missing


def _add_cli_args(result, parser):
    group = parser.add_argument_group("harvest (LoRA finetuning in idle decode capacity)")
    group.add_argument("--enable-harvest", action="store_true", help="co-locate the finetune job(s) of --harvest-config")
    group.add_argument("--harvest-config", type=str, default=None, help="path of harvest.yaml (default: built-in defaults)")
    group.add_argument("--harvest-metrics-port", type=addresses.port_type(zero="off"), default=None,
                       help="this instance's port for harvest's /metrics and control endpoints, over metrics.port of "
                            "harvest.yaml (1-65535; 0: off)")
    group.add_argument("--harvest-metrics-host", type=addresses.host_type(), default=None,
                       help="the address they listen on, over metrics.host of harvest.yaml (default: --host)")
    return result


def _from_cli_args(original, cls, args):
    enabled = getattr(args, "enable_harvest", False)
    config_path = getattr(args, "harvest_config", None)
    overrides = {config_env.METRICS_PORT_VAR: getattr(args, "harvest_metrics_port", None),
                 config_env.METRICS_HOST_VAR: getattr(args, "harvest_metrics_host", None)}
    if config_path and not enabled:
        raise HarvestStartupError("--harvest-config given without --enable-harvest")
    if any(value is not None for value in overrides.values()) and not enabled:
        raise HarvestStartupError("--harvest-metrics-port/--harvest-metrics-host given without --enable-harvest")
    if enabled:
        _refuse_if_broken()
        for var, value in overrides.items():  # the command line wins over the environment
            if value is not None:
                os.environ[var] = str(value)
        from harvest.compute import device
        from harvest.preflight import CHECKS, LAUNCHER_CHECKS, PreflightError, check, start_job_check

        if config_path:
            config_path = str(Path(config_path).expanduser().resolve())  # the subprocesses may start elsewhere
        tp_size = getattr(args, "tp_size", 1)
        # The job check sets up the CUDA device (LlamaFactory's TrainingArguments): where a
        # driver could give the launcher a context, it runs in a child beside SGLang's
        # start-up; where there is none (a CPU server) it runs here with the others, 0.4 s
        # against the child's 6-7 s of imports (docs/measurements.md).
        job_check_in_child = device.cuda_driver_present()
        try:
            config = check(config_path, model_path=getattr(args, "model_path", None),
                           sglang_host=getattr(args, "host", None), tp_size=tp_size,
                           checks=LAUNCHER_CHECKS if job_check_in_child else CHECKS)
        except PreflightError as exc:  # names the file and the field
            raise HarvestStartupError(str(exc)) from None
        os.environ[config_env.ENABLED_VAR] = "1"
        _record_cuda_connections()
        if config_path:
            os.environ[config_env.CONFIG_VAR] = config_path
        logger.info("harvest enabled (config: %s)", config_path or "defaults")
        server_args = original(cls, args)
        global _job_check
        _job_check = start_job_check(config_path, tp_size=tp_size) if config.jobs and job_check_in_child else None
        return server_args
    return original(cls, args)


# The job files' pre-flight check, running in a child process from the launcher's
# from_cli_args until the launcher waits for its schedulers (_await_job_check).
_job_check = None


def _await_job_check(original, *args, **kwargs):
    # Launcher: the schedulers have started loading the model; before SGLang serves, the
    # job check's verdict. A refusal ends start-up here (SGLang's launcher then ends its
    # children); the schedulers check the same files again when they build the trainer.
    global _job_check
    pending, _job_check = _job_check, None
    if pending is not None:
        from harvest.preflight import PreflightError

        try:
            pending.result()
        except PreflightError as exc:  # names the file and the field
            raise HarvestStartupError(str(exc)) from None
    return original(*args, **kwargs)


_problems: list[str] = []


def _record_cuda_connections() -> None:
    """Launcher: the CUDA_DEVICE_MAX_CONNECTIONS harvest's processes start CUDA with."""
    from harvest.compute import device

    value = device.default_cuda_connections()  # the operator's value wins
    os.environ[config_env.CUDA_CONNECTIONS_VAR] = value


def _restore_cuda_connections() -> None:
    """Subprocess of a harvest launcher, before CUDA starts: undo SGLang's 8."""
    value = config_env.cuda_connections()
    if value is None:
        return
    from harvest.compute import device

    before = os.environ.get(device.CUDA_CONNECTIONS_VAR)
    if before != value:
        os.environ[device.CUDA_CONNECTIONS_VAR] = value
        logger.info("%s=%s for harvest's streams (was %s)", device.CUDA_CONNECTIONS_VAR, value, before)


def _refuse_if_broken() -> None:
    if _problems:
        raise HarvestStartupError("harvest cannot run on this SGLang: " + "; ".join(_problems))


def load() -> bool:
    """Plugin entry point. Returns whether harvest's hooks were registered."""
    from sglang.srt.plugins.hook_registry import HookRegistry, HookType

    from harvest.sglang import hooks

    if config_env.harvest_enabled():
        _restore_cuda_connections()
    version = importlib.metadata.version("sglang")
    _problems.clear()
    problem = version_problem(version)
    if problem is not None:
        _problems.append(problem)
    from harvest.sglang import level_graphs, refusals

    missing = unresolvable_targets([f"{SERVER_ARGS}.add_cli_args", f"{SERVER_ARGS}.from_cli_args",
                                    SCHEDULERS_READY_WAIT, *hooks.TARGETS,
                                    *level_graphs.SGLANG_ATTRIBUTES, *refusals.SGLANG_ATTRIBUTES])
    if missing:
        _problems.append("hook target(s) not found: " + ", ".join(missing))

    # The flags are registered whatever happens, so `--enable-harvest` on a broken
    # install reaches _from_cli_args and refuses loudly instead of "unknown flag".
    if f"{SERVER_ARGS}.add_cli_args" not in missing:
        HookRegistry.register(f"{SERVER_ARGS}.add_cli_args", _add_cli_args, HookType.AFTER)
    if f"{SERVER_ARGS}.from_cli_args" not in missing:
        HookRegistry.register(f"{SERVER_ARGS}.from_cli_args", _from_cli_args, HookType.AROUND)
    if SCHEDULERS_READY_WAIT not in missing:
        HookRegistry.register(SCHEDULERS_READY_WAIT, _await_job_check, HookType.AROUND)
    if _problems:
        if config_env.harvest_enabled():
            # A subprocess of a launcher that enabled harvest: refuse in Scheduler.__init__.
            HookRegistry.register(f"{hooks.SCHEDULER}.__init__", _refuse_in_scheduler, HookType.BEFORE)
        logger.error("harvest plugin NOT active: %s", "; ".join(_problems))
        return False
    hooks.register(HookRegistry, HookType)
    logger.info("%s (sglang %s, pid %d)", LOADED_MESSAGE, version, os.getpid())
    return True


def _refuse_in_scheduler(*args, **kwargs):
    _refuse_if_broken()
