"""The `edgc` command: one sub-command per tool, each living in its own package.

Each tool module exposes ``register(subparsers)``, which adds its parser and sets
``func`` (called with the parsed namespace; its return value is the exit code).
Tool modules are imported lazily so that `edgc simulate` never pays for importing
transformers, and a missing optional dependency only breaks the tool that needs it.
"""
from __future__ import annotations

import argparse
import importlib
import sys

# sub-command name -> module that registers it
TOOLS = {
    "train": "edgc_train.cli",
    "report": "edgc_train.report_cli",
    "demo": "edgc_train.demo",
    "bench": "edgc_bench.cli",
    "simulate": "edgc_sim.cli",
    "experiment": "edgc_experiments.cli",
}


class CLIError(Exception):
    """A user error: printed as one line, exit code 2, no traceback."""


def build_parser(only: str | None = None) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="edgc", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name, module_name in TOOLS.items():
        if only is not None and name != only:
            continue
        try:
            module = importlib.import_module(module_name)
        except ModuleNotFoundError as exc:
            if exc.name and module_name.startswith(exc.name):
                continue  # tool not built yet
            raise
        module.register(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    first = next((a for a in argv if not a.startswith("-")), None)
    parser = build_parser(only=first if first in TOOLS else None)
    args = parser.parse_args(argv)
    if not getattr(args, "func", None):
        parser.print_help()
        return 2
    try:
        return int(args.func(args) or 0)
    except CLIError as exc:
        print(f"edgc {args.command}: error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
