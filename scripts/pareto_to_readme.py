"""Copy `edgc experiment pareto`'s plot and table into the README (never typed by hand).

    .venv/bin/python scripts/pareto_to_readme.py [RESULTS_DIR]   # default runs/experiments/pareto

Copies RESULTS_DIR/pareto.png to docs/img/exp_pareto.png and replaces the README block between
``<!-- pareto:start -->`` and ``<!-- pareto:end -->`` with the run's headline and paired table.
"""
import shutil
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
START, END = "<!-- pareto:start -->", "<!-- pareto:end -->"


def block(summary: str) -> str:
    """summary.md from its headline up to (not including) the plot list."""
    lines = summary.splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith("**Headline"))
    end = next((i for i, line in enumerate(lines) if line.startswith(("Plot:", "Plots:"))), len(lines))
    return "\n".join(lines[start:end]).strip()


def main(results: Path) -> None:
    shutil.copyfile(results / "pareto.png", ROOT / "docs" / "img" / "exp_pareto.png")
    readme = ROOT / "README.md"
    head, rest = readme.read_text().split(START, 1)
    _, tail = rest.split(END, 1)
    readme.write_text(f"{head}{START}\n{block((results / 'summary.md').read_text())}\n{END}{tail}")


if __name__ == "__main__":
    main(Path(sys.argv[1]) if len(sys.argv) > 1 else ROOT / "runs" / "experiments" / "pareto")
