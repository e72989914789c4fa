"""Copy the README's results summary from the results pages' generated blocks (never typed by hand).

    .venv/bin/python scripts/results_summary.py          # rewrite the README's results-summary block
    .venv/bin/python scripts/results_summary.py --check  # exit 1 if the README's block is stale

Each row is read from a block that a script copied from a run's output (docs/results/): the DDP
bench at 1 Gbit/s and 100 Mbit/s, HSDP, torchft with a replica group killed, and the pareto
experiment's headline. `tests/core/test_readme.py` checks that the README holds what this renders.
"""
from __future__ import annotations

import re
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from doc_blocks import ROOT, markers, page_of, replace  # noqa: E402


def block(name: str, root: Path = ROOT) -> str:
    start, end = markers(name)
    return page_of(name, root).read_text().split(start, 1)[1].split(end, 1)[0]


def table_rows(text: str, first_header: str) -> list[dict[str, str]]:
    """The rows of the markdown table in ``text`` whose first header cell is ``first_header``."""
    lines = [line for line in text.splitlines() if line.startswith("|")]
    start = next(i for i, line in enumerate(lines) if line.strip("| ").startswith(first_header))
    header = [c.strip() for c in lines[start].strip("|").split("|")]
    rows = []
    for line in lines[start + 2:]:
        cells = [c.strip() for c in line.strip("|").split("|")]
        if len(cells) != len(header):
            break
        rows.append(dict(zip(header, cells)))
    return rows


def ratio(cell: str) -> str:
    """The '(0.65×)' part of a bench cell, as '0.65×'."""
    found = re.search(r"\(([\d.]+×)\)", cell)
    return found.group(1) if found else cell


def bench_row(name: str, setting: str, reference: str, page: str, root: Path) -> str:
    text = block(name, root)
    rows = {r["method"].split(" (")[0]: r for r in table_rows(text, "method")}
    edgc = rows["edgc"]
    loss = re.search(r"EDGC final validation loss ([-+][\d.]+%) vs", text).group(1)  # the bench's own check
    preset = re.search(r"preset `(\w+)`", text).group(1)
    return (f"| {setting}, GPT-2 `{preset}` | {ratio(edgc['step s (× none)'])} of {reference} | "
            f"{ratio(edgc['MB sent/step'])} | {loss} | [{page}](docs/results/{page}.md) |")


def render(root: Path = ROOT) -> str:
    rows = ["| setting (2 emulated hosts) | EDGC step time | bytes sent | val loss | measured in |",
            "| --- | ---: | ---: | ---: | --- |",
            bench_row("bench-table", "DDP, 1 Gbit/s links", "native DDP", "bench", root),
            bench_row("bench-slow-link-table", "DDP, 100 Mbit/s links", "native DDP", "bench", root),
            bench_row("bench-hsdp-table", "HSDP 2 × 2, 1 Gbit/s", "native HSDP", "hsdp", root)]
    text = block("bench-torchft-table", root)
    torchft = {r["run"]: r for r in table_rows(text, "run")}
    ours, theirs = torchft["torchft + EDGC"], torchft["torchft DDP (plain all-reduce)"]
    step = re.search(r"step time torchft \+ EDGC / torchft DDP = ([\d.]+)", text).group(1)  # failure-free runs
    rows.append(f"| torchft, a replica group killed mid-run | {step}× of torchft's DDP | – | {ours['steps lost']} step "
                f"lost (torchft's DDP: {theirs['steps lost']}) | [torchft](docs/results/torchft.md) |")
    text = block("pareto", root)
    arm = next(r for r in table_rows(text, "budget") if r["budget"] == "4" and r["arm"] == "budget-schedule")
    rows.append(f"| byte budget vs static PowerSGD at the same bytes (mean rank 4, 5 seeds, GPT-2 `tiny`) | – | "
                f"{arm['bytes vs static']}× of static | {arm['Δ mean [95 % CI]']} nats | [pareto](docs/results/pareto.md) |")
    return "\n".join(rows)


def main(argv: list[str]) -> int:
    readme = ROOT / "README.md"
    updated = replace(readme.read_text(), "results-summary", render())
    if "--check" in argv:
        if updated != readme.read_text():
            print("README.md: the results summary is stale; run scripts/results_summary.py", file=sys.stderr)
            return 1
        return 0
    readme.write_text(updated)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
