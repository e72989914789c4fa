"""Copy what `edgc demo` printed (its RUN_DIR/headline.txt) into docs/report.md.

.venv/bin/edgc demo --out runs/demo-docs && .venv/bin/python scripts/demo_to_docs.py runs/demo-docs
"""

import sys
from pathlib import Path

START, END = "<!-- demo-headline:start -->", "<!-- demo-headline:end -->"


def render(doc: str, headline: str, run_dir: str) -> str:
    head, rest = doc.split(START, 1)
    _, tail = rest.split(END, 1)
    block = f"`edgc demo --out {run_dir}` printed:\n\n```\n{headline.strip()}\n```\n"
    return f"{head}{START}\n{block}{END}{tail}"


if __name__ == "__main__":
    if len(sys.argv) != 2:
        sys.exit("usage: scripts/demo_to_docs.py RUN_DIR (a finished `edgc demo --out RUN_DIR`)")
    run_dir = sys.argv[1].rstrip("/")
    source = Path(run_dir) / "headline.txt"
    if not source.is_file():
        sys.exit(f"demo_to_docs: {source} not found (run `edgc demo --out {run_dir}` first)")
    path = Path(__file__).resolve().parent.parent / "docs" / "report.md"
    path.write_text(render(path.read_text(), source.read_text(), run_dir))
