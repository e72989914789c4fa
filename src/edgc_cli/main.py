"""The `edgc` command: one sub-command per tool, each living in its own package.

Each tool module exposes ``register(subparsers)``, which adds its parser and sets
``func`` (called with the parsed namespace; its return value is the exit code).
Tool modules are imported lazily so that `edgc simulate` never pays for importing
transformers, and a missing optional dependency only breaks the tool that needs it.

A user error (a bad flag, a `CLIError` from a tool) is one line on stderr, ``edgc <command>: error:
...``, and exit code 2, whatever the entry point: the `edgc` script, ``python -m edgc_cli.main``, or
each process of ``torchrun ... -m edgc_cli.main``, where rank 0 prints it (see print_error).
"""

from __future__ import annotations

import argparse
import importlib
import os
import shlex
import sys
import time

from edgc_cli.errors import CLIError, missing_extra

# sub-command name -> module that registers it
TOOLS = {
    "train": "edgc_train.cli",
    "report": "edgc_train.report_cli",
    "demo": "edgc_train.demo",
    "bench": "edgc_bench.cli",
    "simulate": "edgc_sim.cli",
    "experiment": "edgc_experiments.cli",
}


# How long another torchrun worker waits for rank 0 to report the same user error (see print_error).
RANK0_GRACE_S = 30.0


def print_error(line: str) -> None:
    """Print a user error; under torchrun rank 0 does, so N workers print one line, not N.

    The other workers wait instead: torchrun stops them when rank 0 fails, and stops rank 0 as soon
    as one of them ends, which would lose the line if a silent worker ended first. A worker still
    alive after the grace period met an error rank 0 did not (a file only it lacks), and says so.
    """
    if os.environ.get("RANK", "0") != "0" and "TORCHELASTIC_RUN_ID" in os.environ:
        time.sleep(RANK0_GRACE_S)
    print(line, file=sys.stderr)


class OneLineParser(argparse.ArgumentParser):
    """argparse, but a usage error is one line (the usage of `edgc train` alone fills a screen)."""

    def error(self, message: str):
        print_error(f"{self.prog}: error: {message} (see {self.prog} --help)")
        self.exit(2)


def build_parser(only: str | None = None) -> argparse.ArgumentParser:
    parser = OneLineParser(prog="edgc", description=__doc__.splitlines()[0])
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
        if name in sub.choices:  # so that an unknown flag is reported as `edgc <command>: error: ...`
            sub.choices[name].set_defaults(command_parser=sub.choices[name])
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    try:
        return run(argv)
    except ModuleNotFoundError as exc:  # an optional dependency: one line naming the extra that brings it
        line = missing_extra(exc)
        if line is None:
            raise
        command = next((a for a in argv if not a.startswith("-")), None)
        print_error(f"edgc {command}: error: {line}" if command in TOOLS else f"edgc: error: {line}")
        return 2


def run(argv: list[str]) -> int:
    first = next((a for a in argv if not a.startswith("-")), None)
    parser = build_parser(only=first if first in TOOLS else None)
    args, unknown = parser.parse_known_args(argv)
    if unknown:
        getattr(args, "command_parser", parser).error(f"unrecognized arguments: {' '.join(unknown)}")
    args.command_line = "edgc " + shlex.join(argv)  # as typed: what a summary says reproduces it
    if not getattr(args, "func", None):
        parser.print_help()
        return 2
    try:
        return int(args.func(args) or 0)
    except CLIError as exc:
        print_error(f"edgc {args.command}: error: {exc}")
        return 2


if __name__ == "__main__":
    sys.exit(main())
