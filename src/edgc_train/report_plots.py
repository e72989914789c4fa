"""The plots of `edgc report`, one function each: ``plot_<name>(plt, runs, out, colors) -> Path`` draws
``out/<name>.png``; `PLOTTERS` lists them in the report's order and `plot_all` runs them (a new plot
is one more function and one more entry). Helpers for a consistent look come first."""

from __future__ import annotations

import math
import statistics
from pathlib import Path

from .report_runs import Run, estimator_name, fmt_ms, steady


# ------------------------------------------------------------------------------------------ plots
def _smooth_window(n: int) -> int:
    return max(1, min(50, n // 20))


def _rolling(values: list[float], k: int, fn=None) -> list[float]:
    """Centred rolling mean (or ``fn``) over ``k`` values (no lag); shorter windows at both ends."""
    out, half = [], k // 2
    for i in range(len(values)):
        chunk = values[max(0, i - half) : i - half + k]
        out.append(fn(chunk) if fn else sum(chunk) / len(chunk))
    return out


def _colors(runs: list[Run]) -> dict[str, str]:
    palette = ["#4d4d4d", "#d62728", "#1f77b4", "#2ca02c", "#9467bd", "#ff7f0e", "#8c564b", "#e377c2", "#17becf"]
    colors, i = {}, 1
    for run in runs:  # the uncompressed baseline is grey, compressed runs get colours
        if run.compressor == "none" and palette[0] not in colors.values():
            colors[run.label] = palette[0]
        else:
            colors[run.label] = palette[i % len(palette)]
            i += 1
    return colors


def _mark_warmup(ax, runs: list[Run], colors: dict[str, str], x_of=None) -> None:
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


def _wall_at_step(run: Run, step: int) -> float:
    for r in run.train:
        if r["step"] >= step:
            return r["wall_s"] - r["step_time_s"]  # when that step began
    return run.train[-1]["wall_s"]


def _new_figure(
    plt, title: str, subtitle: str | None = None, ncols: int = 1, width: float = 9.5, height: float = 5.2, **kw
):
    fig, axes = plt.subplots(1, ncols, figsize=(width, height), **kw)
    fig.suptitle(title, fontsize=13, fontweight="bold")
    if subtitle:
        fig.text(0.5, 0.915, subtitle, ha="center", va="top", fontsize=9, color="#444444")
    return fig, axes


def _finish(fig, path: Path, top: float = 0.92) -> None:
    fig.tight_layout(rect=(0, 0, 1, top))
    fig.savefig(path, dpi=110)
    import matplotlib.pyplot as plt

    plt.close(fig)


def _plain_log(ax) -> None:
    """Log-scale y axis labelled 1, 2, 5, 10, 20, 50 … instead of powers of ten."""
    from matplotlib.ticker import FuncFormatter

    ax.set_yscale("log")
    ax.yaxis.set_major_formatter(FuncFormatter(lambda v, _: f"{v:g}"))
    lo, hi = ax.get_ylim()
    digits = "23456789" if lo > 0 and hi / lo < 12 else "25"  # less than a decade shown: label every minor tick
    ax.yaxis.set_minor_formatter(FuncFormatter(lambda v, _: f"{v:g}" if f"{v:.0e}"[0] in digits else ""))


def _empty(ax, message: str) -> None:
    ax.text(
        0.5, 0.5, message, ha="center", va="center", transform=ax.transAxes, fontsize=11, color="#555555", wrap=True
    )


def _plot_loss(plt, runs: list[Run], out: Path, colors: dict, name: str, xkey: str, xlabel: str) -> Path:
    n = max(len(r.train) for r in runs)
    k = _smooth_window(n)
    fig, ax = _new_figure(
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
        ax.plot(xs, _rolling(ys, k), color=c, lw=2, label=run.label)
    _mark_warmup(ax, runs, colors, None if xkey == "step" else _wall_at_step)
    ax.set_xlabel(xlabel)
    ax.set_ylabel("training loss (nats per token)")
    ax.set_xlim(left=0)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8.5)
    _finish(fig, out / name)
    return out / name


def plot_loss_vs_step(plt, runs: list[Run], out: Path, colors: dict) -> Path:
    """Training loss per optimizer step (faint) and its rolling mean (bold)."""
    return _plot_loss(plt, runs, out, colors, "loss_vs_step.png", "step", "optimizer step")


def plot_loss_vs_time(plt, runs: list[Run], out: Path, colors: dict) -> Path:
    """The same against wall-clock seconds since the first step."""
    return _plot_loss(plt, runs, out, colors, "loss_vs_time.png", "wall_s", "wall-clock time since the first step (s)")


def plot_val_ppl(plt, runs: list[Run], out: Path, colors: dict) -> Path:
    """Validation perplexity at every evaluation (log scale)."""
    fig, ax = _new_figure(
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
        _plain_log(ax)
        _mark_warmup(ax, runs, colors)
        ax.legend(fontsize=8.5)
    else:
        _empty(ax, "no evaluations in these runs")
    ax.set_xlabel("optimizer step")
    ax.set_ylabel("validation perplexity (log scale)")
    ax.set_xlim(left=0)
    ax.grid(alpha=0.3, which="both")
    _finish(fig, out / "val_ppl.png")
    return out / "val_ppl.png"


def plot_entropy(plt, runs: list[Run], out: Path, colors: dict) -> Path:
    """The gradient-entropy samples EDGC took, and their per-window means."""
    with_entropy = [r for r in runs if any(x.get("entropy") is not None for x in r.train)]
    estimators = {estimator_name(r.edgc) for r in with_entropy}
    sub = (
        "entropy of a strided sample of the rank-0 gradient, on sampled steps; "
        "bold steps = mean per rank-decision window"
    )
    fig, ax = _new_figure(plt, "Gradient entropy seen by EDGC", sub)
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
        _mark_warmup(ax, runs, colors)
        ax.legend(fontsize=8.5)
        # A few outlying samples (loss spikes) must not flatten the trend: clip the view to 1–99 %.
        values = sorted(r["entropy"] for run in with_entropy for r in run.train if r.get("entropy") is not None)
        if len(values) >= 20:
            lo, hi = values[len(values) // 100], values[-1 - len(values) // 100]
            pad = 0.15 * (hi - lo or 1.0)
            ax.set_ylim(lo - pad, hi + pad)
    else:
        _empty(ax, "no entropy samples: only EDGC runs sample the gradient entropy")
    unit = {"gaussian": "Gaussian estimate ½·ln(2πeσ²), nats", "histogram": "1000-bin histogram Shannon entropy, nats"}
    ax.set_ylabel("gradient entropy\n(" + ("; ".join(unit.get(e, e) for e in sorted(estimators)) or "nats") + ")")
    ax.set_xlabel("optimizer step")
    ax.set_xlim(left=0)
    ax.grid(alpha=0.3)
    _finish(fig, out / "entropy.png")
    return out / "entropy.png"


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
    if compressed_runs:
        _mark_warmup(ax, compressed_runs, colors)
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
        _empty(ax, "no compressed steps in these runs (rank is undefined while uncompressed)")
    ax.set_ylabel("PowerSGD rank")
    ax.grid(alpha=0.3)
    for run in runs:
        xs = [r["step"] for r in run.train]
        ys = [(r.get("bytes_sent") or 0) / 1e6 for r in run.train]
        ax2.step(
            xs,
            ys,
            where="mid",
            lw=1.8,
            color=colors[run.label],
            label=f"{run.label}: mean {run.stats['bytes_per_step'] / 1e6:.2f} MB/step",
        )
    _plain_log(ax2)
    ax2.set_ylabel("MB sent per step (log scale)")
    ax2.set_xlabel("optimizer step")
    ax2.set_xlim(left=0)
    ax2.grid(alpha=0.3, which="both")
    ax2.legend(fontsize=8.5)
    fig.tight_layout(rect=(0, 0, 1, 0.93))
    fig.savefig(out / "rank.png", dpi=110)
    plt.close(fig)
    return out / "rank.png"


def plot_comm_time(plt, runs: list[Run], out: Path, colors: dict) -> Path:
    """Time in the gradient collectives per step, and where a median step goes."""
    world = {r.config.get("world_size") for r in runs}
    procs = f"{world.pop()} processes" if len(world) == 1 else "processes differ per run"
    fig, (ax, bx) = plt.subplots(1, 2, figsize=(12, 5.2), gridspec_kw={"width_ratios": [2.2, 1]})
    n = max(len(r.train) for r in runs)
    k = max(3, _smooth_window(n))
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
            _rolling(ys, k, statistics.median),
            color=c,
            lw=2,
            label=f"{run.label}: median {fmt_ms(run.stats['median_comm_s'])} ms",
        )
    _mark_warmup(ax, runs, colors)
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

    colors = _colors(runs)
    written = [plot(plt, runs, out, colors) for plot in PLOTTERS]
    pipelined = [run for run in runs if run.train and "stages" in run.train[0]]
    if pipelined:
        written.append(plot_stages(plt, pipelined, out))
    return written


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
