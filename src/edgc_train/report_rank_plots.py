"""The report's plots of the rank (report_plots.py runs them): the rank in force at each step with
the bytes it sent, and per pipeline stage the rank and when its gradient sync finished."""

from __future__ import annotations

import math
import statistics
from pathlib import Path

from .report_runs import Run, steady
from .report_style import empty_panel, mark_warmup, plain_log


def draw_rank_bounds(ax, run: Run, c: str) -> None:
    """A run's rank budget beside the mean rank spent so far, and its r_max and r_min."""
    budget = run.edgc.get("rank_budget")
    if budget is not None:  # the budget against what the run has spent so far
        spent = [(r["step"], r["mean_rank"]) for r in run.train if r.get("mean_rank") is not None]
        ax.axhline(budget, color=c, ls=":", lw=1.6)
        ax.annotate(
            f"budget: mean rank {budget:g}",
            (0.995, budget),
            xycoords=("axes fraction", "data"),
            textcoords="offset points",
            xytext=(-2, 3),
            fontsize=8,
            color=c,
            ha="right",
        )
        if spent:
            ax.plot(
                [s for s, _ in spent],
                [m for _, m in spent],
                color=c,
                lw=1.2,
                ls="-.",
                label=f"{run.label}: mean rank spent so far (final {spent[-1][1]:.2f})",
            )
    for bound, name in (("r_max", "r_max"), ("r_min", "r_min")):
        value = run.edgc.get(bound)
        if value is not None:
            ax.axhline(value, color=c, ls="--", lw=0.9, alpha=0.6)
            ax.annotate(
                f"{name} = {value}",
                (0.005, value),
                xycoords=("axes fraction", "data"),
                textcoords="offset points",
                xytext=(2, 3),
                fontsize=8,
                color=c,
            )


def draw_bytes_sent(ax, runs: list[Run], colors: dict) -> None:
    """The bytes each run sent per step, on a log scale."""
    for run in runs:
        xs = [r["step"] for r in run.train]
        ys = [(r.get("bytes_sent") or 0) / 1e6 for r in run.train]
        ax.step(
            xs,
            ys,
            where="mid",
            lw=1.8,
            color=colors[run.label],
            label=f"{run.label}: mean {run.stats['bytes_per_step'] / 1e6:.2f} MB/step",
        )
    plain_log(ax)
    ax.set_ylabel("MB sent per step (log scale)")
    ax.set_xlabel("optimizer step")
    ax.set_xlim(left=0)
    ax.grid(alpha=0.3, which="both")
    ax.legend(fontsize=8.5)


def plot_rank(plt, runs: list[Run], out: Path, colors: dict) -> Path:
    """The PowerSGD rank in force at each step, and the bytes sent per step."""
    from matplotlib.ticker import MaxNLocator

    fig, (ax, ax2) = plt.subplots(2, 1, figsize=(9.5, 7.2), sharex=True, gridspec_kw={"height_ratios": [3, 2]})
    fig.suptitle("Compression rank and gradient traffic per step", fontsize=13, fontweight="bold")
    fig.text(
        0.5,
        0.94,
        "top: PowerSGD rank in force at each step (EDGC re-decides it at the end of every window)\n"
        "bottom: gradient bytes each rank hands to the all-reduces per step (uncompressed = every gradient raw)",
        ha="center",
        va="top",
        fontsize=9,
        color="#444444",
    )
    compressed_runs = [r for r in runs if r.compressed_steps]
    for run in compressed_runs:
        xs = [r["step"] for r in run.train]
        ys = [r["rank"] if r.get("rank") is not None else math.nan for r in run.train]
        c = colors[run.label]
        ax.step(xs, ys, where="mid", lw=2.2, color=c, label=f"{run.label}: rank")
        window = run.edgc.get("window")
        if window and run.edgc.get("adaptive", True) and len(compressed_runs) == 1:
            first = run.first_compressed_step or 0
            for b in range(window, run.train[-1]["step"] + 1, window):
                if b >= first:
                    ax.axvline(b + 0.5, color=c, lw=0.5, alpha=0.25)
        draw_rank_bounds(ax, run, c)
    if compressed_runs:
        mark_warmup(ax, compressed_runs, colors)
        top = max(max(r["rank"] for r in run.compressed_steps) for run in compressed_runs)
        top = max([top] + [run.edgc.get("r_max") or 0 for run in compressed_runs])
        ax.set_ylim(0, top * 1.15 + 1)
        ax.yaxis.set_major_locator(MaxNLocator(integer=True))
        if len(compressed_runs) == 1 and compressed_runs[0].edgc.get("window"):
            ax.plot(
                [],
                [],
                color=colors[compressed_runs[0].label],
                lw=0.5,
                alpha=0.4,
                label=f"window boundary (every {compressed_runs[0].edgc['window']} steps)",
            )
        ax.legend(fontsize=8.5, loc="best")
    else:
        empty_panel(ax, "no compressed steps in these runs (rank is undefined while uncompressed)")
    ax.set_ylabel("PowerSGD rank")
    ax.grid(alpha=0.3)
    draw_bytes_sent(ax2, runs, colors)
    fig.tight_layout(rect=(0, 0, 1, 0.93))
    fig.savefig(out / "rank.png", dpi=110)
    plt.close(fig)
    return out / "rank.png"


