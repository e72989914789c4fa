"""The orthonormalisation comparison into docs/concepts/engine.md.

    python -m edgc_bench.orthonormalization --out docs/engine/orthonormalization.json   # CPU, ~1 min
    python scripts/to_docs.py orthonormalization [FILE]                                 # the block

Reads the rows that `edgc_bench.orthonormalization` wrote (default: the committed CPU run; a GPU
run's orth.json works too) and writes the ``orthonormalization`` block. Nothing is typed.
"""

from __future__ import annotations

import json
from pathlib import Path

from doc_blocks import ROOT, write

DEFAULT = ROOT / "docs" / "engine" / "orthonormalization.json"


def block(measured: dict) -> str:
    from edgc_bench.orthonormalization import table

    threads = f", {measured['threads']} thread(s)" if "threads" in measured else ""
    return (
        f"Measured on {measured['device']}{threads}, torch {measured.get('torch', '?')}; each cell is "
        "‖YYᵀ − I‖ (orthogonality) / ‖X − XYᵀY‖ ÷ ‖X‖ (what the rows miss), the worst matrix of the batch; "
        '"NaN" means the method produced non-finite rows. Time and dispatches per call are on the κ = 10 '
        "input.\n\n" + table(measured["rows"])
    )


def main(argv: list[str]) -> int:
    source = Path(argv[0]) if argv else DEFAULT
    page = write("orthonormalization", block(json.loads(source.read_text())))
    print(f"wrote the orthonormalization block of {page.relative_to(ROOT)} from {source}")
    return 0
