"""The summary of `edgc experiment diloco --regime frontier` (`diloco_regime`): per family and method, the
paired Δ % of the validation loss against torchft's DiLoCo at 20, 60 and the last outer step with its
95 % t-interval; whether it holds (the interval inside ±`BOUND` %); the tuning grid's losses; what a
run cost; the frontier as a picture (payload against Δ %, one panel per family and outer step) and the
Δ % against the outer steps beside it.
"""

from __future__ import annotations

from statistics import mean

from .common import fmt, fmt_interval, markdown_table, t_interval, write_json
from .diloco_frontier import BOUND, holds
from .diloco_regime import FRONTIER_SIZE, TUNING_SEED_OFFSET, WARMUP_SHARE, checkpoints, tune_on
from .diloco_regime_plots import plot_curves, plot_frontier

SMALL_PAYLOAD = 0.02  # × torchft's: the payload the frontier is claimed at
REFERENCE = "torchft"


def paired_seeds(runs: dict, method: str, seeds: list[int]) -> list[int]:
    """The seeds at which both ``method`` and torchft's DiLoCo have a run (a regime stopped on the way has
    fewer than it asked for)."""
    return [s for s in seeds if str(s) in runs.get(method, {}) and str(s) in runs.get(REFERENCE, {})]


def paired_at(runs: dict, method: str, seeds: list[int], step: int) -> dict | None:
    """Paired Δ % of ``method``'s validation loss against torchft's after outer step ``step`` (None where a
    run diverged or was not validated there; nan bounds at one seed)."""
    losses = [
        (runs[method][str(s)]["val"].get(str(step)), runs[REFERENCE][str(s)]["val"].get(str(step))) for s in seeds
    ]
    if any(a is None or b is None for a, b in losses):
        return None
    deltas = [100 * (a / b - 1) for a, b in losses]
    m, low, high = t_interval(deltas)
    return {"deltas": deltas, "mean": m, "low": low, "high": high, "val_loss": mean(a for a, _ in losses)}


def family_stats(runs: dict, methods: list[str], seeds: list[int]) -> dict:
    """{method: {payload, relative_error, seeds, steps: {outer step: paired or None}}} of one family, each
    method over the seeds it shares with torchft's DiLoCo (a method with none left out)."""
    first = str(paired_seeds(runs, REFERENCE, seeds)[0])
    outer_steps = runs[REFERENCE][first]["outer_steps"]
    stats = {}
    for method in methods:
        mine_seeds = paired_seeds(runs, method, seeds)
        if not mine_seeds:
            continue
        mine = [runs[method][str(s)] for s in mine_seeds]
        errors = [o["relative_error"] for r in mine for o in r["outer"] if o.get("relative_error") is not None]
        stats[method] = {
            "payload": mean(r["bytes"] / runs[REFERENCE][str(s)]["bytes"] for r, s in zip(mine, mine_seeds)),
            "relative_error": mean(errors) if errors else None,
            "diverged": [r["diverged_at"] for r in mine if r.get("diverged_at") is not None],
            "seeds": mine_seeds,
            "steps": {
                c: paired_at(runs, method, mine_seeds, c) for c in sorted(int(k) for k in runs[REFERENCE][first]["val"])
            },
            "last": outer_steps,
        }
    return stats


def cell(p: dict | None) -> str:
    if p is None:
        return "diverged"
    return f"{p['mean']:+.2f} (1 seed: no interval)" if len(p["deltas"]) == 1 else fmt_interval(p, "+.2f")


def tuned_setting(runs: dict, method: str) -> str:
    """The outer learning rate and the inner one's multiple the method ran at."""
    arm = next(iter(runs[method].values()))["arm"]
    return f"{arm['outer_lr']:.3g} · ×{arm.get('inner_lr', 1.0):g}"


def tables(stats: dict, data: dict) -> list[list]:
    """The comparison's rows: per family and method its tuned setting, payload, error, loss, Δ % at the
    checkpoints, whether it holds, the seeds paired."""
    rows = []
    for family, by_method in stats.items():
        for method, s in by_method.items():
            points = [c for c in checkpoints(s["last"]) if c in s["steps"]]
            last = s["steps"].get(s["last"])
            rows.append(
                [
                    family,
                    method,
                    tuned_setting(data[family]["compare"], method),
                    f"{s['payload']:.4f}",
                    fmt(s["relative_error"], ".2f"),
                    "–" if last is None else f"{last['val_loss']:.4f}",
                    *("–" if method == REFERENCE else cell(s["steps"][c]) for c in points),
                    "–" if method == REFERENCE else ("yes" if last is not None and holds(last) else "no"),
                    len(s["seeds"]),
                ]
            )
    return rows


