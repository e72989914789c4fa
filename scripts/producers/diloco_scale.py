"""Copy DiLoCo's many-groups figures into the slow-links guide, each from the output that made it.

    python scripts/to_docs.py diloco-scale --scaling runs/scale/scaling.md \\
        --memory runs/mem/outer_memory.json --sim runs/scale

Blocks (scripts/doc_blocks.py finds their page): ``bench-diloco-scaling`` from the scaling.md that
`edgc bench --diloco --scaling` wrote (runs of other host counts joined into one first: `python -m
edgc_bench.diloco_scaling FOLDER MORE...` rewrites FOLDER/scaling.md); ``outer-memory`` from the JSON of `python -m
edgc_bench.outer_memory` (or of several runs, each of some methods: ``--memory a.json,b.json``); the
``sim-diloco-*`` blocks from `edgc simulate --diloco --diloco-bench DIR`, run here on that bench
folder. Nothing is typed.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

from doc_blocks import ROOT, read, write

SIM_BLOCKS = ("sim-diloco-internet", "sim-diloco-crossover", "sim-diloco-groups", "sim-diloco-calibration")


def between(text: str, name: str) -> str:
    return read(text, name).strip()


def memory_table(results: list[dict]) -> str:
    """Bytes a parameter one outer step allocates, per path, method and model size (one or more runs'
    JSON, each run its methods' rows)."""
    rows = [row for result in results for row in result["rows"]]
    sizes = sorted({r["params"] for r in rows})
    head = "| path | sync method | " + " | ".join(f"2^{s.bit_length() - 1}: resident · live" for s in sizes) + " |"
    commands = "; ".join(f"`{result['command']}` ({result['elapsed_s'] / 60:.0f} min)" for result in results)
    lines = [f"{commands}, bytes a parameter:", "", head]
    lines.append("|---|---|" + "---:|" * len(sizes))
    for path, method in sorted(dict.fromkeys((r["path"], r["method"]) for r in rows), key=lambda pm: pm[0] != "plain"):
        cells = []
        for size in sizes:
            row = next((r for r in rows if (r["path"], r["method"], r["params"]) == (path, method, size)), None)
            cells.append(
                "–" if row is None else f"{row['rss_bytes_per_param']:.1f} · {row['live_bytes_per_param']:.1f}"
            )
        lines.append(f"| {path} | `{method}` | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="to_docs.py diloco-scale", description=__doc__.split("\n")[0])
    p.add_argument("--scaling", help="scaling.md of `edgc bench --diloco --scaling`")
    p.add_argument("--memory", help="the JSON of `python -m edgc_bench.outer_memory --out` (several: a,b)")
    p.add_argument("--sim", metavar="BENCH_DIR", help="run `edgc simulate --diloco --diloco-bench BENCH_DIR`")
    args = p.parse_args(argv)
    if args.scaling:
        text = Path(args.scaling).read_text()
        print(write("bench-diloco-scaling", between(text, "bench-diloco-scaling")))
    if args.memory:
        results = [json.loads(Path(path).read_text()) for path in args.memory.split(",")]
        print(write("outer-memory", memory_table(results)))
    if args.sim:
        command = [sys.executable, "-m", "edgc_cli.main", "simulate", "--diloco", "--diloco-bench", args.sim]
        done = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, check=True)
        for name in SIM_BLOCKS:
            print(write(name, between(done.stdout, name)))
