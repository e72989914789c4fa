"""The time each method of a bench took to the target loss (``none``'s final validation loss × 1.01),
where it went, and whether EDGC's own cost (profiling, entropy sampling) can be won back before it:
the measures table.py and repeats.py read of the run folders."""

from __future__ import annotations

import statistics

TARGET_SLACK = 1.01


def median_of(run: dict, key: str) -> float | None:
    values = [r.get(key) for r in run["train"]]
    if all(v is None for v in values):
        return None
    return statistics.median(v or 0.0 for v in values)


def target_loss(results: dict[str, dict]) -> float | None:
    """The loss every method must reach: ``none``'s final validation loss × TARGET_SLACK (``allreduce``'s, our
    uncompressed sync, where no ``none`` ran: a mixture of experts has no DDP)."""
    base = results.get("none") or results.get("allreduce")
    return base["eval"][-1]["val_loss"] * TARGET_SLACK if base else None


def reached_at(run: dict, target: float | None) -> dict | None:
    """The first evaluation at or below the target (None: never, or no target)."""
    return next((e for e in run["eval"] if target is not None and e["val_loss"] <= target), None)


def phase_total(steps: list[dict], key: str, phase: str | None = None) -> float:
    return sum(r.get(key) or 0.0 for r in steps if phase is None or r.get("phase") == phase)


def target_breakdown(results: dict[str, dict], methods: tuple[str, ...] = ("edgc", "powersgd@rmax")) -> str:
    """Where the wall time to the target went, summed over the steps before the target was reached.

    Evaluations and logging are the wall time not inside any step. EDGC's profiling cost is the
    compress time of its profile steps (the shadow compressed syncs); its entropy cost is GDS.
    """
    target = target_loss(results)
    head = (
        "| method | reached at step | wall to target | compute | compress/decompress | of which entropy "
        "| of which profiling | DP comm | evaluation, other |\n"
        "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |\n"
    )
    lines = []
    for method in methods:
        run = results.get(method)
        hit = reached_at(run, target) if run else None
        if hit is None:
            continue
        steps = [r for r in run["train"] if r["step"] <= hit["step"]]
        other = hit["wall_s"] - phase_total(steps, "step_time_s")
        logged = any("entropy_time_s" in r for r in steps)  # runs before it was logged: unknown
        entropy = f"{phase_total(steps, 'entropy_time_s'):.1f} s" if logged else "–"
        lines.append(
            f"| {method} | {hit['step']} | {hit['wall_s']:.1f} s | {phase_total(steps, 'compute_time_s'):.1f} s "
            f"| {phase_total(steps, 'compress_time_s'):.1f} s | {entropy} "
            f"| {phase_total(steps, 'compress_time_s', 'profile'):.1f} s "
            f"| {phase_total(steps, 'comm_time_s'):.1f} s | {other:.1f} s |"
        )
    return head + "\n".join(lines) + "\n" if lines else ""


def recovery(results: dict[str, dict]) -> dict | None:
    """Why EDGC can or cannot beat static PowerSGD at r_max to the target on this setting, measured.

    Until the target both run the same steps, so what EDGC's lower ranks can save is what a lower
    rank saves per step over static's compressed steps: at most static PowerSGD at r_min's median
    step against r_max's (when ``powersgd@rmin`` ran), and at most static's time above the compute
    floor (``nosync``'s median step; without it, static's whole DP comm time). EDGC pays on top its
    profiling steps' time above static's same steps (still in its uncompressed warm-up) and its
    entropy sampling. Seconds, with the steps each reached the target at; None when a run is
    missing or never reached the target, or EDGC needed fewer steps (the bound does not apply).
    """
    if "edgc" not in results or "powersgd@rmax" not in results:
        return None
    target = target_loss(results)
    edgc, static = results["edgc"], results["powersgd@rmax"]
    hit_e, hit_s = reached_at(edgc, target), reached_at(static, target)
    if hit_e is None or hit_s is None or hit_e["step"] < hit_s["step"]:
        return None
    steps_e = [r for r in edgc["train"] if r["step"] <= hit_e["step"]]
    compressed = [r for r in static["train"] if r["step"] <= hit_s["step"] and r.get("phase") == "compress"]
    static_by_step = {r["step"]: r for r in static["train"]}
    profile = [r for r in steps_e if r.get("phase") == "profile"]
    if all(static_by_step.get(r["step"], {}).get("phase") == "warmup" for r in profile):
        # Static runs the same steps uncompressed (its warm-up), one-off costs of a run's first steps
        # included: the difference is the profiling syncs and the entropy samples inside those steps.
        profiling = sum(r["step_time_s"] - static_by_step[r["step"]]["step_time_s"] for r in profile)
        entropy = phase_total([r for r in steps_e if r.get("phase") != "profile"], "entropy_time_s")
    else:
        profiling, entropy = phase_total(steps_e, "compress_time_s", "profile"), phase_total(steps_e, "entropy_time_s")
    bounds = []
    if results.get("powersgd@rmin"):
        per_step = median_step(static) - median_step(results["powersgd@rmin"])
        bounds.append(
            (
                len(compressed) * max(0.0, per_step),
                f"static PowerSGD at r_min's median step instead of "
                f"r_max's, over static's {len(compressed)} compressed steps",
            )
        )
    if results.get("nosync"):
        floor = statistics.median(r["step_time_s"] for r in results["nosync"]["train"])
        bounds.append(
            (
                sum(max(0.0, r["step_time_s"] - floor) for r in compressed),
                "static's compressed steps brought down to the compute floor",
            )
        )
    else:
        bounds.append(
            (phase_total(compressed, "comm_time_s"), "static PowerSGD's whole DP comm time in its compressed steps")
        )
    savable, how = min(bounds)
    return {
        "step_edgc": hit_e["step"],
        "step_static": hit_s["step"],
        "wall_edgc": hit_e["wall_s"],
        "wall_static": hit_s["wall_s"],
        "profiling": profiling,
        "entropy": entropy,
        "overhead": profiling + entropy,
        "savable": savable,
        "savable_how": how,
    }


def recoverable_bound(results: dict[str, dict]) -> str | None:
    """`recovery` in words, for the bench's report."""
    r = recovery(results)
    if r is None:
        return None
    verdict = "cannot" if r["overhead"] > r["savable"] else "can"
    return (
        f"EDGC reached the target at step {r['step_edgc']}, static PowerSGD at r_max at step {r['step_static']}. "
        f"EDGC's own cost up to then was {r['overhead']:.1f} s (its profiling steps' time above static's same, "
        f"uncompressed steps {r['profiling']:.1f} s, entropy sampling {r['entropy']:.1f} s); the most its lower "
        f"ranks could save up to the target is {r['savable']:.1f} s ({r['savable_how']}): on this setting EDGC "
        f"{verdict} recover its overhead before the target."
    )


def median_step(run: dict) -> float:
    """Median step time of a run's compressed steps (all its steps if none is marked)."""
    times = [r["step_time_s"] for r in run["train"] if r.get("phase") == "compress"]
    return statistics.median(times or [r["step_time_s"] for r in run["train"]])
