"""Run `edgc simulate` for the paper's presets and write the projections into the manual.

    PYTHONPATH=src .venv/bin/python scripts/to_docs.py simulate

Fills three blocks (see scripts/doc_blocks.py): ``simulate-presets`` (every method, each preset on
its assumed cluster) and ``simulate-links`` (EDGC on each inter-node link) in docs/simulate.md, and
``simulate-summary`` (EDGC against the paper) in docs/results/simulator.md. Every figure comes from
the JSON that `edgc simulate --json` writes; nothing is typed.
"""

from __future__ import annotations

import json
import subprocess
import sys
import tempfile
from pathlib import Path

from doc_blocks import ROOT, write

PRESETS = {"gpt2-2.5b": "GPT2-2.5B", "gpt2-12.1b": "GPT2-12.1B"}
LINKS = {
    "eth10g": "10 GbE",
    "eth25g": "25 GbE",
    "roce100g": "100 Gb/s RoCE",
    "ib_hdr200": "200 Gb/s HDR",
    "ib_ndr400": "400 Gb/s NDR",
}
# The paper's best case (EDGC, arXiv 2511.10333, abstract): what the projections are compared with.
PAPER = ("46.45%", "16.13%")


def simulate(preset: str, link: str | None, out: Path) -> dict:
    folder = out / f"{preset}-{link or 'default'}"
    folder.mkdir()
    command = [
        sys.executable,
        "-m",
        "edgc_cli.main",
        "simulate",
        "--preset",
        preset,
        "--json",
        "--no-plot",
        "--out-dir",
        str(folder),
    ]
    if link:
        command += ["--inter-link", link]
    subprocess.run(command, check=True, stdout=subprocess.DEVNULL, cwd=ROOT)
    return json.loads((folder / f"simulate_{preset}.json").read_text())


def pct(x: float) -> str:
    return f"{100 * x:.1f}%"


def ranks(method: dict) -> str:
    return (
        "/".join("–" if r is None else str(r) for r in method["ranks"])
        if isinstance(method["ranks"], list)
        else str(method["ranks"])
    )


def main(argv: list[str] | None = None) -> int:  # no arguments: every input is committed
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp)
        runs = {p: simulate(p, None, out) for p in PRESETS}
        links = {(p, link): simulate(p, link, out) for p in PRESETS for link in LINKS}
    rows = ["| preset (cluster) | method | ranks | comm reduction | time reduction |", "|---|---|---|---|---|"]
    for preset, name in PRESETS.items():
        run = runs[preset]
        for method, m in run["methods"].items():
            if method != "none":
                rows.append(
                    f"| {name} ({run['cluster']}) | {method} | {ranks(m)} | {pct(m['comm_reduction'])} | "
                    f"{pct(m['time_reduction'])} |"
                )
    rows.append(f"| paper (best case) | edgc | – | {PAPER[0]} | {PAPER[1]} |")
    commands = " and ".join(f"`edgc simulate --preset {p}`" for p in PRESETS)
    profiled = ", ".join(f"{PRESETS[p]} {runs[p]['r_max']}" for p in PRESETS)
    write("simulate-presets", f"{commands} (r_max profiled: {profiled}):\n\n" + "\n".join(rows))
    rows = [f"| link | {' | '.join(PRESETS.values())} |", "|---|" + "---|" * len(PRESETS)]
    for link, name in LINKS.items():
        cells = [
            f"{pct(links[p, link]['methods']['edgc']['comm_reduction'])} / "
            f"{pct(links[p, link]['methods']['edgc']['time_reduction'])}"
            for p in PRESETS
        ]
        rows.append(f"| {name} | {' | '.join(cells)} |")
    write(
        "simulate-links",
        "`edgc simulate --preset P --inter-link LINK`, EDGC's comm / time reduction:\n\n" + "\n".join(rows),
    )
    rows = ["| preset (assumed cluster) | EDGC comm latency | EDGC training time |", "| --- | --- | --- |"]
    for preset, name in PRESETS.items():
        edgc = runs[preset]["methods"]["edgc"]
        rows.append(
            f"| {name} on {runs[preset]['cluster']} | {-100 * edgc['comm_reduction']:+.1f}% | "
            f"{-100 * edgc['time_reduction']:+.1f}% |"
        )
    rows.append(f"| paper, best case | -{PAPER[0]} | -{PAPER[1]} |")
    write("simulate-summary", "\n".join(rows))
    return 0
