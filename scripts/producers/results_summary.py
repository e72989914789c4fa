"""Copy the summaries of the results pages from their generated blocks (never typed by hand).

    .venv/bin/python scripts/to_docs.py results-summary          # rewrite the summary blocks
    .venv/bin/python scripts/to_docs.py results-summary --check  # exit 1 if one of them is stale

Each row is read from a block that a script copied from a run's output (docs/results/). The README's
``results-summary`` block: the DDP bench at 1 Gbit/s and 100 Mbit/s, HSDP, torchft with a replica
group killed, DiLoCo + EDGC against torchft's DiLoCo at the slow link, and the pareto experiment's
headline; `tests/core/test_readme.py` checks that the README holds what this renders. The slow-links
guide's ``diloco-bench`` block: `edgc bench --diloco`'s time to target, bytes and loss at each link
and its kill pass (docs/results/diloco.md has the whole run).
"""

from __future__ import annotations

import re
import sys
import textwrap
from pathlib import Path

from doc_blocks import ROOT, is_current, page_of, read, write


def block(name: str, root: Path = ROOT) -> str:
    return read(page_of(name, root).read_text(), name)


def table_rows(text: str, first_header: str) -> list[dict[str, str]]:
    """The rows of the markdown table in ``text`` whose first header cell is ``first_header``."""
    lines = [line for line in text.splitlines() if line.startswith("|")]
    start = next(i for i, line in enumerate(lines) if line.strip("| ").startswith(first_header))
    header = [c.strip() for c in lines[start].strip("|").split("|")]
    rows = []
    for line in lines[start + 2 :]:
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
    return (
        f"| {setting}, GPT-2 `{preset}` | {ratio(edgc['step s (× none)'])} of {reference} | "
        f"{ratio(edgc['MB sent/step'])} | {loss} | [{page}](docs/results/{page}.md) |"
    )


def render(root: Path = ROOT) -> str:
    rows = [
        "| setting (2 emulated hosts unless stated) | EDGC step time | bytes sent | val loss | measured in |",
        "| --- | ---: | ---: | ---: | --- |",
        bench_row("bench-table", "DDP, 1 Gbit/s links", "native DDP", "bench", root),
        bench_row("bench-slow-link-table", "DDP, 100 Mbit/s links", "native DDP", "bench", root),
        bench_row("bench-hsdp-table", "HSDP 2 × 2, 1 Gbit/s", "native HSDP", "hsdp", root),
    ]
    text = block("bench-torchft-table", root)
    torchft = {r["run"]: r for r in table_rows(text, "run")}
    ours, theirs = torchft["torchft + EDGC"], torchft["torchft DDP (plain all-reduce)"]
    step = re.search(r"step time torchft \+ EDGC / torchft DDP = ([\d.]+)", text).group(1)  # failure-free runs
    rows.append(
        f"| torchft, a replica group killed mid-run | {step}× of torchft's DDP | – | {ours['steps lost']} step "
        f"lost (torchft's DDP: {theirs['steps lost']}) | [torchft](docs/results/torchft.md) |"
    )
    rows.append(diloco_row(root))
    text = block("pareto", root)
    arm = next(r for r in table_rows(text, "budget") if r["budget"] == "4" and r["arm"] == "budget-schedule")
    rows.append(
        f"| byte budget vs static PowerSGD at the same bytes (mean rank 4, 5 seeds, GPT-2 `tiny`) | – | "
        f"{arm['bytes vs static']}× of static | {arm['Δ mean [95 % CI]']} nats | [pareto](docs/results/pareto.md) |"
    )
    return "\n".join(rows)


def check(text: str, pattern: str) -> str:
    """What ``pattern``'s group matched in a bench's own check line."""
    found = re.search(pattern, text)
    if not found:
        raise SystemExit(f"no check matching {pattern!r} in the block")
    return found.group(1)


