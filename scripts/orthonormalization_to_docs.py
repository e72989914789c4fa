"""The orthonormalisation comparison into docs/concepts/engine.md.

    python -m edgc_bench.orthonormalization --out docs/engine/orthonormalization.json   # CPU, ~1 min
    python scripts/orthonormalization_to_docs.py [FILE]                                 # the block

Reads the rows that `edgc_bench.orthonormalization` wrote (default: the committed CPU run; a GPU
run's orth.json works too) and writes the ``orthonormalization`` block. Nothing is typed.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from doc_blocks import write  # noqa: E402

REPO = Path(__file__).resolve().parent.parent
DEFAULT = REPO / "docs" / "engine" / "orthonormalization.json"


def block(measured: dict) -> str:
    sys.path.insert(0, str(REPO / "src"))
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
    print(f"wrote the orthonormalization block of {page.relative_to(REPO)} from {source}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
