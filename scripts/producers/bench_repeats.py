"""Copy the side-by-side view of repeated `edgc bench` runs into the manual (never typed by hand).

    .venv/bin/python scripts/to_docs.py bench-repeats runs/bench-18 runs/bench-18-r2 …
    .venv/bin/python scripts/to_docs.py bench-repeats --block bench-repeats-vm2 runs/bench-30 …

Replaces block ``bench-repeats`` (or ``--block NAME``: runs on another machine go into a view of their
own, since their ratios are not draws of the same machine's noise; docs/results/bench.md holds both)
with ``python -m edgc_bench.repeats RUN…``'s output.
"""

import argparse
from pathlib import Path

from doc_blocks import write

from edgc_bench.repeats import render


def write_view(paths: list[str], page: Path | None = None, block: str = "bench-repeats") -> None:
    write(block, render([Path(p) for p in paths]), page)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="to_docs.py bench-repeats", description=__doc__.splitlines()[0])
    parser.add_argument("--block", default="bench-repeats", help="block name (default: bench-repeats)")
    parser.add_argument("runs", nargs="+", help="bench output folders")
    args = parser.parse_args(argv)
    write_view(args.runs, block=args.block)
    return 0