def diloco_links(root: Path = ROOT) -> tuple[str, list[dict], str]:
    """`edgc bench --diloco`'s block (docs/results/diloco.md) cut up: its first line; per link (in
    the bench's order) its rate, the text of its section and its table's rows by method; the kill
    pass's section."""
    text = block("bench-diloco-table", root).strip()
    parts = re.split(r"^\*\*([\d.]+) Mbit/s per host link\*\*", text, flags=re.M)
    head, links = parts[0], []
    for rate, section in zip(parts[1::2], parts[2::2]):
        section, _, kill = section.partition("Kill pass at ")
        links.append({"rate": rate, "text": section, "rows": {r["method"]: r for r in table_rows(section, "method")}})
    return head.strip(), links, ("Kill pass at " + kill) if kill else ""


DILOCO, DILOCO_EDGC, DDP_EDGC = "DiLoCo (torchft's, uncompressed)", "DiLoCo + EDGC", "DDP + EDGC (torchft, every step)"


def diloco_row(root: Path = ROOT) -> str:
    """The README's row: DiLoCo + EDGC against torchft's DiLoCo at the bench's slowest link (its last)."""
    head, links, _ = diloco_links(root)
    slow = links[-1]["text"]
    sooner = float(check(slow, r"DiLoCo \+ EDGC vs uncompressed DiLoCo \(same H\): target ([\d.]+) × sooner"))
    loss = check(slow, r"loss at equal tokens, DiLoCo \+ EDGC vs DiLoCo: ([-+][\d.]+%)")
    payload = check(
        slow, r"payload per outer step \(the pseudo-gradient's message\), DiLoCo \+ EDGC / DiLoCo = ([\d.]+)"
    )
    wire = check(
        slow, r"wire per outer step \(what each process wrote to its sockets\), DiLoCo \+ EDGC / DiLoCo = ([\d.]+)"
    )
    hosts, preset = check(head, r"(\d+) hosts"), check(head, r"preset (\w+)")
    h = check(head, r"DiLoCo H = (\d+)")
    # against what else users run, from the scaling run's priced line (its first number of groups)
    scaling = block("bench-diloco-scaling", root)
    bf16 = check(scaling, r"quant3-2s: wire ÷ a bf16 pseudo-gradient's ring all-reduce \(priced\) ([\d.]+)")
    fp8 = check(scaling, r"quant3-2s: wire ÷ .*?÷ torchft's FP8 path \(priced, its message [^)]*\) ([\d.]+)")
    groups = check(scaling, r"quant3-2s: wire ÷ a bf16 .* at (\d+)")
    return (
        f"| DiLoCo (H = {h}), {hosts} hosts at {links[-1]['rate']} Mbit/s, GPT-2 `{preset}` | time to target "
        f"{1 / sooner:.2f}× of torchft's DiLoCo | {wire}× on the wire of torchft's fp32 DiLoCo (payload "
        f"{payload}×); at {groups} groups {float(bf16):.2f}× a bf16 pseudo-gradient's, {float(fp8):.2f}× "
        f"torchft's FP8 path's (priced) | {loss} | [diloco](docs/results/diloco.md) |"
    )


def seconds(cell: str) -> float | None:
    """The mean of a time cell ('38.7 s [38.6–38.8]'); None for a run that did not get there."""
    found = re.match(r"([\d.]+) s", cell)
    return float(found.group(1)) if found else None


def wrap(text: str) -> list[str]:
    """Prose lines of at most 100 characters, as the manual's."""
    return textwrap.wrap(text, 100, break_long_words=False, break_on_hyphens=False)


def number(cell: str) -> float:
    """A cell's leading number ('1.415 MB' → 1.415)."""
    return float(re.match(r"[\d.]+", cell).group(0))


TIMES = ("time to target", "time to later target")
WIRE = "wire per sync (sockets, per process)"


def diloco_cells(row: dict, reference: dict, loss_column: str) -> list[str]:
    """A method's times (means), speed-ups against ``reference`` (torchft's DiLoCo), payload and loss."""
    times = [f"{seconds(row[c]):.1f} s" if seconds(row[c]) is not None else row[c] for c in TIMES]
    if row is reference:
        return [*times, "–", row["payload per sync"], row[WIRE], row[loss_column]]
    speedups = [
        f"{seconds(reference[c]) / seconds(row[c]):.2f}×" if seconds(row[c]) and seconds(reference[c]) else "–"
        for c in TIMES
    ]
    payload = number(row["payload per sync"]) / number(reference["payload per sync"])
    wire = number(row[WIRE]) / number(reference[WIRE])
    loss = 100 * (number(row[loss_column]) / number(reference[loss_column]) - 1)
    return [
        *times,
        " / ".join(speedups),
        f"{row['payload per sync']} ({payload:.3f}×)",
        f"{row[WIRE].split(' [')[0]} ({wire:.3f}×)",
        f"{row[loss_column]} ({loss:+.2f}%)",
    ]


