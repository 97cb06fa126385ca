"""`harvest launch [--config harvest.yaml] -- <sglang launch_server args>`.

The same as ``python -m sglang.launch_server <args> --enable-harvest --harvest-config
harvest.yaml``: harvest's pre-flight check runs here first (harvest.preflight: harvest.yaml,
its profile's content, its job files; a bad field fails with one message and exit status 2
before SGLang starts), then this process becomes SGLang's launcher (exec, same PID), with
CUDA_DEVICE_MAX_CONNECTIONS set to 32 unless the operator set it (harvest.compute.device).
SGLang's launcher runs the same check again in the plugin's hook (a server may also be
started without this command).
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

SGLANG_DEFAULT_HOST = "127.0.0.1"  # sglang.launch_server's --host default
HELP = "start an SGLang server with harvest enabled (arguments after -- go to sglang.launch_server)"


def add_arguments(parser) -> None:
    parser.add_argument("--config", default=None, help="harvest.yaml (default: built-in defaults)")
    parser.add_argument("sglang_args", nargs="*", metavar="-- SGLANG_ARGS", help="arguments for sglang.launch_server")


def build_command(config: str | None, sglang_args: list[str]) -> list[str]:
    args = list(sglang_args)
    if "--enable-harvest" not in args:
        args.append("--enable-harvest")
    if config is not None:
        if "--harvest-config" in args or any(a.startswith("--harvest-config=") for a in args):
            raise ValueError("give the config either as --config or as --harvest-config after --, not both")
        args += ["--harvest-config", config]
    return [sys.executable, "-m", "sglang.launch_server", *args]


def sglang_flags(sglang_args: list[str]) -> argparse.Namespace:
    """The SGLang flags the pre-flight check looks at: the checkpoint (``--model-path`` or
    SGLang's alias ``--model``), ``--host``, the tensor-parallel degree (``--tp-size``, its
    alias ``--tensor-parallel-size``, or ``--tp`` as SGLang's parser abbreviates it: the
    profile must be of that degree), and the per-instance metrics endpoint. Each
    None when the command line does not give it (SGLang's own ``--config`` file may: the
    plugin's hook, which sees SGLang's parsed arguments, checks again with those)."""
    parser = argparse.ArgumentParser(add_help=False, allow_abbrev=False, exit_on_error=False)
    parser.add_argument("--model-path", "--model", dest="model_path", default=None)
    parser.add_argument("--host", default=None)
    parser.add_argument("--tp-size", "--tp", "--tensor-parallel-size", dest="tp_size", type=int, default=None)
    parser.add_argument("--harvest-metrics-port", default=None)
    parser.add_argument("--harvest-metrics-host", default=None)
    try:
        known, _ = parser.parse_known_args(sglang_args)
    except argparse.ArgumentError:  # e.g. a flag without a value: SGLang's parser says so
        return argparse.Namespace(model_path=None, host=None, tp_size=None, harvest_metrics_port=None,
                                  harvest_metrics_host=None)
    return known


def served_model_path(sglang_args: list[str]) -> str | None:
    """The checkpoint given as ``--model-path`` or ``--model`` (None: not on the command line)."""
    return sglang_flags(sglang_args).model_path


def run(args) -> int:
    from harvest.preflight import PreflightError, check

    if not args.sglang_args:
        print("harvest launch: no SGLang arguments (e.g. harvest launch -- --model-path M)", file=sys.stderr)
        return 2
    try:
        command = build_command(args.config, args.sglang_args)
        flags = sglang_flags(args.sglang_args)
        # The per-instance endpoint flags as the plugin will apply them (the command line
        # over the environment); the exec'd launcher inherits the same values. Checked
        # here as the plugin's parser checks them, so that the error names the flag.
        from harvest import addresses, config_env

        for flag, var, value, parse in (
                ("--harvest-metrics-port", config_env.METRICS_PORT_VAR, flags.harvest_metrics_port,
                 lambda text: addresses.parse_port(text, zero="off")),
                ("--harvest-metrics-host", config_env.METRICS_HOST_VAR, flags.harvest_metrics_host, addresses.parse_host)):
            if value is not None:
                try:
                    os.environ[var] = str(parse(value))
                except addresses.AddressError as error:
                    raise ValueError(addresses.named(flag, error)) from None
        if flags.model_path is not None and flags.model_path.startswith(("/", "./", "../", "~")):
            # a path, not a hub name: SGLang would start and die in a traceback over it
            if not Path(flags.model_path).expanduser().exists():
                raise ValueError(f"--model-path {flags.model_path}: no such folder")
        check(args.config, model_path=flags.model_path, sglang_host=flags.host or SGLANG_DEFAULT_HOST,
              tp_size=flags.tp_size)
    except (PreflightError, ValueError) as exc:
        print(f"harvest launch: {exc}", file=sys.stderr)
        return 2
    from harvest.compute import device

    device.default_cuda_connections()  # before any CUDA in the server's processes; the operator's value wins
    sys.stdout.flush()
    os.execv(command[0], command)
    return 0  # not reached
