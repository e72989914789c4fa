"""The summary of `edgc experiment pareto` (pareto.py): per budget and arm the paired Δ val loss
against static PowerSGD over the seeds, what a rank change costs, the table, headline and plot."""

from __future__ import annotations

from statistics import mean

from . import change_cost, common
from .common import fmt, fmt_interval, markdown_table, t_interval
from .pareto_arms import DERIVED, RANK_CHANGES, SLOW_PERIOD, compressed_steps
from .pareto_runs import resolved_config


def paired(results: dict, arm: str, seeds: list[int]) -> dict:
    """Paired Δ val loss and bytes ratio of ``arm`` against static at one budget."""
    deltas = [results[arm][str(s)]["val_loss"] - results["static"][str(s)]["val_loss"] for s in seeds]
    ratio = mean(results[arm][str(s)]["bytes"] / results["static"][str(s)]["bytes"] for s in seeds)
    m, low, high = t_interval(deltas)
    return {
        "deltas": deltas,
        "mean": m,
        "low": low,
        "high": high,
        "bytes_ratio": ratio,
        "mean_rank": mean(results[arm][str(s)]["mean_rank"] or 0.0 for s in seeds),
        "rank_changes": mean(results[arm][str(s)]["rank_changes"] for s in seeds),
        "val_loss": mean(results[arm][str(s)]["val_loss"] for s in seeds),
    }


def budget_rows(budgets, plan, results, seeds):
    """Per byte budget: each arm's paired difference against the budget's static PowerSGD over the
    seeds, the table's rows and the headline's parts."""
    table, headline = [], []
    stats: dict = {}
    for b in budgets:
        arms_b = {name: paired(results[str(b)], name, seeds) for name in plan[b]}
        hand = [arms_b[n]["mean"] for n in ("hand-3", "hand-2") if n in arms_b]
        best_hand = min(hand) if hand else None
        for name, p in arms_b.items():
            p["recovered"] = (
                p["mean"] / best_hand
                if best_hand is not None and best_hand < 0 and name.startswith("budget-")
                else None
            )
            p["beats_static"] = name != "static" and p["high"] < 0
        stats[str(b)] = arms_b
        for name, p in arms_b.items():
            table.append(
                [
                    b,
                    name,
                    f"{p['mean_rank']:.2f}",
                    f"{p['bytes_ratio']:.3f}",
                    f"{p['val_loss']:.4f}",
                    "–" if name == "static" else " ".join(f"{d:+.4f}" for d in p["deltas"]),
                    "–" if name == "static" else f"{p['mean']:+.4f} [{p['low']:+.4f}, {p['high']:+.4f}]",
                    fmt(p["recovered"], ".0%") if p["recovered"] is not None else "–",
                    f"{p['rank_changes']:.1f}",
                ]
            )
        default = arms_b.get("budget-schedule")
        if default is not None:
            headline.append(
                f"b={b}: budget controller {default['mean']:+.4f} "
                f"[{default['low']:+.4f}, {default['high']:+.4f}] vs static"
                + (
                    f" ({default['recovered']:.0%} of the best hand-set gain)"
                    if default["recovered"] is not None
                    else ""
                )
            )
    return headline, stats, table


def summarise(out, setting, budgets, seeds, plan, results, skipped=()) -> dict:
    headline, stats, table = budget_rows(budgets, plan, results, seeds)
    change_cost = []
    for b in budgets:
        if {"alt-warm", "alt-truncate"} <= set(plan[b]):
            change_cost.append(
                change_cost_text(b, results[str(b)], stats[str(b)], seeds, compressed_steps(setting.steps))
            )
    header = [
        "budget",
        "arm",
        "mean rank",
        "bytes vs static",
        "val loss (mean)",
        "Δ per seed",
        "Δ mean [95 % CI]",
        "of best hand-set gain",
        "rank changes",
    ]
    plot = plot_budgets(out, budgets, stats)
    summary = [
        "# Experiment `pareto`: does a moving rank beat static PowerSGD at the same bytes?",
        "",
        f"**Headline:** {'; '.join(headline) or 'no budget-controller arm ran'}.",
        "",
        f"Setting: {setting.describe(1)}; seeds {seeds}; every arm shares data order, initialisation and the "
        "10 % uncompressed warm-up; validation loss over the whole validation split; bytes counted after the warm-up. "
        "Δ = arm − static at the same seed (negative: the arm learns more from the same bytes).",
        "",
        markdown_table(header, table),
        "",
        *(line for text in change_cost for line in (text, "")),
        *(
            [f"Not run (no finished runs for every seed): {', '.join(f'{n} at b={b}' for b, n in skipped)}.", ""]
            if skipped
            else []
        ),
        f"Plot: `{plot.relative_to(out)}`",
    ]
    (out / "summary.md").write_text("\n".join(summary) + "\n")
    common.write_json(
        out / "results.json",
        {
            "setting": vars(setting),
            "seeds": seeds,
            "budgets": budgets,
            "arms": {str(b): plan[b] for b in budgets},
            "configs": {str(b): {name: resolved_config(fields) for name, fields in plan[b].items()} for b in budgets},
            "runs": results,
            "paired": stats,
        },
    )
    return {"headline": "; ".join(headline), "paired": stats}


