"""Copy an `edgc experiment` run's summary (its headline and tables) into the manual (never typed by hand).

    .venv/bin/python scripts/to_docs.py experiment RESULTS_DIR --block NAME [--plot FILE …]

Replaces block NAME (scripts/doc_blocks.py finds its page: ``experiment-entropy-trend``,
``experiment-sampling``, ``experiment-cqm``, ``experiment-rank-sweep``, ``experiment-window`` and
``experiment-pure-dp`` in docs/reproducing.md, ``pareto`` and ``pareto-1000`` in
docs/results/pareto.md, ``diloco-models``, ``diloco-outer-sync``, ``diloco-two-stage``,
``diloco-two-stage-sgd``, ``diloco-frontier``, ``diloco-frontier-variants``, ``diloco-frontier-h100`` and
``diloco-frontier-regime`` in docs/guides/slow-links.md, ``experiment-moe``, ``experiment-moe-16`` and
``experiment-moe-top1`` in docs/guides/moe.md) with RESULTS_DIR/summary.md from its headline up to its list
of plots;
``--plot FILE`` also copies RESULTS_DIR/FILE to docs/img/exp_NAME.png (pareto: ``--plot pareto.png``,
diloco-frontier: ``--plot frontier.png``); a second and later ``--plot`` go to docs/img/exp_NAME-STEM.png,
STEM the file's own name (diloco-frontier-regime: ``--plot frontier.png --plot curves.png``).
"""

import argparse
import shutil
from pathlib import Path

from doc_blocks import ROOT, write


def block(summary: str) -> str:
    """summary.md from its headline up to (not including) the plot list, then its command line (what
    reproduces it, and how long it took)."""
    lines = summary.splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith("**Headline"))
    end = next((i for i, line in enumerate(lines) if line.startswith(("Plot:", "Plots:"))), len(lines))
    command = [line for line in lines[end:] if line.startswith("Command:")]
    return "\n\n".join(["\n".join(lines[start:end]).strip(), *command])


def copy_summary(results: Path, name: str, plots: list[str] | None = None) -> None:
    body = block((results / "summary.md").read_text())
    for i, plot in enumerate(plots or []):
        target = f"exp_{name}.png" if i == 0 else f"exp_{name}-{Path(plot).stem}.png"
        shutil.copyfile(results / plot, ROOT / "docs" / "img" / target)
    write(name, body)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="to_docs.py experiment", description=__doc__.splitlines()[0])
    parser.add_argument("results", type=Path, help="the experiment's folder (runs/experiments/NAME)")
    parser.add_argument("--block", required=True, help="the block to fill, e.g. pareto or experiment-window")
    parser.add_argument(
        "--plot",
        action="append",
        help="a PNG of the folder to copy to docs/img/exp_BLOCK.png (again: exp_BLOCK-STEM.png)",
    )
    args = parser.parse_args(argv)
    copy_summary(args.results, args.block, args.plot)
    return 0
