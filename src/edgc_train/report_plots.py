"""The plots of `edgc report`, one function each: ``plot_<name>(plt, runs, out, colors) -> Path`` draws
``out/<name>.png``; `PLOTTERS` lists them in the report's order and `plot_all` runs them (a new plot
is one more function and one more entry); report_style.py gives them one look."""

from __future__ import annotations

import math
import statistics
from pathlib import Path

from .report_rank_plots import plot_rank, plot_stages
from .report_runs import Run, estimator_name, fmt_ms
from .report_style import (
    empty_panel,
    finish_figure,
    mark_warmup,
    new_figure,
    plain_log,
    rolling,
    run_colors,
    smooth_window,
    wall_at_step,
)


def _plot_loss(plt, runs: list[Run], out: Path, colors: dict, name: str, xkey: str, xlabel: str) -> Path:
    n = max(len(r.train) for r in runs)
    k = smooth_window(n)
    fig, ax = new_figure(
        plt,
        "Training loss" + (" vs wall-clock time" if xkey == "wall_s" else " vs step"),
        f"cross-entropy on the training batches, mean over ranks; faint = every step, "
        f"bold = mean over {k} neighbouring steps"
        if k > 1
        else "cross-entropy on the training batches, mean over ranks",
    )
    for run in runs:
        xs = [r[xkey] for r in run.train]
        ys = [r["loss"] for r in run.train]
        c = colors[run.label]
        if k > 1:
            ax.plot(xs, ys, color=c, alpha=0.22, lw=0.8)
        ax.plot(xs, rolling(ys, k), color=c, lw=2, label=run.label)
    mark_warmup(ax, runs, colors, None if xkey == "step" else wall_at_step)
    ax.set_xlabel(xlabel)
    ax.set_ylabel("training loss (nats per token)")
    ax.set_xlim(left=0)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8.5)
    finish_figure(fig, out / name)
    return out / name


def plot_loss_vs_step(plt, runs: list[Run], out: Path, colors: dict) -> Path:
    """Training loss per optimizer step (faint) and its rolling mean (bold)."""
    return _plot_loss(plt, runs, out, colors, "loss_vs_step.png", "step", "optimizer step")


def plot_loss_vs_time(plt, runs: list[Run], out: Path, colors: dict) -> Path:
    """The same against wall-clock seconds since the first step."""
    return _plot_loss(plt, runs, out, colors, "loss_vs_time.png", "wall_s", "wall-clock time since the first step (s)")


def plot_val_ppl(plt, runs: list[Run], out: Path, colors: dict) -> Path:
    """Validation perplexity at every evaluation (log scale)."""
    fig, ax = new_figure(
        plt,
        "Validation perplexity",
        "exp(mean next-token loss) on the same held-out blocks at every evaluation; lower is better",
    )
    any_eval = False
    for run in runs:
        if not run.evals:
            continue
        any_eval = True
        xs = [r["step"] for r in run.evals]
        ys = [r["val_ppl"] for r in run.evals]
        ax.plot(
            xs,
            ys,
            marker="o",
            ms=4,
            lw=1.8,
            color=colors[run.label],
            label=f"{run.label}: final {ys[-1]:.1f} (loss {run.evals[-1]['val_loss']:.3f}) at step {xs[-1]}",
        )
    if any_eval:
        plain_log(ax)
        mark_warmup(ax, runs, colors)
        ax.legend(fontsize=8.5)
    else:
        empty_panel(ax, "no evaluations in these runs")
    ax.set_xlabel("optimizer step")
    ax.set_ylabel("validation perplexity (log scale)")
    ax.set_xlim(left=0)
    ax.grid(alpha=0.3, which="both")
    finish_figure(fig, out / "val_ppl.png")
    return out / "val_ppl.png"


