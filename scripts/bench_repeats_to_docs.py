"""Copy the side-by-side view of repeated `edgc bench` runs into the README (never typed by hand).

    .venv/bin/python scripts/bench_repeats_to_readme.py runs/bench-18 runs/bench-18-r2 …
    .venv/bin/python scripts/bench_repeats_to_readme.py --block bench-repeats-vm2 runs/bench-30 …

Replaces what lies between ``<!-- bench-repeats:start -->`` and ``<!-- bench-repeats:end -->``
(or the ``--block NAME`` markers: runs on another machine go into a view of their own, since
their ratios are not draws of the same machine's noise) with ``python -m edgc_bench.repeats
RUN…``'s output.
"""
import argparse
from pathlib import Path

from edgc_bench.repeats import render

ROOT = Path(__file__).resolve().parent.parent


def main(paths: list[str], readme: Path = ROOT / "README.md", block: str = "bench-repeats") -> None:
    start, end = f"<!-- {block}:start -->", f"<!-- {block}:end -->"
    text = readme.read_text()
    if start not in text or end not in text:
        raise SystemExit(f"bench_repeats_to_readme: {readme} has no {start} … {end} block")
    head, rest = text.split(start, 1)
    _, tail = rest.split(end, 1)
    readme.write_text(f"{head}{start}\n{render([Path(p) for p in paths])}{end}{tail}")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--block", default="bench-repeats", help="README marker name (default: bench-repeats)")
    parser.add_argument("runs", nargs="+", help="bench output folders")
    args = parser.parse_args()
    main(args.runs, block=args.block)