def change_cost_text(b: int, runs_b: dict, stats_b: dict, seeds: list[int], compressed_steps: int) -> str:
    """The alternation arms' paragraph; adds 'warm-vs-truncate', 'per-change-<rule>' and
    'per-step-cold' to ``stats_b``."""
    fast = {mode: stats_b[f"alt-{mode}"] for mode in RANK_CHANGES}
    text = (
        f"**Cost of changing the rank** (b={b}: the rank alternates {b // 2} ↔ {b + b // 2} every window, "
        f"{fast['warm']['rank_changes']:.0f} changes, against static {b}): warm start kept "
        f"{fmt_interval(fast['warm'])}, truncate-or-random {fmt_interval(fast['truncate'])}"
    )
    # warm − truncate, paired by seed: what keeping the warm start saves per run
    diff = stats_b["warm-vs-truncate"] = paired(
        {"static": runs_b["alt-truncate"], "arm": runs_b["alt-warm"]}, "arm", seeds
    )
    text += f"; warm − truncate {fmt_interval(diff)} (bytes {diff['bytes_ratio']:.3f}×: the residual all-reduce)."
    if "cold" in stats_b:
        cold = stats_b["cold"]
        per = stats_b["per-step-cold"] = {k: cold[k] / compressed_steps for k in ("mean", "low", "high")}
        text += (
            f" **What a warm start is worth:** re-drawing Q every step (static {b}, no warm start) costs "
            f"{fmt_interval(cold)} against static, {fmt_interval(per, '+.5f')} per compressed step; a change "
            "discards at most part of the warm start for the few steps the power iteration needs to settle, "
            "so this bounds what one change can cost."
        )
    text += change_cost.paragraph(
        b, {mode: runs_b[f"alt-{mode}"] for mode in RANK_CHANGES}, runs_b["static"], stats_b, seeds
    )
    slow = f"alt{SLOW_PERIOD}"
    if not all(f"{slow}-{mode}" in runs_b for mode in RANK_CHANGES):
        return text
    parts = []
    for mode in RANK_CHANGES:  # fast − slow at the same ranks and bytes, per extra change
        d = paired({"static": runs_b[f"{slow}-{mode}"], "arm": runs_b[f"alt-{mode}"]}, "arm", seeds)
        extra = fast[mode]["rank_changes"] - stats_b[f"{slow}-{mode}"]["rank_changes"]
        per = {k: d[k] / extra for k in ("mean", "low", "high")}
        stats_b[f"per-change-{mode}"] = {**per, "fast_minus_slow": d, "extra_changes": extra}
        parts.append(f"{mode} {fmt_interval(per, '+.5f')}")
    text += (
        f" Per change (every window against every {SLOW_PERIOD} windows at the same ranks and bytes, "
        f"paired by seed, over the {stats_b['per-change-warm']['extra_changes']:.0f} extra changes): "
        + ", ".join(parts)
        + "."
    )
    return text


def plot_budgets(out, budgets, stats):
    plt = common.pyplot()
    fig, axes = plt.subplots(1, len(budgets), figsize=(4.2 * len(budgets), 3.6), squeeze=False)
    for ax, b in zip(axes[0], budgets):
        names = [n for n in stats[str(b)] if n != "static" and not n.startswith(DERIVED)]  # arms, each against static
        ys = range(len(names))
        for y, name in zip(ys, names):
            p = stats[str(b)][name]
            color = (
                "tab:red"
                if name.startswith("budget")
                else ("tab:grey" if name.startswith(("alt", "cold")) else "tab:blue")
            )
            ax.errorbar([p["mean"]], [y], xerr=[[p["mean"] - p["low"]], [p["high"] - p["mean"]]], fmt="o", color=color)
        ax.axvline(0, color="black", lw=0.8)
        ax.set_yticks(list(ys), names, fontsize=7)
        ax.set_xlabel("Δ val loss vs static (95 % CI)", fontsize=8)
        ax.set_title(f"budget: mean rank {b}", fontsize=9)
    return common.save(fig, out / "pareto.png")
