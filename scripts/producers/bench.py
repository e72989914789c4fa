"""Copy the table that `edgc bench` wrote (OUT/bench.md, between <!-- bench:start/end -->) into the manual.

    python scripts/to_docs.py bench runs/bench/bench.md [PAGE]

Each kind of bench has its own block (scripts/doc_blocks.py finds the page that holds it; PAGE names
another page, and the block is added at its end when missing): ``bench-table`` for the default DDP
bench at 1 Gbit/s, ``bench-rmax-table`` for one with EDGC's r_max given by `--r-max`,
``bench-slow-link-table`` for a DDP bench below 1 Gbit/s, ``bench-rounds-table`` and
``bench-slow-link-rounds-table`` for `--rounds N` at and below 1 Gbit/s (docs/results/bench.md);
``bench-hsdp-table`` for `edgc bench --fsdp` (docs/results/hsdp.md); ``bench-moe-table`` for
`--moe-experts E` (docs/guides/moe.md); ``bench-tp-table`` for
`--tp/--pp` (docs/results/3d.md); ``bench-torchft-table`` for `--torchft` (docs/results/torchft.md);
``bench-torchtitan-table`` for `--torchtitan` (torchtitan's own trainer, docs/results/hsdp.md), and
``bench-torchtitan-moe-table`` for it with expert parallelism (`--torchtitan-ep`);
``bench-diloco-table`` for `--diloco` at 3 hosts, ``bench-diloco-hosts-table`` at any other number
(docs/results/diloco.md), ``bench-diloco-frontier-table`` for `--diloco --methods …` (a chosen set of
outer syncs against torchft's DiLoCo, docs/guides/slow-links.md).
So the manual's numbers are always the ones a real `edgc bench` produced, never typed by hand.
"""

from __future__ import annotations

import re
import sys
from pathlib import Path

from doc_blocks import markers, name_of, page_of, replace, write

START, END = markers("bench-table")
HSDP_START, HSDP_END = markers("bench-hsdp-table")
MOE_START, MOE_END = markers("bench-moe-table")
# A slower link (e.g. --rate-mbit 100) is a second setting beside the default 1 Gbit/s table.
SLOW_START, SLOW_END = markers("bench-slow-link-table")
TP_START, TP_END = markers("bench-tp-table")
TORCHFT_START, TORCHFT_END = markers("bench-torchft-table")
TORCHTITAN_START, TORCHTITAN_END = markers("bench-torchtitan-table")
TORCHTITAN_MOE_START, TORCHTITAN_MOE_END = markers("bench-torchtitan-moe-table")
DILOCO_START, DILOCO_END = markers("bench-diloco-table")
DILOCO_MORE_START, DILOCO_MORE_END = markers("bench-diloco-hosts-table")  # --diloco at other than 3 hosts
DILOCO_FRONTIER_START, DILOCO_FRONTIER_END = markers("bench-diloco-frontier-table")
# `--r-max N` (EDGC skips profiling r_max on the link): beside the profiled run, not over it.
RMAX_START, RMAX_END = markers("bench-rmax-table")
# `--rounds N`: the rounds side by side and the mean of their ratios, beside the single runs.
ROUNDS_START, ROUNDS_END = markers("bench-rounds-table")
SLOW_ROUNDS_START, SLOW_ROUNDS_END = markers("bench-slow-link-rounds-table")
SRC_START, SRC_END = markers("bench")


def section(bench_md: str) -> str:
    try:
        body = bench_md.split(SRC_START, 1)[1].split(SRC_END, 1)[0]
    except IndexError:
        raise SystemExit("bench.md has no <!-- bench:start/end --> section (was it written by edgc bench?)") from None
    return body.strip() + "\n"


def update(page: str, table: str, start: str = START, end: str = END) -> str:
    """`table` between the markers `start` and `end` (added at the end when missing)."""
    return replace(page, name_of(start), table, add_missing=True)


def block_markers(table: str) -> tuple[str, str]:
    """The block a bench's table belongs in, read from the table's own first line."""
    rate = re.search(r"(\d+(?:\.\d+)?) Mbit/s per host link", table)
    slow = bool(rate) and float(rate.group(1)) < 1000
    first = table.splitlines()[0] if table else ""
    command = first.split("`")[1] if first.count("`") >= 2 else ""  # the bench's command line, quoted
    if table.startswith("`edgc bench") and " --diloco" in command:
        if " --methods " in command:  # a chosen set of outer syncs
            return DILOCO_FRONTIER_START, DILOCO_FRONTIER_END
        hosts = re.search(r"`: (\d+) hosts,", first)
        more = hosts is not None and int(hosts.group(1)) != 3  # beside the three-host bench, not over it
        return (DILOCO_MORE_START, DILOCO_MORE_END) if more else (DILOCO_START, DILOCO_END)
    if "(one replica group each)" in table:
        return TORCHFT_START, TORCHFT_END
    if " --torchtitan" in command:
        moe = " --torchtitan-ep" in command
        return (TORCHTITAN_MOE_START, TORCHTITAN_MOE_END) if moe else (TORCHTITAN_START, TORCHTITAN_END)
    if re.search(r"hosts × TP\d+ × PP\d+", table):
        return TP_START, TP_END
    if re.search(r"\d+ rounds of ", table.splitlines()[0]):
        return (SLOW_ROUNDS_START, SLOW_ROUNDS_END) if slow else (ROUNDS_START, ROUNDS_END)
    if " as HSDP " in table:
        return HSDP_START, HSDP_END
    if " experts per MLP split over a host's processes " in table:
        return MOE_START, MOE_END
    if slow:
        return SLOW_START, SLOW_END
    if re.search(r"--r-max \d+", table.splitlines()[0]):
        return RMAX_START, RMAX_END
    return START, END


def main(argv: list[str]) -> int:
    if len(argv) not in (1, 2):
        print(__doc__.strip(), file=sys.stderr)
        return 2
    bench = Path(argv[0])
    table = section(bench.read_text())
    start, end = block_markers(table)
    page = Path(argv[1]) if len(argv) == 2 else page_of(name_of(start))
    write(name_of(start), table, page, add_missing=True)
    print(f"{page}: bench table from {bench}")
    return 0
