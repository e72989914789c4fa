"""The pictures of `edgc experiment diloco --regime frontier` (`diloco_regime_summary`): the frontier
(payload against Δ % with its interval, one panel per family and checkpoint) and Δ % against the
outer steps. Both take the summary's per-family stats; at one seed (a run's tuning seed, read before
any comparison seed has finished) a point has no interval and nothing holds.
"""

from __future__ import annotations

from .common import pyplot, save
from .diloco_frontier import BOUND, holds
from .diloco_regime import checkpoints

REFERENCE = "torchft"


def plot_frontier(out, families: list[str], stats: dict, note: str = ""):
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
            ax.set_title(f"{family}, after {c} outer steps{note}", fontsize=8)
            ax.set_xlabel("payload vs torchft's DiLoCo", fontsize=7)
            ax.tick_params(which="both", labelsize=6)
        row[0].set_ylabel(f"Δ % val loss vs torchft (95 % CI; band ±{BOUND:g} %)", fontsize=7)
    return save(fig, out / "frontier.png")


def plot_curves(out, families: list[str], stats: dict, note: str = ""):
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
        ax.set_title(f"{family}{note}", fontsize=8)
        ax.set_xlabel("outer steps (syncs)", fontsize=7)
        ax.tick_params(labelsize=6)
    axes[0][0].set_ylabel("Δ % val loss vs torchft's DiLoCo (95 % CI)", fontsize=7)
    axes[0][-1].legend(fontsize=6)
    return save(fig, out / "curves.png")
