"""`harvest launch [--config harvest.yaml] -- <sglang launch_server args>`.

The same as ``python -m sglang.launch_server <args> --enable-harvest --harvest-config
harvest.yaml``: the config is validated here first (a bad field fails before SGLang
loads a model), then this process becomes SGLang's launcher (exec, same PID), with
CUDA_DEVICE_MAX_CONNECTIONS set to 32 unless the operator set it (harvest.compute.device).
"""

from __future__ import annotations

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


def run(args) -> int:
    from harvest.config import ConfigError, load

    if not args.sglang_args:
        print("harvest launch: no SGLang arguments (e.g. harvest launch -- --model-path M)", file=sys.stderr)
        return 2
    try:
        if args.config is not None:
            load(args.config)
        command = build_command(args.config, args.sglang_args)
    except (ConfigError, ValueError) as exc:
        print(f"harvest launch: {exc}", file=sys.stderr)
        return 2
    from harvest.compute import device

    device.default_cuda_connections()  # before any CUDA in the server's processes; the operator's value wins
    sys.stdout.flush()
    os.execv(command[0], command)
    return 0  # not reached