def plot_entropy(plt, runs: list[Run], out: Path, colors: dict) -> Path:
    """The gradient-entropy samples EDGC took, and their per-window means."""
    with_entropy = [r for r in runs if any(x.get("entropy") is not None for x in r.train)]
    estimators = {estimator_name(r.edgc) for r in with_entropy}
    sub = (
        "entropy of a strided sample of the rank-0 gradient, on sampled steps; "
        "bold steps = mean per rank-decision window"
    )
    fig, ax = new_figure(plt, "Gradient entropy seen by EDGC", sub)
    for run in with_entropy:
        pts = [(r["step"], r["entropy"]) for r in run.train if r.get("entropy") is not None]
        c = colors[run.label]
        ax.plot(*zip(*pts), ls="", marker=".", ms=5, alpha=0.55, color=c, label=f"{run.label}: samples")
        window = run.edgc.get("window")
        if window:
            groups: dict[int, list[float]] = {}
            for step, value in pts:
                groups.setdefault((step - 1) // window, []).append(value)
            xs, ys = [], []
            for w, values in sorted(groups.items()):
                mean = sum(values) / len(values)
                xs += [w * window + 0.5, (w + 1) * window + 0.5]
                ys += [mean, mean]
                xs.append(math.nan)
                ys.append(math.nan)
            ax.plot(xs, ys, lw=2.2, color=c, label=f"{run.label}: window mean (window = {window} steps)")
            if len(with_entropy) == 1:  # the rank in force in each window, above its mean
                in_force = {(r["step"] - 1) // window: r.get("rank") for r in run.train}  # at the window's end
                for w, values in sorted(groups.items()):
                    rank = in_force.get(w)
                    ax.annotate(
                        "uncompr." if rank is None else f"r={rank}",
                        ((w + 0.5) * window + 0.5, sum(values) / len(values)),
                        textcoords="offset points",
                        xytext=(0, 5),
                        ha="center",
                        fontsize=7.5,
                        color="#333333",
                    )
    if with_entropy:
        mark_warmup(ax, runs, colors)
        ax.legend(fontsize=8.5)
        # A few outlying samples (loss spikes) must not flatten the trend: clip the view to 1–99 %.
        values = sorted(r["entropy"] for run in with_entropy for r in run.train if r.get("entropy") is not None)
        if len(values) >= 20:
            lo, hi = values[len(values) // 100], values[-1 - len(values) // 100]
            pad = 0.15 * (hi - lo or 1.0)
            ax.set_ylim(lo - pad, hi + pad)
    else:
        empty_panel(ax, "no entropy samples: only EDGC runs sample the gradient entropy")
    unit = {"gaussian": "Gaussian estimate ½·ln(2πeσ²), nats", "histogram": "1000-bin histogram Shannon entropy, nats"}
    ax.set_ylabel("gradient entropy\n(" + ("; ".join(unit.get(e, e) for e in sorted(estimators)) or "nats") + ")")
    ax.set_xlabel("optimizer step")
    ax.set_xlim(left=0)
    ax.grid(alpha=0.3)
    finish_figure(fig, out / "entropy.png")
    return out / "entropy.png"


def plot_comm_time(plt, runs: list[Run], out: Path, colors: dict) -> Path:
    """Time in the gradient collectives per step, and where a median step goes."""
    world = {r.config.get("world_size") for r in runs}
    procs = f"{world.pop()} processes" if len(world) == 1 else "processes differ per run"
    fig, (ax, bx) = plt.subplots(1, 2, figsize=(12, 5.2), gridspec_kw={"width_ratios": [2.2, 1]})
    n = max(len(r.train) for r in runs)
    k = max(3, smooth_window(n))
    fig.suptitle("Time in gradient communication", fontsize=13, fontweight="bold")
    fig.text(
        0.5,
        0.915,
        f"time rank 0's step waited on the data-parallel gradient collectives, {procs} "
        "(what overlap with backward did not hide), including any wait for a slower rank\n"
        f"faint = every step, bold = median over {k} neighbouring steps; native DDP/HSDP: "
        "not separable (overlapped inside DDP/FSDP), not drawn",
        ha="center",
        va="top",
        fontsize=9,
        color="#444444",
    )
    measured = [run for run in runs if run.comm_measured]
    for run in measured:
        xs = [r["step"] for r in run.train]
        ys = [run.comm_wait(r) * 1000 for r in run.train]
        c = colors[run.label]
        ax.plot(xs, ys, color=c, alpha=0.25, lw=0.8)
        ax.plot(
            xs,
            rolling(ys, k, statistics.median),
            color=c,
            lw=2,
            label=f"{run.label}: median {fmt_ms(run.stats['median_comm_s'])} ms",
        )
    mark_warmup(ax, runs, colors)
    # Linear scale; a few stalls (another process took the core) must not squash the rest.
    raw = sorted(run.comm_wait(r) * 1000 for run in measured for r in run.train) or [1.0]
    ax.set_ylim(0, raw[min(len(raw) - 1, int(0.98 * len(raw)))] * 1.15 or 1)
    ax.set_xlabel("optimizer step")
    ax.set_ylabel("wait on communication per step (ms)")
    ax.set_xlim(left=0)
    ax.grid(alpha=0.3, which="both")
    if measured:
        ax.legend(fontsize=8)
    else:
        ax.text(
            0.5,
            0.5,
            "native DDP/HSDP only: no separate communication time",
            ha="center",
            transform=ax.transAxes,
            color="#666666",
        )
    # right: median step broken into compute / compression / communication
    labels = [r.label for r in runs]
    parts = [
        ("compute (fwd, bwd, optimizer)", "median_compute_s", "#9ecae1"),
        ("compression (P/Q, entropy)", "median_compress_s", "#fdae6b"),
        ("communication", "median_comm_s", "#e6550d"),
    ]
    left = [0.0] * len(runs)
    for name, key, color in parts:
        widths = [(r.stats[key] or 0.0) * 1000 for r in runs]
        bx.barh(range(len(runs)), widths, left=left, color=color, label=name, height=0.55)
        left = [a + b for a, b in zip(left, widths)]
    for i, run in enumerate(runs):
        bx.text(left[i], i, f" {fmt_ms(run.stats['median_step_s'])} ms", va="center", fontsize=8)
    bx.set_yticks(range(len(runs)), labels, fontsize=8)
    bx.invert_yaxis()
    bx.set_xlim(0, max(left) * 1.3 if max(left) > 0 else 1)
    bx.set_xlabel("ms per step (medians of each part)")
    bx.set_title(f"median step, from step {runs[0].stats['median_from_step']}", fontsize=10)
    bx.legend(fontsize=7.5, loc="upper center", bbox_to_anchor=(0.5, -0.18), ncol=1, frameon=False)
    bx.grid(alpha=0.3, axis="x")
    fig.tight_layout(rect=(0, 0, 1, 0.92))
    fig.savefig(out / "comm_time.png", dpi=110)
    plt.close(fig)
    return out / "comm_time.png"


PLOTTERS = (plot_loss_vs_step, plot_loss_vs_time, plot_val_ppl, plot_entropy, plot_rank, plot_comm_time)
PLOTS = tuple(f"{f.__name__.removeprefix('plot_')}.png" for f in PLOTTERS)  # every report has these files


def plot_all(runs: list[Run], out: Path) -> list[Path]:
    """Every plot in `PLOTTERS`, and ``stages.png`` when a run is pipelined."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    colors = run_colors(runs)
    written = [plot(plt, runs, out, colors) for plot in PLOTTERS]
    pipelined = [run for run in runs if run.train and "stages" in run.train[0]]
    if pipelined:
        written.append(plot_stages(plt, pipelined, out))
    return written
