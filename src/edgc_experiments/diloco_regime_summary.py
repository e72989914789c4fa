"""The summary of `edgc experiment diloco --regime frontier` (`diloco_regime`): per family and method, the
paired Δ % of the validation loss against torchft's DiLoCo at 20, 60 and the last outer step with its
95 % t-interval; whether it holds (the interval inside ±`BOUND` %); the tuning grid's losses; what a
run cost; the frontier as a picture (payload against Δ %, one panel per family and outer step) and the
Δ % against the outer steps beside it.
"""

from __future__ import annotations

from statistics import mean

from .common import fmt, fmt_interval, markdown_table, pyplot, save, t_interval, write_json
from .diloco_frontier import BOUND, holds
from .diloco_regime import FRONTIER_SIZE, TUNING_SEED_OFFSET, WARMUP_SHARE, checkpoints, tune_on

SMALL_PAYLOAD = 0.02  # × torchft's: the payload the frontier is claimed at
REFERENCE = "torchft"


def complete(runs: dict, methods: list[str], seeds: list[int]) -> list[str]:
    """The methods (torchft's first) with a run at every seed."""
    return [m for m in methods if all(str(s) in runs.get(m, {}) for s in seeds)]


def paired_at(runs: dict, method: str, seeds: list[int], step: int) -> dict | None:
    """Paired Δ % of ``method``'s validation loss against torchft's after outer step ``step`` (None where a
    run diverged or was not validated there)."""
    losses = [
        (runs[method][str(s)]["val"].get(str(step)), runs[REFERENCE][str(s)]["val"].get(str(step))) for s in seeds
    ]
    if any(a is None or b is None for a, b in losses):
        return None
    deltas = [100 * (a / b - 1) for a, b in losses]
    m, low, high = t_interval(deltas)
    return {"deltas": deltas, "mean": m, "low": low, "high": high, "val_loss": mean(a for a, _ in losses)}


def family_stats(runs: dict, methods: list[str], seeds: list[int]) -> dict:
    """{method: {payload, relative_error, steps: {outer step: paired or None}}} of one family."""
    outer_steps = runs[REFERENCE][str(seeds[0])]["outer_steps"]
    stats = {}
    for method in methods:
        mine = [runs[method][str(s)] for s in seeds]
        errors = [o["relative_error"] for r in mine for o in r["outer"] if o.get("relative_error") is not None]
        stats[method] = {
            "payload": mean(r["bytes"] / runs[REFERENCE][str(s)]["bytes"] for r, s in zip(mine, seeds)),
            "relative_error": mean(errors) if errors else None,
            "diverged": [r["diverged_at"] for r in mine if r.get("diverged_at") is not None],
            "steps": {c: paired_at(runs, method, seeds, c) for c in evaluated(runs, seeds)},
            "last": outer_steps,
        }
    return stats


def evaluated(runs: dict, seeds: list[int]) -> list[int]:
    return sorted(int(k) for k in runs[REFERENCE][str(seeds[0])]["val"])


def cell(p: dict | None) -> str:
    return "diverged" if p is None else fmt_interval(p, "+.2f")


def tuned_setting(runs: dict, method: str) -> str:
    """The outer learning rate and the inner one's multiple the method ran at."""
    arm = next(iter(runs[method].values()))["arm"]
    return f"{arm['outer_lr']:.3g} · ×{arm.get('inner_lr', 1.0):g}"


def tables(families: list[str], stats: dict, data: dict, chosen: dict) -> tuple[list[list], list[list]]:
    """(the comparison's rows, the tuning grid's rows)."""
    rows, grid = [], []
    for family in families:
        for method, s in stats[family].items():
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
                ]
            )
            runs = data[family]["tuning"].get(method, {})
            if not runs:
                continue
            losses = [
                f"{'**' if key == chosen[family].get(method) else ''}{key}: "
                f"{'diverged' if r['val_loss'] is None else format(r['val_loss'], '.4f')}"
                f"{'**' if key == chosen[family].get(method) else ''}"
                for key, r in runs.items()
            ]
            grid.append([family, method, "; ".join(losses)])
    return rows, grid