def diloco_summary(root: Path = ROOT) -> str:
    """The slow-links guide's block: per link, DDP + EDGC, torchft's DiLoCo, DiLoCo + EDGC and the
    streaming variant the bench ran there."""
    head, links, kill = diloco_links(root)
    hosts, preset, steps = check(head, r"(\d+) hosts"), check(head, r"preset (\w+)"), check(head, r"(\d+) inner steps")
    h, rounds = check(head, r"DiLoCo H = (\d+)"), check(head, r"(\d+) round\(s\) per link")
    intro = (
        f"From `edgc bench --diloco` ({hosts} hosts, GPT-2 `{preset}`, {steps} inner steps, DiLoCo H = {h}, "
        f"{rounds} rounds per link: their mean), copied by `scripts/to_docs.py results-summary` from [the DiLoCo "
        "results page](../results/diloco.md), which has every method, the ranges over the rounds and the "
        "settings. A link's target is the highest of its runs' lowest validation losses, the later target "
        "the same over the runs that took every step; the speed-ups are at the target / the later target, "
        "the payload (what one replica's messages hold), the wire (what each process wrote to its sockets, "
        "per outer step) and the loss in brackets against torchft's DiLoCo:"
    )
    lines = [
        *wrap(intro),
        "",
        f"| link | method | time to target | to later target | sooner than torchft's DiLoCo | payload per sync "
        f"| wire per sync (sockets) | val loss after {steps} inner steps |",
        "| --- | --- | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    targets = []
    for link in links:
        rows, text = link["rows"], link["text"]
        targets.append(
            f"{check(text, r'Target validation loss ([0-9.]+)')} / "
            f"{check(text, r'a later target ([0-9.]+)')} at {link['rate']} Mbit/s"
        )
        loss_column = next(c for c in rows[DILOCO] if c.startswith("val loss after"))
        streaming = [name for name in rows if name.startswith("Streaming")]  # whichever the bench picked
        for method in (DDP_EDGC, DILOCO, DILOCO_EDGC, *streaming):
            cells = [f"{link['rate']} Mbit/s", method, *diloco_cells(rows[method], rows[DILOCO], loss_column)]
            lines.append("| " + " | ".join(cells) + " |")
    lines += ["", *wrap(f"Targets (target / later target): {'; '.join(targets)}.")]
    if kill:
        k = table_rows(kill, "outer steps discarded")[0]
        cell = {c.split(" (")[0]: v for c, v in k.items()}
        stall = cell["survivors' stall"]
        lines += [
            "",
            *wrap(
                f"Kill pass at {check(kill, r'Kill pass at ([0-9.]+ Mbit/s)')} (DiLoCo + EDGC, host 1's "
                f"worker killed in an outer step): outer steps discarded {cell['outer steps discarded']}, "
                f"the survivors went on after {stall}, the killed group was back after "
                f"{cell['killed group back']}, validation loss {cell['val loss vs failure-free']} against "
                "the failure-free runs."
            ),
        ]
    return "\n".join(lines)


SUMMARIES = {"results-summary": render, "diloco-bench": diloco_summary}


def main(argv: list[str]) -> int:
    stale = []
    for name, summary in SUMMARIES.items():
        page, text = page_of(name), summary()
        if not is_current(name, text, page):
            stale.append(page)
            if "--check" not in argv:
                write(name, text, page)
    if "--check" in argv and stale:
        print(
            f"{', '.join(str(p.relative_to(ROOT)) for p in stale)}: a results summary is stale; "
            "run scripts/to_docs.py results-summary",
            file=sys.stderr,
        )
        return 1
    return 0
