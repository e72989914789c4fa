"""`edgc report RUN_DIR [RUN_DIR …]`: plots and a markdown summary comparing `edgc train` runs."""

from __future__ import annotations

import argparse

from edgc_cli.errors import CLIError


def register(subparsers) -> None:
    p = subparsers.add_parser(
        "report",
        help="plots and a markdown summary comparing edgc train runs",
        description="Write loss/perplexity/entropy/rank/communication plots (PNG) and report.md, a table "
        "comparing the runs, into one folder. Give the uncompressed run (compressor none) too to "
        "get ratios against it. Works on finished and on stopped runs.",
    )
    p.add_argument("runs", nargs="+", metavar="RUN_DIR", help="run folders written by `edgc train --out`")
    p.add_argument(
        "--out",
        metavar="DIR",
        help="report folder (default: report/ next to the first RUN_DIR); "
        "files already there with the same names are replaced",
    )
    p.set_defaults(func=run)


def headline(result: dict) -> list[str]:
    """A few lines for the terminal: where the report is and each run's key numbers."""
    base = result["baseline"]
    lines = [f"report: {result['markdown']} ({len(result['plots'])} plots in {result['out']})"]
    for r in result["runs"]:
        s = r.stats
        val = "no evaluation" if s["val_loss"] is None else f"val loss {s['val_loss']:.4f} (PPL {s['val_ppl']:.1f})"
        text = f"  {r.label}: {s['steps']} steps, {val}, {s['bytes_per_step'] / 1e6:.2f} MB/step"
        if base is not None and r is not base and base.stats["bytes_per_step"]:
            text += f" ({s['bytes_per_step'] / base.stats['bytes_per_step']:.3f}× of {base.label})"
        lines.append(text)
    return lines


def run(args: argparse.Namespace) -> int:
    from .report import ReportError, build_report

    try:
        result = build_report(args.runs, args.out)
    except ReportError as exc:
        raise CLIError(str(exc)) from None
    print("\n".join(headline(result)))
    return 0