def headline(families: list[str], stats: dict) -> str:
    """Per method the families where it holds at the last outer step; the closest method at ≤ SMALL_PAYLOAD×
    and how its gap moved with the outer steps."""
    methods = [m for m in next(iter(stats.values())) if m != REFERENCE]
    last = next(iter(stats.values()))[REFERENCE]["last"]
    parts = []
    for method in methods:
        held = [f for f in families if (p := stats[f][method]["steps"].get(last)) is not None and holds(p)]
        payload = max(stats[f][method]["payload"] for f in families)
        parts.append(f"{method} ({payload:.3f}×) {len(held)}/{len(families)}")
    text = f"within ±{BOUND:g} % of torchft's DiLoCo after {last} outer steps: " + ", ".join(parts)
    small = [m for m in methods if max(stats[f][m]["payload"] for f in families) <= SMALL_PAYLOAD]
    if small:
        closest = min(small, key=lambda m: max(_upper(stats[f][m]["steps"].get(last)) for f in families))
        moved = " → ".join(
            f"{mean(p['mean'] for p in ps):+.2f} % at {c}"
            for c in checkpoints(last)
            if None not in (ps := [stats[f][closest]["steps"].get(c) for f in families])
        )
        ends = "; ".join(f"{f} {cell(stats[f][closest]['steps'].get(last))} %" for f in families)
        text += (
            f". Closest at ≤ {SMALL_PAYLOAD:g}× payload: {closest} ({ends}); its gap (mean of the families): {moved}"
        )
    return text + "."


def _upper(p: dict | None) -> float:
    return float("inf") if p is None else max(abs(p["low"]), abs(p["high"]))


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
    return (
        f"Cost: a cell (one method at one seed of one family: every replica's inner steps and validations) took "
        f"{mean(every):.1f} min of wall time on average on this machine's two shared cores ({per}); "
        f"{len(every)} runs in all, {sum(every) / 60:.1f} h of runs (families trained at once overlap)."
    )


def summarise(out, setting, args, seeds: list[int], methods: list[str], data: dict, chosen: dict) -> dict:
    families = [f for f in data if complete(data[f]["compare"], methods, seeds)[:1] == [REFERENCE]]
    left = [f for f in data if f not in families]
    stats = {f: family_stats(data[f]["compare"], complete(data[f]["compare"], methods, seeds), seeds) for f in families}
    if not families:
        (out / "summary.md").write_text("# No family has torchft's DiLoCo at every seed: nothing to compare.\n")
        return {"headline": "no family has torchft's DiLoCo at every seed", "paired": {}}
    rows, grid = tables(families, stats, data, chosen)
    others = [f for f in families if f not in tune_on(args)]
    untuned = f"{' and '.join(others)} at the points chosen there" if others else "each family on its own"
    last = stats[families[0]][REFERENCE]["last"]
    points = checkpoints(last)
    text = [
        "# Experiment `diloco --regime frontier`: the sparse outer syncs where SparseLoCo claims them",
        "",
        f"**Headline:** {headline(families, stats)}",
        "",
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
        "relative error, mean over outer steps and seeds.",
        "",
        *([f"Left out (torchft's DiLoCo not at every seed): {', '.join(left)}.", ""] if left else []),
        markdown_table(
            [
                "model",
                "method",
                "outer lr · inner lr (tuned)",
                "payload vs torchft",
                "‖M−Ĝ‖/‖M‖",
                f"val loss at {last}",
                *(f"Δ % at {c} [95 % CI]" for c in points),
                f"within ±{BOUND:g} % at {last}",
            ],
            rows,
        ),
        "",
        "Tuning (validation loss after the last outer step at the tuning seed; bold: chosen):",
        "",
        markdown_table(["model", "method", "grid point: val loss"], grid),
        "",
        cost_line(data, families),
        "",
        f"Plots: `{plot_frontier(out, families, stats).name}`, `{plot_curves(out, families, stats).name}`",
    ]
    (out / "summary.md").write_text("\n".join(text) + "\n")
    paired = {f"{f} {m} {c}": p for f in families for m, s in stats[f].items() for c, p in s["steps"].items()}
    write_json(
        out / "results.json",
        {"setting": vars(setting), "seeds": seeds, "chosen": chosen, "runs": data, "paired": paired},
    )
    return {"headline": headline(families, stats), "paired": paired}