def sync_finish_spread(record: dict) -> float:
    """Seconds between the first and the last pipeline stage finishing its gradient sync in one step."""
    finishes = [s["sync_finish_s"] for s in record["stages"]]
    return max(finishes) - min(finishes)


def plot_stages(plt, runs: list[Run], out: Path) -> Path:
    """``stages.png``: per pipeline stage, the rank in force and when its gradient sync finished."""
    fig, axes = plt.subplots(2, len(runs), figsize=(6.5 * len(runs), 7.5), squeeze=False, sharex="col")
    fig.suptitle("Pipeline stages: ranks and gradient-sync finish times", fontsize=13, fontweight="bold")
    for col, run in enumerate(runs):
        top, bottom = axes[0][col], axes[1][col]
        n_stages = len(run.train[0]["stages"])
        ceiling = max([s["rank"] or 0 for r in run.train for s in r["stages"]] + [1])
        for stage in range(n_stages):
            xs = [r["step"] for r in run.train]
            # uncompressed steps are drawn above the highest rank, so "no compression" reads as "least"
            ranks = [r["stages"][stage]["rank"] for r in run.train]
            top.step(
                xs, [ceiling * 1.25 if v is None else v for v in ranks], where="post", lw=2, label=f"stage {stage}"
            )
            bottom.plot(
                xs, [r["stages"][stage]["sync_finish_s"] * 1000 for r in run.train], lw=1.2, label=f"stage {stage}"
            )
        top.axhline(ceiling * 1.25, color="#999999", ls=":", lw=1)
        top.text(run.train[0]["step"], ceiling * 1.27, "uncompressed", fontsize=8, color="#666666", va="bottom")
        top.set_ylim(0, ceiling * 1.45)
        top.set_ylabel("PowerSGD rank")
        top.set_title(run.label, fontsize=10)
        top.grid(alpha=0.3)
        top.legend(fontsize=8, loc="lower right")
        spreads = [sync_finish_spread(r) * 1000 for r in steady(run)]
        bottom.set_title(
            "gradient sync finished, ms after the earliest stage's backward ended"
            + (f"\nmedian spread between stages: {statistics.median(spreads):.1f} ms" if spreads else ""),
            fontsize=9,
        )
        bottom.set_xlabel("optimizer step")
        bottom.set_ylabel("sync finished (ms)")
        bottom.grid(alpha=0.3)
        bottom.legend(fontsize=8)
    fig.tight_layout(rect=(0, 0, 1, 0.95))
    fig.savefig(out / "stages.png", dpi=110)
    plt.close(fig)
    return out / "stages.png"
