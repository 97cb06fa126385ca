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


def served_model_path(sglang_args: list[str]) -> str | None:
    """The checkpoint given as ``--model-path`` (or SGLang's alias ``--model``); None when
    the command line does not give it (SGLang's own ``--config`` file may: the plugin's
    hook, which sees SGLang's parsed arguments, then compares the profile with it)."""
    parser = argparse.ArgumentParser(add_help=False, allow_abbrev=False, exit_on_error=False)
    parser.add_argument("--model-path", "--model", dest="model_path", default=None)
    try:
        known, _ = parser.parse_known_args(sglang_args)
    except argparse.ArgumentError:  # e.g. the flag without a value: SGLang's parser says so
        return None
    return known.model_path


def run(args) -> int:
    from harvest.preflight import PreflightError, check

    if not args.sglang_args:
        print("harvest launch: no SGLang arguments (e.g. harvest launch -- --model-path M)", file=sys.stderr)
        return 2
    try:
        command = build_command(args.config, args.sglang_args)
        check(args.config, model_path=served_model_path(args.sglang_args))
    except (PreflightError, ValueError) as exc:
        print(f"harvest launch: {exc}", file=sys.stderr)
        return 2
    from harvest.compute import device

    device.default_cuda_connections()  # before any CUDA in the server's processes; the operator's value wins
    sys.stdout.flush()
    os.execv(command[0], command)
    return 0  # not reached
