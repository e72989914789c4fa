"""Regenerate the inter-stage calibration section of docs/simulate.md and the TP × PP results
from one `edgc bench --tp T --pp P` folder.

    .venv/bin/python scripts/to_docs.py interstage-calibration runs/bench-tp --host-profile runs/bench-tp/host.json

It runs the same calibration as `edgc simulate --calibrate BENCH --host-profile PROFILE`
(edgc_sim.calibrate_pipeline; this CPU and its local gloo link are measured when no profile is
given), then replaces what lies between <!-- interstage-calibration:start/end --> in
docs/simulate.md (command, model inputs, the table, the errors) and between
<!-- interstage-calibration-line:start/end --> in docs/results/3d.md (one sentence), and copies the
bench's own table (BENCH/bench.md) between <!-- bench-tp-table:start/end --> there. No number is
typed by hand.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from doc_blocks import ROOT, write

from edgc_sim.calibrate import load_run
from edgc_sim.calibrate_pipeline import calibrate_pipeline, format_pipeline_calibration
from edgc_sim.cli import expand_bench_dirs
from producers.bench import section  # the bench's own table


def span(values) -> str:
    """'a … b' in percent (one value: 'a')."""
    lo, hi = (f"{100 * v:+.1f}%" for v in (min(values), max(values)))
    return lo if lo == hi else f"{lo} … {hi}"


def summary(rows) -> str:
    """The generated verdict: bytes exact or not, and the ranges of the time errors."""
    exact = [r for r in rows if r.bytes_exact]
    bytes_part = (
        "predicted inter-stage bytes equal the measured ones in every group"
        if len(exact) == len(rows)
        else f"predicted inter-stage bytes differ from the measured ones in {len(rows) - len(exact)} of "
        f"{len(rows)} groups"
    )
    parts = [f"inter-stage time error {span([r.interstage_error for r in rows])}"]
    for name, errors in (
        ("payload transfer", [r.wire_error for r in rows]),
        # only where something was compressed: the model prices a raw gradient's copy at 0
        ("compress + decompress", [r.compress_error for r in rows if any(r.ranks)]),
    ):
        known = [e for e in errors if e is not None]
        if known:
            parts.append(f"{name} {span(known)}")
    share = [(r.wire_predicted_s or 0) + r.compress_predicted_s for r in rows]
    share = [x / r.interstage_predicted_s for x, r in zip(share, rows) if r.interstage_predicted_s]
    return (
        f"{bytes_part} ({len(rows)} groups of steps over {len({r.run for r in rows})} runs); "
        f"{', '.join(parts)}; step time error {span([r.step_error for r in rows])}; the payload transfers "
        f"and compress + decompress are {span(share).replace('+', '')} of the predicted inter-stage time, "
        f"the rest is waiting for the next stage's backward"
    )


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="to_docs.py interstage-calibration", description=__doc__.splitlines()[0])
    parser.add_argument("bench", help="an `edgc bench --tp/--pp` output folder")
    parser.add_argument("--host-profile", help="edgc simulate --measure-host --save-profile JSON (default: measure)")
    parser.add_argument("--docs", default=str(ROOT / "docs" / "simulate.md"))
    parser.add_argument("--results", default=str(ROOT / "docs" / "results" / "3d.md"))
    args = parser.parse_args(argv)
    bench = Path(args.bench)
    runs = [load_run(d) for d in expand_bench_dirs([str(bench)])]
    if args.host_profile:
        from edgc_sim.host import load_profile

        device, link = load_profile(args.host_profile)
    else:
        from edgc_sim.host import measure_host, measure_link

        device, link = measure_host(1, processes=int(runs[0].config["world_size"])), measure_link()[0]
    if link is None:
        raise SystemExit(f"{args.host_profile}: the profile has no link (measure it with --measure-host)")
    rows = calibrate_pipeline(runs, device, link)
    command = f"edgc simulate --calibrate {bench}" + (
        f" --host-profile {args.host_profile}" if args.host_profile else ""
    )
    text = summary(rows)
    doc = (
        f"`{command}` on the bench of `{section((bench / 'bench.md').read_text()).split('`')[1]}`:\n\n"
        f"{format_pipeline_calibration(rows, link, device)}\n\nIn short: {text}.\n"
    )
    docs = Path(args.docs)
    write("interstage-calibration", doc, docs, add_missing=True)
    results = Path(args.results)
    line = (
        f"Simulator vs this bench (`{command}`, [`edgc simulate`](../simulate.md#calibrating-the-inter-stage-"
        f"model)): {text}.\n"
    )
    write("bench-tp-table", section((bench / "bench.md").read_text()), results, add_missing=True)
    write("interstage-calibration-line", line, results, add_missing=True)
    print(f"{docs}, {results}: inter-stage calibration of {bench}")
    return 0
