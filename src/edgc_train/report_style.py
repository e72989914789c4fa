"""The look the report's plots share (report_plots.py): smoothing, one colour per run, the warm-up
marked, a figure's title and file, a plain log axis, a panel with nothing to draw."""

from __future__ import annotations

from pathlib import Path

from .report_runs import Run


def smooth_window(n: int) -> int:
    return max(1, min(50, n // 20))


def rolling(values: list[float], k: int, fn=None) -> list[float]:
    """Centred rolling mean (or ``fn``) over ``k`` values (no lag); shorter windows at both ends."""
    out, half = [], k // 2
    for i in range(len(values)):
        chunk = values[max(0, i - half) : i - half + k]
        out.append(fn(chunk) if fn else sum(chunk) / len(chunk))
    return out


def run_colors(runs: list[Run]) -> dict[str, str]:
    palette = ["#4d4d4d", "#d62728", "#1f77b4", "#2ca02c", "#9467bd", "#ff7f0e", "#8c564b", "#e377c2", "#17becf"]
    colors, i = {}, 1
    for run in runs:  # the uncompressed baseline is grey, compressed runs get colours
        if run.compressor == "none" and palette[0] not in colors.values():
            colors[run.label] = palette[0]
        else:
            colors[run.label] = palette[i % len(palette)]
            i += 1
    return colors


def mark_warmup(ax, runs: list[Run], colors: dict[str, str], x_of=None) -> None:
    """Shade each compressed run's uncompressed warm-up and mark where its compression starts."""
    compressed = [r for r in runs if r.first_compressed_step is not None]
    for run in compressed:
        start = run.first_compressed_step
        # Steps are drawn at integer x; the boundary between step start-1 and start is at start - 0.5.
        x = start - 0.5 if x_of is None else x_of(run, start)
        ax.axvspan(0, x, color=colors[run.label], alpha=0.07 if len(compressed) > 1 else 0.10, lw=0)
        ax.axvline(
            x,
            color=colors[run.label],
            ls=":",
            lw=1.2,
            label=f"{run.label}: uncompressed warm-up (shaded), compresses from step {start}",
        )


def wall_at_step(run: Run, step: int) -> float:
    for r in run.train:
        if r["step"] >= step:
            return r["wall_s"] - r["step_time_s"]  # when that step began
    return run.train[-1]["wall_s"]


def new_figure(
    plt, title: str, subtitle: str | None = None, ncols: int = 1, width: float = 9.5, height: float = 5.2, **kw
):
    fig, axes = plt.subplots(1, ncols, figsize=(width, height), **kw)
    fig.suptitle(title, fontsize=13, fontweight="bold")
    if subtitle:
        fig.text(0.5, 0.915, subtitle, ha="center", va="top", fontsize=9, color="#444444")
    return fig, axes


def finish_figure(fig, path: Path, top: float = 0.92) -> None:
    fig.tight_layout(rect=(0, 0, 1, top))
    fig.savefig(path, dpi=110)
    import matplotlib.pyplot as plt

    plt.close(fig)


def plain_log(ax) -> None:
    """Log-scale y axis labelled 1, 2, 5, 10, 20, 50 … instead of powers of ten."""
    from matplotlib.ticker import FuncFormatter

    ax.set_yscale("log")
    ax.yaxis.set_major_formatter(FuncFormatter(lambda v, _: f"{v:g}"))
    lo, hi = ax.get_ylim()
    digits = "23456789" if lo > 0 and hi / lo < 12 else "25"  # less than a decade shown: label every minor tick
    ax.yaxis.set_minor_formatter(FuncFormatter(lambda v, _: f"{v:g}" if f"{v:.0e}"[0] in digits else ""))


def empty_panel(ax, message: str) -> None:
    ax.text(
        0.5, 0.5, message, ha="center", va="center", transform=ax.transAxes, fontsize=11, color="#555555", wrap=True
    )
