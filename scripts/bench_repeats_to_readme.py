"""Copy the side-by-side view of repeated `edgc bench` runs into the README (never typed by hand).

    .venv/bin/python scripts/bench_repeats_to_readme.py runs/bench-18 runs/bench-18-r2 …

Replaces what lies between ``<!-- bench-repeats:start -->`` and ``<!-- bench-repeats:end -->`` with
``python -m edgc_bench.repeats RUN…``'s output.
"""
import sys
from pathlib import Path

from edgc_bench.repeats import render

ROOT = Path(__file__).resolve().parent.parent
START, END = "<!-- bench-repeats:start -->", "<!-- bench-repeats:end -->"


def main(paths: list[str], readme: Path = ROOT / "README.md") -> None:
    text = readme.read_text()
    if START not in text or END not in text:
        raise SystemExit(f"bench_repeats_to_readme: {readme} has no {START} … {END} block")
    head, rest = text.split(START, 1)
    _, tail = rest.split(END, 1)
    readme.write_text(f"{head}{START}\n{render([Path(p) for p in paths])}{END}{tail}")


if __name__ == "__main__":
    if len(sys.argv) < 2:
        raise SystemExit(__doc__)
    main(sys.argv[1:])
