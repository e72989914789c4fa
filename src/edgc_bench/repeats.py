"""Repeats of `edgc bench` side by side: a figure is believed over its repeats, with its range.

    python -m edgc_bench.repeats runs/bench-18 runs/bench-18-r2 …

One row per finished DDP bench that ran ``edgc``, ``powersgd@rmax`` and ``nosync``: the link rate,
the load when it started, how EDGC settled r_max (its run's profiling record), EDGC's and static
PowerSGD at r_max's median step over the compute floor, EDGC's step over static's, both times to
target, and EDGC's own cost up to the target against the most its lower ranks could save by then
(`edgc_bench.targets.recovery`). Then, per link rate and way of profiling, the range of each ratio
and how many runs met each target. Benches of other kinds are skipped, named. A bench of several
rounds (``edgc bench --rounds N``) counts as its rounds, and is also judged as one bench on the
mean of its rounds (`means`; its own bench.md: `edgc_bench.rounds`).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from .bench_folder import method_dir, read_run
from .table import edgc_first, floor_target, rows
from .targets import recovery

NEEDED = ("edgc", "powersgd@rmax", "nosync")


def measure(out: Path) -> dict | None:
    """One bench's figures, or None when it is not a finished DDP bench with the needed methods."""
    summary_path = out / "results.json"
    if not summary_path.exists():
        return None
    summary = json.loads(summary_path.read_text())
    if "rows" not in summary:  # a bench of several rounds: `rounds_of` lists them
        return None
    s = summary["settings"]
    methods = [r["method"] for r in summary["rows"]]
    if s.get("fsdp") or s.get("tp", 1) > 1 or s.get("pp", 1) > 1 or not all(m in methods for m in NEEDED):
        return None
    results = {m: read_run(method_dir(out, m)) for m in methods}
    by = {r["method"]: r for r in rows(results, summary["r_max"])}
    edgc, static = by["edgc"], by["powersgd@rmax"]
    name = f"{out.parent.name}/{out.name}" if summary.get("round") else out.name
    return {
        "run": name,
        "date": summary["date"],
        "rate_mbit": s["rate_mbit"],
        "load": summary["load_start"][0],
        "profiled": how_profiled(results["edgc"], method_dir(out, "edgc")),
        "edgc_floor_x": edgc["step_floor_x"],
        "static_floor_x": static["step_floor_x"],
        "edgc_static_x": edgc["step_s"] / static["step_s"],
        "ttt_edgc": edgc["time_to_target_s"],
        "ttt_static": static["time_to_target_s"],
        "recovery": recovery(results),
    }


def how_profiled(run: dict, run_dir: Path) -> str:
    """How EDGC's run settled r_max: from its profiling record, or for runs logged before there was
    one, from its last checkpoint's sync-time table (one whose plain time is a bound came from the
    quick test); "unknown" without either."""
    table = run["profiling"]
    if table is None:
        checkpoints = sorted(run_dir.glob("checkpoints/step_*/edgc_rank0.pt"))
        if checkpoints:
            import torch

            table = torch.load(checkpoints[-1], map_location="cpu", mmap=True, weights_only=True)["controller"]["table"]
            table = table if table.get("by_rank") else None
    if table is None:
        return "unknown"
    return "quick test" if table.get("uncompressed_is_bound") else "timed blocking"


def _seconds(value: float | None) -> str:
    return "not reached" if value is None else f"{value:.1f} s"


def rate_label(rate_mbit: float | None) -> str:
    return "unlimited" if rate_mbit is None else f"{rate_mbit:g} Mbit/s"


def table(measured: list[dict]) -> str:
    lines = [
        "| run | started | link | load | EDGC's r_max profiling | EDGC × floor | static r_max × floor "
        "| EDGC ÷ static step | time to target: EDGC / static | EDGC's own cost / most its ranks could save |",
        "| --- | --- | --- | ---: | --- | ---: | ---: | ---: | ---: | ---: |",
    ]
    for m in measured:
        r = m["recovery"]
        cost = f"{r['overhead']:.1f} s / {r['savable']:.1f} s" if r else "–"
        lines.append(
            f"| {m['run']} | {m['date']} | {rate_label(m['rate_mbit'])} | {m['load']:.1f} | {m['profiled']} "
            f"| {m['edgc_floor_x']:.3f} | {m['static_floor_x']:.3f} | {m['edgc_static_x']:.3f} "
            f"| {_seconds(m['ttt_edgc'])} / {_seconds(m['ttt_static'])} | {cost} |"
        )
    return "\n".join(lines) + "\n"


