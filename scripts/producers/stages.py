"""Copy the table `python -m edgc_bench.stages` wrote (OUT/stages.md) into the manual.

    .venv/bin/python scripts/to_docs.py stages OUT --block stages-pp2     # PP2 × DP2
    .venv/bin/python scripts/to_docs.py stages OUT --block stages-3d      # TP2 × PP2 × DP2

Replaces the block (docs/results/3d.md) with OUT/stages.md's table and the spread line under it;
nothing is typed by hand.
"""

import argparse
from pathlib import Path

from doc_blocks import write


def table(stages_md: str) -> str:
    """The run's table and the lines after it (the spread of finish times)."""
    lines = stages_md.strip().splitlines()
    first = next((i for i, line in enumerate(lines) if line.startswith("|")), None)
    if first is None:
        raise SystemExit("stages.md has no table (was it written by python -m edgc_bench.stages?)")
    return "\n".join(lines[first:])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="to_docs.py stages", description=__doc__.splitlines()[0])
    parser.add_argument("out", type=Path, help="the --out folder of python -m edgc_bench.stages")
    parser.add_argument("--block", required=True, help="stages-pp2 or stages-3d")
    args = parser.parse_args(argv)
    print(f"written: {write(args.block, table((args.out / 'stages.md').read_text()))}")
    return 0
