"""Copy `edgc experiment pareto`'s plot and table into the README (never typed by hand).

    .venv/bin/python scripts/pareto_to_readme.py [RESULTS_DIR] [--block NAME]

RESULTS_DIR defaults to runs/experiments/pareto, NAME to ``pareto``. Copies RESULTS_DIR/pareto.png
to docs/img/exp_NAME.png and replaces the README block between ``<!-- NAME:start -->`` and
``<!-- NAME:end -->`` with the run's headline and paired table (a second block, e.g. ``pareto-1000``,
holds a run of another setting).
"""
import argparse
import shutil
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def block(summary: str) -> str:
    """summary.md from its headline up to (not including) the plot list."""
    lines = summary.splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith("**Headline"))
    end = next((i for i, line in enumerate(lines) if line.startswith(("Plot:", "Plots:"))), len(lines))
    return "\n".join(lines[start:end]).strip()


def main(results: Path, name: str = "pareto") -> None:
    start, end = f"<!-- {name}:start -->", f"<!-- {name}:end -->"
    readme = ROOT / "README.md"
    text = readme.read_text()
    if start not in text or end not in text:
        raise SystemExit(f"pareto_to_readme: the README has no {start} … {end} block")
    shutil.copyfile(results / "pareto.png", ROOT / "docs" / "img" / f"exp_{name}.png")
    head, rest = text.split(start, 1)
    _, tail = rest.split(end, 1)
    readme.write_text(f"{head}{start}\n{block((results / 'summary.md').read_text())}\n{end}{tail}")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description="Copy a pareto run's summary into the README.")
    parser.add_argument("results", nargs="?", type=Path, default=ROOT / "runs" / "experiments" / "pareto")
    parser.add_argument("--block", default="pareto", help="README block name (default pareto)")
    args = parser.parse_args()
    main(args.results, args.block)
