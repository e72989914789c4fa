"""Copy what `edgc demo` printed (its RUN_DIR/headline.txt) into docs/report.md.

.venv/bin/edgc demo --out runs/demo-docs && .venv/bin/python scripts/to_docs.py demo runs/demo-docs
"""

import sys
from pathlib import Path

from doc_blocks import write


def block(headline: str, run_dir: str) -> str:
    return f"`edgc demo --out {run_dir}` printed:\n\n```\n{headline.strip()}\n```\n"


def main(argv: list[str]) -> int:
    if len(argv) != 1:
        sys.exit("usage: scripts/to_docs.py demo RUN_DIR (a finished `edgc demo --out RUN_DIR`)")
    run_dir = argv[0].rstrip("/")
    source = Path(run_dir) / "headline.txt"
    if not source.is_file():
        sys.exit(f"to_docs.py demo: {source} not found (run `edgc demo --out {run_dir}` first)")
    write("demo-headline", block(source.read_text(), run_dir))
    return 0
