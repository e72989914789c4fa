"""Regenerate docs/calibration.md and the results' calibration table from one `edgc bench` folder.

    .venv/bin/python scripts/to_docs.py calibration runs/bench-4 --host-profile runs/bench-4/host.json
    .venv/bin/python scripts/to_docs.py calibration runs/bench --link-calibration runs/link/calibration.json

It runs the same calibration as `edgc simulate --calibrate BENCH/runs/{none,fp16,bf16,powersgd-rmax,
powersgd-rmin,torch-powersgd,edgc}` (the methods present; `none` is required), with the link fitted
from BENCH/calibration.json unless --link-calibration names another (its fixed cost per collective
from the other runs' comm traces unless --latency sweep) and this CPU measured unless
--host-profile is given, then writes docs/calibration.md (command, model inputs, full table, which
errors are within the target) and replaces the block ``calibration-table`` (docs/results/simulator.md)
with the per-method errors. No number is typed by hand.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from doc_blocks import ROOT, page_of, replace

from edgc_sim.bench_link import bench_link, find_bench_calibration
from edgc_sim.calibrate import load_run
from edgc_sim.calibrate_bench import LATENCY_SOURCES, NEW_STYLE, calibrate_bench
from edgc_sim.calibration_tables import format_bench_calibration
from edgc_sim.host import load_profile, measure_host

METHODS = (
    "none",
    "nosync",
    "allreduce",
    "allreduce-blocking",
    "fp16",
    "bf16",
    "powersgd-rmax",
    "powersgd-rmin",
    "torch-powersgd",
    "edgc",
)
# The simulator's accuracy target: a projection is trusted where it predicts measured runs within 15 %.
TARGET = 0.15


def label(row) -> str:
    return row.run + ("" if row.rank is None else f" r={row.rank}")


def verdict(rows) -> str:
    """One generated sentence per quantity: which rows are within the target."""
    out = []
    quantities = (
        ("link time (the collectives alone, traced)", lambda r: r.link_error, lambda r: r.link_measured),
        (
            "link time with the sweep's fixed cost per collective instead",
            lambda r: r.link_sweep_error,
            lambda r: r.link_measured and r.latency_from != "sweep",
        ),
        ("rank-0 comm time (with peer wait)", lambda r: r.comm_error, lambda r: r.comm_measured_s == r.comm_measured_s),
        ("step time", lambda r: r.step_error, lambda r: True),
    )
    for name, err, has in quantities:
        measured = [r for r in rows if has(r)]
        if not measured:
            continue
        inside = [label(r) for r in measured if abs(err(r)) <= TARGET]
        outside = [f"{label(r)} ({100 * err(r):+.0f}%)" for r in measured if abs(err(r)) > TARGET]
        out.append(
            f"{name} within {TARGET:.0%}: {', '.join(inside) or 'none'}; outside: {', '.join(outside) or 'none'}."
        )
    noisy = [label(r) for r in rows if r.link_measured and abs(r.link_error) > TARGET and r.link_in_ci]
    if noisy:
        out.append(
            f"Of the link rows outside {TARGET:.0%}, the prediction lies inside the measured median's "
            f"95% interval (the run does not pin its median more precisely) for: {', '.join(noisy)}."
        )
    return " ".join(out)


def results_table(rows, link_source: str, runs_note: str) -> str:
    ms = lambda s: "-" if s != s else f"{1e3 * s:.0f}"  # noqa: E731  (nan: not traced)
    pct = lambda e: "-" if e != e else f"{100 * e:+.1f} %"  # noqa: E731
    # In bench folders that have the blocking all-reduce, `none` is DDP's native all-reduce, which has no
    # timer of its own, so the blocking all-reduce is the reference for the wait
    wait_ref = "allreduce-blocking" if any(r.compressor in NEW_STYLE for r in rows) else "none"
    lines = [
        "| run | rank | collectives / step | link measured (95% interval), ms | link predicted, ms | link error "
        "| link error, sweep latency | rank-0 comm measured (95% interval), ms | comm predicted, ms "
        "| comm error | step error |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for r in rows:
        count = f"{r.collectives:g}" + ("" if r.collectives_measured else " (pattern)")
        ref = " (reference for the wait)" if r.compressor == wait_ref else ""
        link = f"{ms(r.link_measured_s)} ({ms(r.link_ci_s[0])}–{ms(r.link_ci_s[1])})" if r.link_measured else "-"
        comm = (
            f"{ms(r.comm_measured_s)} ({ms(r.comm_ci_s[0])}–{ms(r.comm_ci_s[1])})"
            if r.comm_measured_s == r.comm_measured_s
            else "- (no timer)"
        )
        lines.append(
            f"| {r.run} | {'-' if r.rank is None else r.rank} | {count} | {link} | "
            f"{ms(r.link_predicted_s)} | {pct(r.link_error)} | {pct(r.link_sweep_error)} | {comm} | "
            f"{ms(r.comm_predicted_s)} | "
            f"{pct(r.comm_error)}{ref} | {pct(r.step_error)} |"
        )
    latency = (
        "fixed cost per collective from the other runs' comm traces (leave one run out; see docs/calibration.md)"
        if any(r.latency_from != "sweep" for r in rows)
        else ""
    )
    return "\n".join(lines) + (
        f"\n\n{verdict(rows)} Runs: {runs_note}; link: {link_source}{'; ' + latency if latency else ''}.\n"
    )


def calibration_page(regenerate: str, command: str, table: str, judgement: str) -> str:
    """docs/calibration.md: how to regenerate it, the calibration's command, its table and verdict."""
    return "\n".join(
        [
            "# Calibration of the cost model against `edgc bench`",
            "",
            f"Predicted vs measured median DP-comm and step time per method (target: within {TARGET:.0%}). "
            "The model is explained in [`edgc simulate`](simulate.md#calibration). This page and the calibration "
            "table of [the simulator's results](results/simulator.md) are generated; regenerate both with",
            "",
            "```bash",
            regenerate,
            "```",
            "",
            "which runs the equivalent of",
            "",
            "```bash",
            command,
            "```",
            "",
            "After a new bench (`sudo .venv/bin/edgc bench --out runs/bench-N`: its calibration.json gives "
            "the link's rate and burst and the sweep's fixed cost per collective, its metrics log the "
            "collectives per step and comm_trace/ each collective's time on every rank, from which the "
            "other runs' fixed cost per collective is taken), measure the host on the idle machine with "
            "`.venv/bin/edgc simulate --measure-host --host-processes 2 --save-profile runs/bench-N/host.json` "
            "and run `.venv/bin/python scripts/to_docs.py calibration runs/bench-N --host-profile "
            "runs/bench-N/host.json`.",
            "",
            table,
            "",
            judgement,
            "",
        ]
    )


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(
        prog="to_docs.py calibration", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("bench", help="an `edgc bench --out` folder (runs/<method>/ inside)")
    parser.add_argument("--link-calibration", help="calibration.json to fit the link from (default: BENCH's)")
    parser.add_argument(
        "--host-profile",
        help="host profile JSON (default: measure this CPU with one process per rank at once, a few seconds)",
    )
    parser.add_argument(
        "--latency",
        choices=LATENCY_SOURCES,
        default="traced",
        help="fixed cost per collective: from the other runs' comm traces (default) or the sweep",
    )
    parser.add_argument("--results", help="the page of the calibration-table block (default: the one that holds it)")
    parser.add_argument("--docs", default=str(ROOT / "docs" / "calibration.md"))
    args = parser.parse_args(argv)

    bench = Path(args.bench)
    dirs = [bench / "runs" / m for m in METHODS if (bench / "runs" / m / "metrics.jsonl").is_file()]
    if not any(d.name == "none" for d in dirs):
        parser.error(f"{bench}/runs/none/metrics.jsonl missing: the uncompressed run is the reference")
    link_json = args.link_calibration or find_bench_calibration(dirs)
    if link_json is None:
        parser.error(f"{bench}/calibration.json missing; pass --link-calibration")
    link_json = Path(link_json).resolve()
    if link_json.is_relative_to(Path.cwd()):
        link_json = link_json.relative_to(Path.cwd())  # the page names it as the command did
    runs = [load_run(d) for d in dirs]
    link = bench_link(link_json, int(runs[0].config["world_size"]))
    # all ranks of a bench share this CPU: measure it with as many processes at once
    world = int(runs[0].config["world_size"])
    device = load_profile(args.host_profile)[0] if args.host_profile else measure_host(1, processes=world)
    rows = calibrate_bench(runs, device, link, args.latency)

    command = ".venv/bin/edgc simulate --calibrate " + " ".join(str(d) for d in dirs)
    if args.link_calibration:
        command += f" --link-calibration {args.link_calibration}"
    if args.host_profile:
        command += f" --host-profile {args.host_profile}"
    if args.latency != "traced":
        command += f" --latency {args.latency}"
    regenerate = ".venv/bin/python scripts/to_docs.py calibration " + " ".join(argv)
    doc = calibration_page(regenerate, command, format_bench_calibration(rows, link, device), verdict(rows))
    Path(args.docs).write_text(doc)
    results = Path(args.results) if args.results else page_of("calibration-table")
    ref = next(r for r in runs if r.config["compressor"] == "none")
    runs_note = f"{bench}/runs, reference run started {ref.config.get('started_at', '?')}"
    results.write_text(replace(results.read_text(), "calibration-table", results_table(rows, link.source, runs_note)))
    print(doc)
    print(f"written: {args.docs}, {results} (calibration table)")
    return 0
