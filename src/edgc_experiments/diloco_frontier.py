"""The frontier of `edgc experiment diloco`: per method, its payload against torchft's DiLoCo (what one
replica's messages hold, not the wire) and whether it holds within `BOUND` % on every cell (the paired
interval inside ±BOUND %), and a plot of the validation loss against the payload per outer step, one
panel per family.

A method holds in a cell when the 95 % t-interval of its paired Δ % against torchft's DiLoCo lies
inside ±BOUND % (an interval that reaches past either side is not a result within the bound, even
with a small mean). Where it stops holding is the first of its cells, by family, where it does not.
"""

from __future__ import annotations

from .common import markdown_table, pyplot, save

BOUND = 1.0  # % of torchft's validation loss


def holds(p: dict, bound: float = BOUND) -> bool:
    return -bound <= p["low"] and p["high"] <= bound


def frontier_rows(stats: dict, cells) -> list[list]:
    """One row per method (torchft's and heals left out), cheapest first."""
    names = [n for n in cells[0][3] if n != "torchft" and "+heal=" not in n]
    rows = []
    for name in names:
        mine = [(key, p) for (key, n), p in stats.items() if n == name]
        held = [key for key, p in mine if holds(p)]
        failed = [f"{key} {p['mean']:+.2f} [{p['low']:+.2f}, {p['high']:+.2f}]" for key, p in mine if not holds(p)]
        ratio = max(p["bytes_ratio"] for _, p in mine)
        rows.append([name, f"{ratio:.4f}", f"{len(held)}/{len(mine)}", "; ".join(failed) or "–"])
    return sorted(rows, key=lambda row: float(row[1]))


def frontier_table(stats: dict, cells) -> str:
    return markdown_table(
        ["method", "payload vs torchft (largest)", f"cells within ±{BOUND:g} %", "where it does not hold (Δ % [CI])"],
        frontier_rows(stats, cells),
    )


def plot_frontier(out, stats: dict, cells):
    """Validation loss against the payload per outer step (log), one panel per cell; torchft's a line with the
    ±BOUND % band, each method a point (the mean over seeds), green where it holds, red where not."""
    plt = pyplot()
    keys = sorted({key for key, _ in stats})
    fig, axes = plt.subplots(1, len(keys), figsize=(3.2 * len(keys), 3.2), squeeze=False)
    for ax, key in zip(axes[0], keys):
        # torchft and each method against it (not a heal's row, nor a two-stage method's against its twin)
        mine = {n: p for (k, n), p in stats.items() if k == key and "+heal=" not in n and " vs " not in n}
        reference = mine.get("torchft")
        for name, p in sorted(mine.items(), key=lambda item: item[1]["bytes_ratio"]):
            if name == "torchft":
                continue
            color = "tab:green" if holds(p) else "tab:red"
            loss = p["val_loss"]
            ax.plot([p["bytes_ratio"]], [loss], "o", color=color)
            ax.annotate(
                name.split("-")[0], (p["bytes_ratio"], loss), fontsize=6, xytext=(3, 2), textcoords="offset points"
            )
        if reference is not None:
            ax.axhline(reference["val_loss"], color="black", lw=0.8, label="torchft (1.0×)")
            ax.axhspan(
                reference["val_loss"] * (1 - BOUND / 100),
                reference["val_loss"] * (1 + BOUND / 100),
                color="grey",
                alpha=0.2,
                label=f"±{BOUND:g} %",
            )
        ax.set_xscale("log")
        ax.xaxis.set_minor_formatter(plt.NullFormatter())  # the decades alone: minor labels overlap
        ax.set_title(key, fontsize=8)
        ax.set_xlabel("payload per outer step vs torchft", fontsize=7)
        ax.tick_params(which="both", labelsize=6)
    axes[0][0].set_ylabel("validation loss (mean of seeds)", fontsize=7)
    axes[0][0].legend(fontsize=6)
    return save(fig, out / "frontier.png")