def plot_frontier(out, families: list[str], stats: dict):
    """Δ % against the payload (log), one row per family, one column per checkpoint; each method a point
    with its interval, green where it holds; the ±BOUND % band."""
    plt = pyplot()
    last = stats[families[0]][REFERENCE]["last"]
    points = checkpoints(last)
    fig, axes = plt.subplots(
        len(families), len(points), figsize=(3.3 * len(points), 3.0 * len(families)), squeeze=False
    )
    for row, family in zip(axes, families):
        for ax, c in zip(row, points):
            ax.axhspan(-BOUND, BOUND, color="grey", alpha=0.2)
            ax.axhline(0, color="black", lw=0.8)
            for method, s in stats[family].items():
                p = s["steps"].get(c)
                if method == REFERENCE or p is None:
                    continue
                color = "tab:green" if holds(p) else "tab:red"
                ax.errorbar(
                    [s["payload"]],
                    [p["mean"]],
                    yerr=[[p["mean"] - p["low"]], [p["high"] - p["mean"]]],
                    fmt="o",
                    color=color,
                    ms=4,
                    capsize=2,
                )
                ax.annotate(
                    method.split("-decay")[0],
                    (s["payload"], p["mean"]),
                    fontsize=6,
                    xytext=(3, 2),
                    textcoords="offset points",
                )
            ax.plot([1.0], [0.0], "*", color="black", ms=7)  # torchft's DiLoCo itself
            ax.annotate("torchft", (1.0, 0.0), fontsize=6, xytext=(-12, 5), textcoords="offset points")
            ax.set_xscale("log")
            ax.set_xlim(0.005, 2.0)
            ax.set_title(f"{family}, after {c} outer steps", fontsize=8)
            ax.set_xlabel("payload vs torchft's DiLoCo", fontsize=7)
            ax.tick_params(which="both", labelsize=6)
        row[0].set_ylabel(f"Δ % val loss vs torchft (95 % CI; band ±{BOUND:g} %)", fontsize=7)
    return save(fig, out / "frontier.png")


def plot_curves(out, families: list[str], stats: dict):
    """Δ % against the outer steps, one panel per family: each method's mean with its interval shaded."""
    plt = pyplot()
    fig, axes = plt.subplots(1, len(families), figsize=(4.6 * len(families), 3.4), squeeze=False)
    for ax, family in zip(axes[0], families):
        ax.axhspan(-BOUND, BOUND, color="grey", alpha=0.2)
        ax.axhline(0, color="black", lw=0.8)
        for method, s in stats[family].items():
            steps = [c for c, p in sorted(s["steps"].items()) if p is not None]
            if method == REFERENCE or not steps:
                continue
            ps = [s["steps"][c] for c in steps]
            (line,) = ax.plot(steps, [p["mean"] for p in ps], lw=1.2, label=method.split("-decay")[0])
            ax.fill_between(steps, [p["low"] for p in ps], [p["high"] for p in ps], color=line.get_color(), alpha=0.15)
        ax.set_yscale("symlog", linthresh=1.0)
        ax.set_title(family, fontsize=8)
        ax.set_xlabel("outer steps (syncs)", fontsize=7)
        ax.tick_params(labelsize=6)
    axes[0][0].set_ylabel("Δ % val loss vs torchft's DiLoCo (95 % CI)", fontsize=7)
    axes[0][-1].legend(fontsize=6)
    return save(fig, out / "curves.png")
