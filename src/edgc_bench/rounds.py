"""The bench.md of ``edgc bench --rounds N``: the rounds side by side and the mean of their ratios.

    python -m edgc_bench.rounds OUT      # re-render every round's table and the rounds' summary

Each round is a complete bench folder ``OUT/round-K/`` (run.py); the method order is reversed on even
rounds, so a steady drift of the machine's speed raises one round's ratios as much as it lowers the
next's and cancels in their mean, against which the bench's targets are judged here.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from . import table as bench_table
from .repeats import means, measure, rate_label
from .repeats import table as side_by_side


def rounds_markdown(out: Path, summary: dict) -> str:
    """bench.md of a bench of several rounds: the rounds side by side, their means, links to each
    round's own table (with its calibration, notes and plots)."""
    rounds = [out / name for name in summary["rounds"]]
    measured = [m for m in map(measure, rounds) if m]
    s, load = summary["settings"], (summary["load_start"][0], summary["load_end"][0])
    parts = [
        "# edgc bench\n",
        f"Date: {summary['date']}. Command: `{summary['command']}`\n",
        "<!-- bench:start -->",
        f"`{summary['command']}` — {summary['date']}, {len(rounds)} rounds of {', '.join(s['methods'])} on "
        f"{s['hosts']} hosts, {rate_label(s['rate_mbit'])} per host link, each round in the reverse order of the one "
        f"before; load average {load[0]:.1f} at start, {load[1]:.1f} at end; whole bench "
        f"{summary['elapsed_s'] / 60:.1f} min.\n",
    ]
    if measured:
        parts += [side_by_side(measured), *[f"- {line}" for line in means(measured)]]
    else:
        parts.append("No round ran edgc, powersgd@rmax and nosync on plain DDP: see each round's own table.")
    parts += [
        "<!-- bench:end -->\n",
        "Each round's own table, link calibration and plots: "
        + ", ".join(f"[{r.name}]({r.name}/bench.md)" for r in rounds)
        + ".\n",
    ]
    if summary["notes"]:
        parts += ["## Notes\n", *[f"- {n}" for n in summary["notes"]], ""]
    return "\n".join(parts)


def rewrite(out: Path) -> Path:
    """Re-render every round's bench.md and plots (`edgc_bench.table.rewrite`), then OUT/bench.md."""
    summary = json.loads((out / "results.json").read_text())
    for name in summary["rounds"]:
        bench_table.rewrite(out / name)
    (out / "bench.md").write_text(rounds_markdown(out, summary))
    return out / "bench.md"


if __name__ == "__main__":
    print(rewrite(Path(sys.argv[1])))