def verdicts(measured: list[dict]) -> list[str]:
    """Per link rate and way of profiling r_max: the ranges, and how many runs met the bench's targets."""
    out = []
    groups = sorted({(m["rate_mbit"], m["profiled"]) for m in measured}, key=lambda g: (-(g[0] or float("inf")), g[1]))
    for rate, profiled in groups:
        runs = [m for m in measured if (m["rate_mbit"], m["profiled"]) == (rate, profiled)]
        floor_x = [m["edgc_floor_x"] for m in runs]
        limit = floor_target(rate)
        beat = sum(edgc_first(m["ttt_edgc"], m["ttt_static"]) for m in runs)
        covered = [m["recovery"] for m in runs if m["recovery"]]
        recovers = sum(r["overhead"] <= r["savable"] for r in covered)
        ratio = [m["edgc_static_x"] for m in runs]
        out.append(
            f"{rate_label(rate)}, r_max by {profiled}, {len(runs)} run(s): EDGC × floor "
            f"{min(floor_x):.3f}–{max(floor_x):.3f} "
            f"(≤ {limit:.2f} in {sum(x <= limit for x in floor_x)} of {len(runs)}); EDGC ÷ static step "
            f"{min(ratio):.3f}–{max(ratio):.3f}; time to target below static PowerSGD at r_max's in "
            f"{beat} of {len(runs)}; EDGC's own cost within what its ranks could save in {recovers} of "
            f"{len(covered)}."
        )
    return out


def rounds_of(path: Path) -> list[Path] | None:
    """The round folders of a bench of several rounds (``edgc bench --rounds N``), else None."""
    summary_path = path / "results.json"
    rounds = json.loads(summary_path.read_text()).get("rounds") if summary_path.exists() else None
    return [path / name for name in rounds] if rounds else None


def means(measured: list[dict]) -> list[str]:
    """The rounds of one bench taken together: the mean of each ratio (in an ABBA order a steady drift
    of the machine cancels in it), judged against the bench's targets, with the rounds' range."""
    n, limit = len(measured), floor_target(measured[0]["rate_mbit"])

    def mean(key: str) -> tuple[float, str]:
        values = [m[key] for m in measured]
        return sum(values) / n, f"rounds {min(values):.3f}–{max(values):.3f}"

    (edgc_x, edgc_range), (static_x, static_range), (ratio, ratio_range) = (
        mean("edgc_floor_x"),
        mean("static_floor_x"),
        mean("edgc_static_x"),
    )
    beat = sum(edgc_first(m["ttt_edgc"], m["ttt_static"]) for m in measured)
    both = [m for m in measured if m["ttt_edgc"] is not None and m["ttt_static"] is not None]
    ttt = (
        f"; mean over the {len(both)} round(s) where both reached it: EDGC "
        f"{sum(m['ttt_edgc'] for m in both) / len(both):.1f} s vs static "
        f"{sum(m['ttt_static'] for m in both) / len(both):.1f} s"
        if both
        else ""
    )
    return [
        f"EDGC step × floor, mean of {n} rounds: {edgc_x:.3f} ({edgc_range}; target ≤ {limit:.2f}): "
        f"{'holds' if edgc_x <= limit else 'MISSED'}",
        f"static PowerSGD at r_max × floor, mean: {static_x:.3f} ({static_range})",
        f"EDGC ÷ static PowerSGD at r_max step, mean: {ratio:.3f} ({ratio_range})",
        f"time to target: EDGC below static PowerSGD at r_max in {beat} of {n} rounds{ttt}",
    ]


def render(paths: list[Path]) -> str:
    measured, skipped, as_one = [], [], []
    for path in paths:
        rounds = rounds_of(path)
        found = []
        for folder in rounds or [path]:
            m = measure(folder)
            (found.append(m) if m else skipped.append(folder.name))
        measured += found
        if rounds and found:  # a bench of rounds is also judged as one measurement: the mean of its rounds
            as_one.append(f"- {path.name} as one bench: " + "; ".join(means(found)) + ".")
    if not measured:
        raise SystemExit(
            "no finished DDP bench with edgc, powersgd@rmax and nosync among: " + ", ".join(str(p) for p in paths)
        )
    parts = [
        f"`python -m edgc_bench.repeats {' '.join(str(p) for p in paths)}`\n",
        table(measured),
        *[f"- {line}" for line in verdicts(measured)],
        *as_one,
    ]
    if skipped:
        parts.append(f"- skipped (not a DDP bench with edgc, powersgd@rmax and nosync): {', '.join(skipped)}")
    return "\n".join(parts) + "\n"


if __name__ == "__main__":
    print(render([Path(p) for p in sys.argv[1:]]), end="")