def tuning_gaps(data: dict, chosen: dict, methods: list[str]) -> dict:
    """{family: {method: {"payload": ×, "last": outer steps, "steps": {outer step: Δ %}}}}: at the tuning
    seed, each method's chosen point against torchft's chosen point after every validated outer step
    (one run each: no interval; a step a run did not reach left out)."""
    gaps = {}
    for family, runs in data.items():
        reference = runs["tuning"].get(REFERENCE, {}).get(chosen.get(family, {}).get(REFERENCE) or "")
        for method in methods:
            mine = runs["tuning"].get(method, {}).get(chosen.get(family, {}).get(method) or "")
            if method == REFERENCE or reference is None or mine is None:
                continue
            steps = {
                int(c): 100 * (mine["val"][c] / loss - 1)
                for c, loss in reference["val"].items()
                if mine["val"].get(c) is not None and loss is not None
            }
            gaps.setdefault(family, {})[method] = {
                "payload": mine["bytes"] / reference["bytes"],
                "last": reference["outer_steps"],
                "steps": dict(sorted(steps.items())),
            }
    return gaps


def tuning_stats(gaps: dict) -> dict:
    """`tuning_gaps` in `family_stats`' shape for the pictures: each step a point of one seed."""
    nan = float("nan")
    stats = {}
    for family, by_method in gaps.items():
        last = next(iter(by_method.values()))["last"]
        stats[family] = {REFERENCE: {"payload": 1.0, "steps": {}, "last": last}}
        for method, g in by_method.items():
            points = {c: {"mean": d, "low": nan, "high": nan, "deltas": [d]} for c, d in g["steps"].items()}
            stats[family][method] = {"payload": g["payload"], "steps": points, "last": last}
    return stats


def moved(gap: dict) -> str:
    """The gap at the checkpoints: "+a at 20 → +b at 60 → +c at 120" (diverged: none reached)."""
    marks = [c for c in checkpoints(gap["last"]) if c in gap["steps"]]
    return " → ".join(f"{gap['steps'][c]:+.2f} at {c}" for c in marks) or "diverged"


def tuning_rows(data: dict, chosen: dict, methods: list[str]) -> list[list]:
    """Per tuned family and method: its grid's losses (the chosen point in bold) and, at the tuning seed,
    the chosen point's Δ % against torchft's chosen point after each checkpoint (one run each: no interval)."""
    gaps = tuning_gaps(data, chosen, methods)
    rows = []
    for family, runs in data.items():
        for method in methods:
            grid = runs["tuning"].get(method, {})
            if not grid:
                continue
            pick = chosen[family].get(method)
            losses = "; ".join(
                f"{'**' if key == pick else ''}{key}: "
                f"{'diverged' if r['val_loss'] is None else format(r['val_loss'], '.4f')}{'**' if key == pick else ''}"
                for key, r in grid.items()
            )
            mine = gaps.get(family, {}).get(method)
            rows.append([family, method, losses, "–" if mine is None else moved(mine)])
    return rows


def tuning_headline(data: dict, chosen: dict, methods: list[str]) -> str:
    """Where no comparison seed has finished: the tuning seed's reading (one run each), the closest
    method at ≤ SMALL_PAYLOAD× and how its gap moved."""
    gaps = tuning_gaps(data, chosen, methods)
    text = "no comparison seed has finished yet, so nothing is paired and no interval exists"
    for family, by_method in gaps.items():
        small = {m: g for m, g in by_method.items() if g["payload"] <= SMALL_PAYLOAD and g["last"] in g["steps"]}
        if not small:
            continue
        closest = min(small, key=lambda m: abs(small[m]["steps"][small[m]["last"]]))
        text += (
            f". At the tuning seed on {family} (one run each, Δ % against torchft's DiLoCo): closest at "
            f"≤ {SMALL_PAYLOAD:g}× payload {closest} ({small[closest]['payload']:.3f}×), "
            f"{moved(small[closest])} outer steps; every method: "
            + "; ".join(f"{m} ({g['payload']:.3f}×) {moved(g)}" for m, g in by_method.items())
        )
    return text + "."


