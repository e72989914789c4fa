"""Copy what `edgc demo` printed (its RUN_DIR/headline.txt) into docs/report.md.

.venv/bin/edgc demo --out runs/demo-docs && .venv/bin/python scripts/demo_to_docs.py runs/demo-docs
"""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from doc_blocks import write  # noqa: E402


def block(headline: str, run_dir: str) -> str:
    return f"`edgc demo --out {run_dir}` printed:\n\n```\n{headline.strip()}\n```\n"


def main(argv: list[str]) -> int:
    if len(argv) != 1:
        sys.exit("usage: scripts/demo_to_docs.py RUN_DIR (a finished `edgc demo --out RUN_DIR`)")
    run_dir = argv[0].rstrip("/")
    source = Path(run_dir) / "headline.txt"
    if not source.is_file():
        sys.exit(f"demo_to_docs: {source} not found (run `edgc demo --out {run_dir}` first)")
    write("demo-headline", block(source.read_text(), run_dir))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
