"""Copy the bytes on the sockets per outer step of `edgc bench --diloco` runs at several group counts
into the slow-links guide (block ``diloco-wire``), never typed by hand.

    .venv/bin/python scripts/to_docs.py diloco-wire runs/wire-3 runs/wire-6

Each folder is one bench (its results.json) at one ``--hosts``; per method: the payload one group put
into the sync per outer step, what left a host's interface per outer step (the mean over the hosts of
its tx bytes, quorum and heartbeats included), and both against torchft's uncompressed DiLoCo in the
same bench.
"""

from __future__ import annotations

import json
from pathlib import Path

from doc_blocks import write

from edgc_bench.diloco_table import label, wire_per_sync

REFERENCE = "diloco"
BOUND = 0.06  # the wire per outer step the frontier is held to, against torchft's DiLoCo


def name(method: str, outer_sync: str) -> str:
    """The table's label, the outer sync named for every DiLoCo + EDGC run."""
    return label(f"{method}@{outer_sync}") if method == "diloco-edgc" else label(method)


def rows(summary: dict) -> list[list[str]]:
    """One row per method of the bench's first link: groups, method, payload and wire per outer step."""
    hosts, outer_sync = summary["settings"]["hosts"], summary["options"]["outer_sync"]
    results = {r["method"]: r for r in summary["links"][0]["results"]}
    reference = results[REFERENCE]
    payload_ref, wire_ref = reference["payload_bytes"], wire_per_sync(reference)
    table = []
    for method, r in results.items():
        payload, wire = r["payload_bytes"], wire_per_sync(r)
        table.append(
            [
                str(hosts),
                name(method, outer_sync),
                f"{payload / 1e6:.3f} MB ({payload / payload_ref:.4f}×)",
                f"{wire / 1e6:.3f} MB",
                f"{wire / wire_ref:.4f}×",
            ]
        )
    return table


def growth(summaries: list[dict]) -> list[str]:
    """Per compressed method: its wire against torchft's per group (from the bench with the most groups:
    an all-gathered message through the manager is one slot per group) and the most groups within BOUND."""
    widest = max(summaries, key=lambda s: s["settings"]["hosts"])
    hosts, outer_sync = widest["settings"]["hosts"], widest["options"]["outer_sync"]
    results = {r["method"]: r for r in widest["links"][0]["results"]}
    wire_ref = wire_per_sync(results[REFERENCE])
    lines = []
    for method, r in results.items():
        if method != REFERENCE:
            per_group = wire_per_sync(r) / wire_ref / hosts
            most = int(BOUND // per_group)
            within = f"within {BOUND:g}× up to {most} groups" if most >= 2 else f"above {BOUND:g}× at any group count"
            lines.append(f"- {name(method, outer_sync)}: {per_group:.4f}× a group at {hosts} groups, so {within}")
    return lines


def block(folders: list[Path]) -> str:
    summaries = [json.loads((folder / "results.json").read_text()) for folder in folders]
    lines = [
        "| groups | method | payload per outer step (vs torchft) | wire per outer step (one host) | wire vs torchft |",
        "|---:|---|---:|---:|---:|",
    ]
    lines += ["| " + " | ".join(row) + " |" for summary in summaries for row in rows(summary)]
    commands = "; ".join(f"`{s['command']}`" for s in summaries)
    head = "The all-gather form's wire per outer step grows with the groups; against torchft's DiLoCo:"
    return "\n".join(lines) + f"\n\n{head}\n\n" + "\n".join(growth(summaries)) + f"\n\nCommands: {commands}."


def main(argv: list[str]) -> int:
    if not argv:
        raise SystemExit(__doc__)
    page = write("diloco-wire", block([Path(a) for a in argv]))
    print(f"{page}: diloco-wire from {', '.join(argv)}")
    return 0