def headline(families: list[str], stats: dict, seeds: list[int] | None = None) -> str:
    """Per method the families where it holds at the last outer step (and the seeds it has, where fewer
    than asked); the closest method at ≤ SMALL_PAYLOAD× and how its gap moved with the outer steps."""
    methods = list(dict.fromkeys(m for f in families for m in stats[f] if m != REFERENCE))
    last = next(iter(stats.values()))[REFERENCE]["last"]
    parts = []
    for method in methods:
        mine = [f for f in families if method in stats[f]]
        held = [f for f in mine if (p := stats[f][method]["steps"].get(last)) is not None and holds(p)]
        payload = max(stats[f][method]["payload"] for f in mine)
        short = [
            f"{f} {len(stats[f][method]['seeds'])}" for f in mine if len(stats[f][method]["seeds"]) < len(seeds or [])
        ]
        note = f" (seeds: {', '.join(short)} of {len(seeds)})" if short else ""
        parts.append(f"{method} ({payload:.3f}×) {len(held)}/{len(families)}{note}")
    text = f"within ±{BOUND:g} % of torchft's DiLoCo after {last} outer steps: " + ", ".join(parts)
    small = [m for m in methods if max(stats[f][m]["payload"] for f in families if m in stats[f]) <= SMALL_PAYLOAD]
    if small:
        closest = min(
            small, key=lambda m: max(_upper(stats[f][m]["steps"].get(last)) for f in families if m in stats[f])
        )
        mine = [f for f in families if closest in stats[f]]
        path = " → ".join(
            f"{mean(p['mean'] for p in ps):+.2f} % at {c}"
            for c in checkpoints(last)
            if None not in (ps := [stats[f][closest]["steps"].get(c) for f in mine])
        )
        ends = "; ".join(f"{f} {cell(stats[f][closest]['steps'].get(last))} %" for f in mine)
        text += f". Closest at ≤ {SMALL_PAYLOAD:g}× payload: {closest} ({ends}); its gap (mean of the families): {path}"
    return text + "."


def _upper(p: dict | None) -> float:
    """How far the interval reaches from 0 (one seed: its Δ)."""
    if p is None:
        return float("inf")
    return abs(p["mean"]) if len(p["deltas"]) == 1 else max(abs(p["low"]), abs(p["high"]))


def cost_line(data: dict, families: list[str]) -> str:
    walls = {
        f: [r["wall_s"] / 60 for kind in ("tuning", "compare") for m in data[f][kind].values() for r in m.values()]
        for f in families
    }
    every = [w for f in families for w in walls[f]]
    if not every:
        return ""
    per = ", ".join(
        f"{f} {mean(walls[f]):.1f} min ({min(walls[f]):.1f}–{max(walls[f]):.1f})" for f in families if walls[f]
    )
    runs = [r for f in families for kind in ("tuning", "compare") for m in data[f][kind].values() for r in m.values()]
    cpu = [r["cpu_s"] / 60 for r in runs if r.get("cpu_s") is not None]
    busy = (
        f" The {len(cpu)} runs that counted their CPU time took {mean(cpu):.1f} CPU-minutes each "
        f"({min(cpu):.1f}–{max(cpu):.1f}; the replicas' processes together, their start included): at least "
        f"{mean(cpu) / 2:.1f} min of wall time on two idle cores."
        if cpu
        else ""
    )
    return (
        f"Cost: a cell (one method at one seed of one family: every replica's inner steps and validations) took "
        f"{mean(every):.1f} min of wall time on average on this machine's two shared cores ({per}); "
        f"{len(every)} runs in all, {sum(every) / 60:.1f} h of runs (families trained at once overlap).{busy}"
    )


def not_run(data: dict, methods: list[str], seeds: list[int], args, chosen: dict) -> list[str]:
    """What the regime asked for and the runs lack (a regime stopped on the way), one line per family."""
    from .diloco_regime import multiples, tunes_inner
    from .diloco_runs import method_arm

    outer = len(multiples(args.tune_outer, "--tune-outer"))
    inner = len(multiples(args.tune_inner, "--tune-inner"))
    lines = []
    for family, runs in data.items():
        gaps = []
        if family in tune_on(args):
            for m in methods:
                want = outer + (inner if tunes_inner(method_arm(m)) else 0)
                if len(runs["tuning"].get(m, {})) < want:
                    gaps.append(f"tuning {m}: {len(runs['tuning'].get(m, {}))} of {want} grid points")
        for m in methods:
            absent = [s for s in seeds if str(s) not in runs["compare"].get(m, {})]
            if absent and chosen.get(family, {}).get(m) is None and family in tune_on(args):
                gaps.append(f"{m}: not compared (no tuned point yet, or every point diverged)")
            elif absent:
                gaps.append(f"{m} at seed{'s' if len(absent) > 1 else ''} {', '.join(map(str, absent))}")
        if gaps:
            lines.append(f"{family}: " + "; ".join(gaps) + ".")
    return lines


