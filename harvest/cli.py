"""The `harvest` command line. Each subcommand is a module with ``HELP``,
``add_arguments(parser)`` and ``run(args) -> int``; this file only routes.

Command modules must be cheap to import (no torch or sglang at module level): all of
them are imported to build the parser, whichever command runs.
"""

from __future__ import annotations

import argparse
import importlib
import sys

import harvest

# name -> module implementing it. Add a command here and nowhere else.
COMMANDS = {
    "doctor": "harvest.doctor",
    "demo": "harvest.demo",
    "train": "harvest.train.command",
    "fleet-store": "harvest.fleet.command",
    "profile": "harvest.predict.profiler.command",
    "launch": "harvest.sglang.launch",
    "replay": "harvest.replay.command",
    "config-schema": "harvest.config_schema",
    "top": "harvest.metrics.top",
    "ctl": "harvest.sglang.ctl",
}

# Commands that may start CUDA (in this process or in the servers they start) run with
# harvest's CUDA_DEVICE_MAX_CONNECTIONS unless the operator set one
# (harvest.compute.device); doctor reports the shell's own value.
SETS_CUDA_CONNECTIONS = ("train", "profile", "launch", "demo", "replay")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="harvest",
        description="LoRA finetuning in the idle SMs and KV memory of an SGLang decode instance.",
    )
    parser.add_argument("--version", action="version", version=f"harvest {harvest.__version__}")
    commands = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name, module_name in COMMANDS.items():
        module = importlib.import_module(module_name)
        sub = commands.add_parser(name, help=module.HELP, description=module.HELP)
        module.add_arguments(sub)
        sub.set_defaults(_run=module.run)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.command is None:
        parser.print_usage(sys.stderr)
        print("harvest: error: a command is required (see harvest --help)", file=sys.stderr)
        return 2
    if args.command in SETS_CUDA_CONNECTIONS:
        from harvest.compute import device

        device.default_cuda_connections()
    return args._run(args)


if __name__ == "__main__":
    sys.exit(main())
