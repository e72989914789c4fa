"""Copy the table that `edgc bench` wrote (OUT/bench.md, between <!-- bench:start/end -->) into README.md.

    python scripts/bench_to_readme.py runs/bench/bench.md

It replaces what lies between <!-- bench-table:start --> and <!-- bench-table:end --> in README.md
(<!-- bench-hsdp-table:start/end --> for a table of `edgc bench --fsdp`,
<!-- bench-tp-table:start/end --> for one of `edgc bench --tp/--pp`,
<!-- bench-torchft-table:start/end --> for one of `edgc bench --torchft`,
<!-- bench-slow-link-table:start/end --> for a DDP bench at a rate below 1 Gbit/s, and
<!-- bench-rmax-table:start/end --> for one at 1 Gbit/s with EDGC's r_max given by `--r-max`,
<!-- bench-rounds-table:start/end --> for the rounds of `edgc bench --rounds N` at 1 Gbit/s and
<!-- bench-slow-link-rounds-table:start/end --> for those at a lower rate)
(adding both markers at the end of the README when they are missing), so the README's numbers are
always the ones a real `edgc bench` produced, never typed by hand.
"""
from __future__ import annotations

import re
import sys
from pathlib import Path

START, END = "<!-- bench-table:start -->", "<!-- bench-table:end -->"
# `edgc bench --fsdp` tables go to their own place (the HSDP section), not over the DDP bench's.
HSDP_START, HSDP_END = "<!-- bench-hsdp-table:start -->", "<!-- bench-hsdp-table:end -->"
# A slower link (e.g. --rate-mbit 100) is a second setting beside the default 1 Gbit/s table.
SLOW_START, SLOW_END = "<!-- bench-slow-link-table:start -->", "<!-- bench-slow-link-table:end -->"
# `edgc bench --tp/--pp` (one TP x PP model per host) goes beside the 3D-parallel section.
TP_START, TP_END = "<!-- bench-tp-table:start -->", "<!-- bench-tp-table:end -->"
# `edgc bench --torchft` (a replica group killed mid-run) goes to the fault-tolerance section.
TORCHFT_START, TORCHFT_END = "<!-- bench-torchft-table:start -->", "<!-- bench-torchft-table:end -->"
# `--r-max N` (EDGC skips profiling r_max on the link): beside the profiled run, not over it.
RMAX_START, RMAX_END = "<!-- bench-rmax-table:start -->", "<!-- bench-rmax-table:end -->"
# `--rounds N`: the rounds side by side and the mean of their ratios, beside the single runs.
ROUNDS_START, ROUNDS_END = "<!-- bench-rounds-table:start -->", "<!-- bench-rounds-table:end -->"
SLOW_ROUNDS_START, SLOW_ROUNDS_END = "<!-- bench-slow-link-rounds-table:start -->", "<!-- bench-slow-link-rounds-table:end -->"
SRC_START, SRC_END = "<!-- bench:start -->", "<!-- bench:end -->"


def section(bench_md: str) -> str:
    try:
        body = bench_md.split(SRC_START, 1)[1].split(SRC_END, 1)[0]
    except IndexError:
        raise SystemExit("bench.md has no <!-- bench:start/end --> section (was it written by edgc bench?)") from None
    return body.strip() + "\n"


def update(readme: str, table: str, start: str = START, end: str = END) -> str:
    """`table` between the markers `start` and `end` (added at the end when missing)."""
    if start not in readme or end not in readme:
        readme = readme.rstrip() + f"\n\n{start}\n{end}\n"
    head, rest = readme.split(start, 1)
    _, tail = rest.split(end, 1)
    return f"{head}{start}\n{table}{end}{tail}"


def main(argv: list[str]) -> int:
    if len(argv) not in (1, 2):
        print(__doc__.strip(), file=sys.stderr)
        return 2
    bench = Path(argv[0])
    readme = Path(argv[1]) if len(argv) == 2 else Path(__file__).resolve().parents[1] / "README.md"
    table = section(bench.read_text())
    rate = re.search(r"(\d+(?:\.\d+)?) Mbit/s per host link", table)
    if "(one replica group each)" in table:
        markers = (TORCHFT_START, TORCHFT_END)
    elif re.search(r"hosts × TP\d+ × PP\d+", table):
        markers = (TP_START, TP_END)
    elif re.search(r"\d+ rounds of ", table.splitlines()[0]):
        slow = rate and float(rate.group(1)) < 1000
        markers = (SLOW_ROUNDS_START, SLOW_ROUNDS_END) if slow else (ROUNDS_START, ROUNDS_END)
    elif " as HSDP " in table:
        markers = (HSDP_START, HSDP_END)
    elif rate and float(rate.group(1)) < 1000:
        markers = (SLOW_START, SLOW_END)
    elif re.search(r"--r-max \d+", table.splitlines()[0]):
        markers = (RMAX_START, RMAX_END)
    else:
        markers = (START, END)
    readme.write_text(update(readme.read_text(), table, *markers))
    print(f"{readme}: bench table from {bench}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