def summarise(out, setting, args, seeds: list[int], methods: list[str], data: dict, chosen: dict) -> dict:
    families = [f for f in data if paired_seeds(data[f]["compare"], REFERENCE, seeds)]
    stats = {f: family_stats(data[f]["compare"], methods, seeds) for f in families}
    missing = not_run(data, methods, seeds, args, chosen)
    gaps = tuning_gaps(data, chosen, methods)
    top = headline(families, stats, seeds) if families else tuning_headline(data, chosen, methods)
    last = stats[families[0]][REFERENCE]["last"] if families else setting.steps // int(args.sync_every)
    text = [
        "# Experiment `diloco --regime frontier`: the sparse outer syncs where SparseLoCo claims them",
        "",
        f"**Headline:** {top}",
        "",
        *(
            [
                "**Not run** (the regime stopped before these runs; the same command with `--reuse` of this "
                "folder resumes it):",
                "",
                *(f"- {line}" for line in missing),
                "",
            ]
            if missing
            else []
        ),
        setting_text(setting, args, seeds, last),
        "",
    ]
    if families:
        points = checkpoints(last)
        header = ["model", "method", "outer lr · inner lr (tuned)", "payload vs torchft", "‖M−Ĝ‖/‖M‖"]
        header += [f"val loss at {last}", *(f"Δ % at {c} [95 % CI]" for c in points), f"within ±{BOUND:g} % at {last}"]
        text += [markdown_table([*header, "seeds"], tables(stats, data)), ""]
    text += [
        "Tuning (validation loss after the last outer step at the tuning seed, bold: chosen; and the chosen "
        "point's Δ % against torchft's chosen point at that seed, one run each, no interval):",
        "",
        markdown_table(
            ["model", "method", "grid point: val loss", "Δ % vs torchft at the tuning seed"],
            tuning_rows(data, chosen, methods),
        ),
        "",
        cost_line(data, list(data)),
    ]
    pictures = (families, stats, "") if families else (list(gaps), tuning_stats(gaps), " (tuning seed, one run)")
    if pictures[0]:
        text += ["", f"Plots: `{plot_frontier(out, *pictures).name}`, `{plot_curves(out, *pictures).name}`"]
    (out / "summary.md").write_text("\n".join(text) + "\n")
    paired = {f"{f} {m} {c}": p for f in families for m, s in stats[f].items() for c, p in s["steps"].items()}
    write_json(
        out / "results.json",
        {
            "setting": vars(setting),
            "seeds": seeds,
            "chosen": chosen,
            "runs": data,
            "paired": paired,
            "not_run": missing,
        },
    )
    return {"headline": top, "paired": paired}


def setting_text(setting, args, seeds: list[int], last: int) -> str:
    others = [f for f in args.models.split(",") if f and f not in tune_on(args)]
    untuned = f"{' and '.join(others)} at the points chosen there" if others else "each family on its own"
    return (
        f"Setting: {args.replicas} replicas (one process each, its own shard of the data), H = {args.sync_every}, "
        f"{setting.steps} inner steps ({last} outer steps) of {FRONTIER_SIZE.batch} × {FRONTIER_SIZE.seq_len} tokens "
        f"per replica, models {FRONTIER_SIZE.layers} layers × {FRONTIER_SIZE.width} wide on BPE tokens "
        f"(vocabulary {FRONTIER_SIZE.vocab}) of the first 1 M characters of the KJV Bible; AdamW inner steps, a "
        f"linear warm-up over the first {WARMUP_SHARE:.0%} of them, then a cosine to 0; gradients clipped at 1. "
        f"Each method tuned on seed {setting.seed + TUNING_SEED_OFFSET} of {' and '.join(tune_on(args))} (outer lr × "
        f"{args.tune_outer}, then inner lr × {args.tune_inner or '–'} at the best outer lr for torchft's DiLoCo and "
        f"the sparse syncs; {untuned}), compared at seeds {seeds}. Δ % = 100·(method / torchft − 1) of the "
        "validation loss of θ_global over "
        f"{FRONTIER_SIZE.val_batches} × {FRONTIER_SIZE.batch} validation blocks after that outer step, same seed, "
        f"with its 95 % t-interval; a method holds where the interval lies inside ±{BOUND:g} %. Payload: what one "
        "replica's messages hold against torchft's fp32 pseudo-gradients (not the wire); ‖M−Ĝ‖/‖M‖: the sync's "
        "relative error, mean over outer steps and seeds."
    )
