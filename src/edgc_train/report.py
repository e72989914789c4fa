"""`edgc report`: plots and a markdown summary comparing finished (or stopped) `edgc train` runs.

Input: run folders as written by ``edgc train`` (``config.json``, ``metrics.jsonl``; ``summary.json``
is not needed, everything is recomputed from the metric lines so stopped runs work too).

Output, in one folder:

======================  ==========================================================================
``loss_vs_step.png``    training loss per optimizer step (faint) and its rolling mean (bold)
``loss_vs_time.png``    the same against wall-clock seconds since the first step
``val_ppl.png``         validation perplexity at every evaluation (log scale)
``entropy.png``         the gradient-entropy samples EDGC took, and their per-window means
``rank.png``            the PowerSGD rank in force at each step, and the bytes sent per step
``comm_time.png``       time in the gradient collectives per step, and where a median step goes
``report.md``           the summary table (with ratios to the uncompressed run), rank schedules,
                        the plots, and each run's setup
======================  ==========================================================================

Steady-state statistics (median step/comm/compress time) skip the first ``SKIP_STEPS`` steps,
which carry one-off costs (allocation, DDP's bucket rebuild after step 1, first-call overheads).
"""
from __future__ import annotations

import json
import math
import statistics
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

SKIP_STEPS = 3  # steps excluded from the medians (one-off start-up costs)
PLOTS = ("loss_vs_step.png", "loss_vs_time.png", "val_ppl.png", "entropy.png", "rank.png", "comm_time.png")


class ReportError(ValueError):
    """A run folder cannot be read; the message is one line naming the folder."""


# ------------------------------------------------------------------------------------------ loading
@dataclass
class Run:
    path: Path
    config: dict
    train: list[dict]
    evals: list[dict]
    label: str = ""
    ignored_lines: int = 0  # a truncated last line (run killed while writing) is skipped
    notices: list[dict] = field(default_factory=list)  # "kind": "notice" lines (e.g. EDGC switched off)
    stats: dict = field(default_factory=dict)

    @property
    def compressor(self) -> str:
        return str(self.config.get("compressor", "?"))

    @property
    def comm_measured(self) -> bool:
        """False for native DDP / HSDP (``none`` without a pipeline): their all-reduce runs inside
        DDP or FSDP, overlapped with backward, with no time of its own to log."""
        return not (self.compressor == "none" and int(self.config.get("pp") or 1) == 1)

    def comm_wait(self, record: dict) -> float:
        """Seconds the step waited on its gradient collectives (what overlap did not hide)."""
        waited = record.get("comm_wait_s")
        return record["comm_time_s"] if waited is None else waited

    @property
    def compressed_steps(self) -> list[dict]:
        return [r for r in self.train if r.get("rank") is not None]

    @property
    def first_compressed_step(self) -> int | None:
        steps = self.compressed_steps
        return steps[0]["step"] if steps else None

    @property
    def edgc(self) -> dict:
        return self.config.get("edgc") or {}


def load_run(path: str | Path) -> Run:
    """Read one run folder; raise ReportError (one line) when it is missing, empty or unreadable."""
    path = Path(path)
    if not path.exists():
        raise ReportError(f"{path}: no such run folder")
    if not path.is_dir():
        raise ReportError(f"{path}: not a folder (give the run folder that `edgc train --out` created)")
    config_path, metrics_path = path / "config.json", path / "metrics.jsonl"
    if not config_path.is_file():
        raise ReportError(f"{path}: not a run folder (no config.json)")
    try:
        config = json.loads(config_path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        raise ReportError(f"{config_path}: unreadable ({exc})") from None
    if not isinstance(config, dict):
        raise ReportError(f"{config_path}: expected a JSON object")
    if not metrics_path.is_file():
        raise ReportError(f"{path}: no metrics.jsonl (the run never logged a step)")
    try:
        text = metrics_path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise ReportError(f"{metrics_path}: unreadable ({exc})") from None
    lines = [(n, line) for n, line in enumerate(text.splitlines(), 1) if line.strip()]
    records, ignored = [], 0
    for i, (n, line) in enumerate(lines):
        try:
            record = json.loads(line)
            if not isinstance(record, dict) or "kind" not in record or "step" not in record:
                raise ValueError("not a metrics record")
        except ValueError as exc:
            if i == len(lines) - 1:  # the writer was killed mid-line: keep what is complete
                ignored += 1
                continue
            raise ReportError(f"{metrics_path}:{n}: bad line ({exc})") from None
        records.append(record)
    train = [r for r in records if r["kind"] == "train"]
    evals = [r for r in records if r["kind"] == "eval"]
    if not train:
        raise ReportError(f"{path}: metrics.jsonl holds no training steps (empty run)")
    missing = sorted({"step", "wall_s", "loss", "step_time_s", "comm_time_s"} - set(train[0]))
    if missing:
        raise ReportError(f"{metrics_path}: train lines lack {', '.join(missing)} (not written by `edgc train`?)")
    # A resumed run may have re-logged steps: keep the last record of each step, in order.
    train = list({r["step"]: r for r in train}.values())
    evals = list({r["step"]: r for r in evals}.values())
    train.sort(key=lambda r: r["step"])
    evals.sort(key=lambda r: r["step"])
    notices = [r for r in records if r["kind"] == "notice"]
    return Run(path=path, config=config, train=train, evals=evals, ignored_lines=ignored, notices=notices)


def load_runs(paths: list[str | Path]) -> list[Run]:
    runs = [load_run(p) for p in paths]
    resolved = [r.path.resolve() for r in runs]
    if len(set(resolved)) != len(resolved):
        raise ReportError("the same run folder is given twice")
    _label(runs)
    for run in runs:
        run.stats = run_stats(run)
    return runs


def _label(runs: list[Run]) -> None:
    """Label = folder name + compressor: "e120 (edgc)", "edgc", "base (none: DDP all-reduce)", "none (DDP all-reduce)"."""
    def make(run: Run, name: str) -> str:
        if run.compressor == "none":
            return f"{name} (DDP all-reduce)" if name == "none" else f"{name} (none: DDP all-reduce)"
        return name if name == run.compressor else f"{name} ({run.compressor})"

    labels = [make(r, r.path.name) for r in runs]
    for i, run in enumerate(runs):
        if labels.count(labels[i]) > 1:
            run.label = make(run, f"{run.path.parent.name}/{run.path.name}")
        else:
            run.label = labels[i]
    seen: dict[str, int] = {}
    for run in runs:  # still equal (same parent names too): number them
        seen[run.label] = seen.get(run.label, 0) + 1
        if seen[run.label] > 1:
            run.label = f"{run.label} #{seen[run.label]}"


# ------------------------------------------------------------------------------------------ numbers
def _median(values: list[float]) -> float | None:
    values = [v for v in values if v is not None and math.isfinite(v)]
    return statistics.median(values) if values else None


def steady(run: Run) -> list[dict]:
    """Train lines used for medians: all but the first SKIP_STEPS (all of them for very short runs)."""
    return run.train[SKIP_STEPS:] if len(run.train) > 2 * SKIP_STEPS else run.train


def rank_schedule(run: Run) -> list[tuple[int, int, int | None]]:
    """(first step, last step, rank) segments; rank None = uncompressed."""
    segments: list[list] = []
    for r in run.train:
        rank = r.get("rank")
        if segments and segments[-1][2] == rank and segments[-1][1] == r["step"] - 1:
            segments[-1][1] = r["step"]
        else:
            segments.append([r["step"], r["step"], rank])
    return [tuple(s) for s in segments]  # type: ignore[misc]


def format_schedule(run: Run, limit: int = 14) -> str:
    parts = []
    for first, last, rank in rank_schedule(run):
        span = f"{first}" if first == last else f"{first}–{last}"
        parts.append(f"{span}: {'uncompressed' if rank is None else f'r={rank}'}")
    if len(parts) > limit:
        parts = parts[: limit // 2] + [f"… ({len(parts) - limit} more) …"] + parts[-limit // 2:]
    return "; ".join(parts)


def _estimator(edgc: dict) -> str:
    """The entropy estimator a run used ('auto' resolves as EDGCConfig does)."""
    name = edgc.get("entropy_estimator", "histogram")
    if name == "auto":
        return "gaussian" if edgc.get("rank_mapping") == "cqm" else "histogram"
    return name


def run_stats(run: Run) -> dict[str, Any]:
    core = steady(run)
    n = len(run.train)
    last_eval = run.evals[-1] if run.evals else None
    bytes_sent = sum(r.get("bytes_sent") or 0 for r in run.train)
    bytes_raw = sum(r.get("bytes_raw") or 0 for r in run.train)
    compressed = run.compressed_steps
    ranks = [r["rank"] for r in compressed]
    return {
        "steps": run.train[-1]["step"],
        "planned_steps": run.config.get("steps"),
        "wall_s": run.train[-1]["wall_s"],
        "final_loss": run.train[-1]["loss"],
        "val_loss": last_eval["val_loss"] if last_eval else None,
        "val_ppl": last_eval["val_ppl"] if last_eval else None,
        "val_step": last_eval["step"] if last_eval else None,
        "median_step_s": _median([r["step_time_s"] for r in core]),
        "median_comm_s": _median([run.comm_wait(r) for r in core]) if run.comm_measured else None,
        "median_compress_s": _median([r.get("compress_time_s") for r in core]),
        "median_compute_s": _median([r.get("compute_time_s") for r in core]),
        "median_tokens_per_s": _median([r.get("tokens_per_s") for r in core]),
        "median_from_step": core[0]["step"] if core else None,
        "bytes_per_step": bytes_sent / n,
        "raw_bytes_per_step": bytes_raw / n,
        "compressed_bytes_per_step": (sum(r.get("bytes_sent") or 0 for r in compressed) / len(compressed)
                                      if compressed else None),
        "compressed_fraction": len(compressed) / n,
        "first_compressed_step": run.first_compressed_step,
        "rank_min": min(ranks) if ranks else None,
        "rank_max": max(ranks) if ranks else None,
        "rank_changes": max(0, sum(1 for s in rank_schedule(run) if s[2] is not None) - 1),
        "entropy_samples": sum(1 for r in run.train if r.get("entropy") is not None),
    }


def baseline(runs: list[Run]) -> Run | None:
    """The uncompressed run the ratios refer to (the first one given with compressor none)."""
    return next((r for r in runs if r.compressor == "none"), None)


def ratio(value: float | None, base: float | None) -> float | None:
    if value is None or base is None or base == 0:
        return None
    return value / base


# ------------------------------------------------------------------------------------------ formatting
def _fmt(value: Any, spec: str = ".3f", none: str = "–") -> str:
    if value is None or (isinstance(value, float) and not math.isfinite(value)):
        return none
    return format(value, spec)


def _fmt_ms(seconds: float | None) -> str:
    return _fmt(None if seconds is None else seconds * 1000, ".1f")


def _fmt_mb(nbytes: float | None) -> str:
    return _fmt(None if nbytes is None else nbytes / 1e6, ".2f")


def _fmt_ratio(value: float | None) -> str:
    return _fmt(value, ".3f") + ("×" if value is not None else "")


def _fmt_duration(seconds: float) -> str:
    return f"{seconds:.0f} s" if seconds < 120 else f"{seconds / 60:.1f} min"


# ------------------------------------------------------------------------------------------ plots
def _smooth_window(n: int) -> int:
    return max(1, min(50, n // 20))


def _rolling(values: list[float], k: int, fn=None) -> list[float]:
    """Centred rolling mean (or ``fn``) over ``k`` values (no lag); shorter windows at both ends."""
    out, half = [], k // 2
    for i in range(len(values)):
        chunk = values[max(0, i - half): i - half + k]
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
        ax.axvline(x, color=colors[run.label], ls=":", lw=1.2,
                   label=f"{run.label}: uncompressed warm-up (shaded), compresses from step {start}")


def _wall_at_step(run: Run, step: int) -> float:
    for r in run.train:
        if r["step"] >= step:
            return r["wall_s"] - r["step_time_s"]  # when that step began
    return run.train[-1]["wall_s"]


def _new_figure(plt, title: str, subtitle: str | None = None, ncols: int = 1, width: float = 9.5,
                height: float = 5.2, **kw):
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
    ax.text(0.5, 0.5, message, ha="center", va="center", transform=ax.transAxes, fontsize=11, color="#555555",
            wrap=True)


def plot_all(runs: list[Run], out: Path) -> list[Path]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import MaxNLocator

    colors = _colors(runs)
    world = {r.config.get("world_size") for r in runs}
    procs = f"{world.pop()} processes" if len(world) == 1 else "processes differ per run"
    written = []

    # ---- loss vs step / vs time
    for name, xkey, xlabel in (("loss_vs_step.png", "step", "optimizer step"),
                               ("loss_vs_time.png", "wall_s", "wall-clock time since the first step (s)")):
        n = max(len(r.train) for r in runs)
        k = _smooth_window(n)
        fig, ax = _new_figure(plt, "Training loss" + (" vs wall-clock time" if xkey == "wall_s" else " vs step"),
                              f"cross-entropy on the training batches, mean over ranks; faint = every step, "
                              f"bold = mean over {k} neighbouring steps" if k > 1 else
                              "cross-entropy on the training batches, mean over ranks")
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
        written.append(out / name)

    # ---- validation perplexity
    fig, ax = _new_figure(plt, "Validation perplexity",
                          "exp(mean next-token loss) on the same held-out blocks at every evaluation; lower is better")
    any_eval = False
    for run in runs:
        if not run.evals:
            continue
        any_eval = True
        xs = [r["step"] for r in run.evals]
        ys = [r["val_ppl"] for r in run.evals]
        ax.plot(xs, ys, marker="o", ms=4, lw=1.8, color=colors[run.label],
                label=f"{run.label}: final {ys[-1]:.1f} (loss {run.evals[-1]['val_loss']:.3f}) at step {xs[-1]}")
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
    written.append(out / "val_ppl.png")

    # ---- entropy
    with_entropy = [r for r in runs if any(x.get("entropy") is not None for x in r.train)]
    estimators = {_estimator(r.edgc) for r in with_entropy}
    sub = ("entropy of a strided sample of the rank-0 gradient, on sampled steps; "
           "bold steps = mean per rank-decision window")
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
                    ax.annotate("uncompr." if rank is None else f"r={rank}", ((w + 0.5) * window + 0.5,
                                sum(values) / len(values)), textcoords="offset points", xytext=(0, 5),
                                ha="center", fontsize=7.5, color="#333333")
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
    unit = {"gaussian": "Gaussian estimate ½·ln(2πeσ²), nats",
            "histogram": "1000-bin histogram Shannon entropy, nats"}
    ax.set_ylabel("gradient entropy\n(" + ("; ".join(unit.get(e, e) for e in sorted(estimators)) or "nats") + ")")
    ax.set_xlabel("optimizer step")
    ax.set_xlim(left=0)
    ax.grid(alpha=0.3)
    _finish(fig, out / "entropy.png")
    written.append(out / "entropy.png")

    # ---- rank per window + bytes per step
    fig, (ax, ax2) = plt.subplots(2, 1, figsize=(9.5, 7.2), sharex=True, gridspec_kw={"height_ratios": [3, 2]})
    fig.suptitle("Compression rank and gradient traffic per step", fontsize=13, fontweight="bold")
    fig.text(0.5, 0.94, "top: PowerSGD rank in force at each step (EDGC re-decides it at the end of every window)\n"
             "bottom: gradient bytes each rank hands to the all-reduces per step (uncompressed = every gradient raw)",
             ha="center", va="top", fontsize=9, color="#444444")
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
        for bound, name in (("r_max", "r_max"), ("r_min", "r_min")):
            value = run.edgc.get(bound)
            if value is not None:
                ax.axhline(value, color=c, ls="--", lw=0.9, alpha=0.6)
                ax.annotate(f"{name} = {value}", (0.005, value), xycoords=("axes fraction", "data"),
                            textcoords="offset points", xytext=(2, 3), fontsize=8, color=c)
    if compressed_runs:
        _mark_warmup(ax, compressed_runs, colors)
        top = max(max(r["rank"] for r in run.compressed_steps) for run in compressed_runs)
        top = max([top] + [run.edgc.get("r_max") or 0 for run in compressed_runs])
        ax.set_ylim(0, top * 1.15 + 1)
        ax.yaxis.set_major_locator(MaxNLocator(integer=True))
        if len(compressed_runs) == 1 and compressed_runs[0].edgc.get("window"):
            ax.plot([], [], color=colors[compressed_runs[0].label], lw=0.5, alpha=0.4,
                    label=f"window boundary (every {compressed_runs[0].edgc['window']} steps)")
        ax.legend(fontsize=8.5, loc="lower right")
    else:
        _empty(ax, "no compressed steps in these runs (rank is undefined while uncompressed)")
    ax.set_ylabel("PowerSGD rank")
    ax.grid(alpha=0.3)
    for run in runs:
        xs = [r["step"] for r in run.train]
        ys = [(r.get("bytes_sent") or 0) / 1e6 for r in run.train]
        ax2.step(xs, ys, where="mid", lw=1.8, color=colors[run.label],
                 label=f"{run.label}: mean {run.stats['bytes_per_step'] / 1e6:.2f} MB/step")
    _plain_log(ax2)
    ax2.set_ylabel("MB sent per step (log scale)")
    ax2.set_xlabel("optimizer step")
    ax2.set_xlim(left=0)
    ax2.grid(alpha=0.3, which="both")
    ax2.legend(fontsize=8.5)
    fig.tight_layout(rect=(0, 0, 1, 0.93))
    fig.savefig(out / "rank.png", dpi=110)
    plt.close(fig)
    written.append(out / "rank.png")

    # ---- communication time per step + where a step goes
    fig, (ax, bx) = plt.subplots(1, 2, figsize=(12, 5.2), gridspec_kw={"width_ratios": [2.2, 1]})
    n = max(len(r.train) for r in runs)
    k = max(3, _smooth_window(n))
    fig.suptitle("Time in gradient communication", fontsize=13, fontweight="bold")
    fig.text(0.5, 0.915, f"time rank 0's step waited on the data-parallel gradient collectives, {procs} "
             "(what overlap with backward did not hide), including any wait for a slower rank\n"
             f"faint = every step, bold = median over {k} neighbouring steps; native DDP/HSDP: "
             "not separable (overlapped inside DDP/FSDP), not drawn", ha="center", va="top", fontsize=9,
             color="#444444")
    measured = [run for run in runs if run.comm_measured]
    for run in measured:
        xs = [r["step"] for r in run.train]
        ys = [run.comm_wait(r) * 1000 for r in run.train]
        c = colors[run.label]
        ax.plot(xs, ys, color=c, alpha=0.25, lw=0.8)
        ax.plot(xs, _rolling(ys, k, statistics.median), color=c, lw=2,
                label=f"{run.label}: median {_fmt_ms(run.stats['median_comm_s'])} ms")
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
        ax.text(0.5, 0.5, "native DDP/HSDP only: no separate communication time", ha="center",
                transform=ax.transAxes, color="#666666")
    # right: median step broken into compute / compression / communication
    labels = [r.label for r in runs]
    parts = [("compute (fwd, bwd, optimizer)", "median_compute_s", "#9ecae1"),
             ("compression (P/Q, entropy)", "median_compress_s", "#fdae6b"),
             ("communication", "median_comm_s", "#e6550d")]
    left = [0.0] * len(runs)
    for name, key, color in parts:
        widths = [(r.stats[key] or 0.0) * 1000 for r in runs]
        bx.barh(range(len(runs)), widths, left=left, color=color, label=name, height=0.55)
        left = [a + b for a, b in zip(left, widths)]
    for i, run in enumerate(runs):
        bx.text(left[i], i, f" {_fmt_ms(run.stats['median_step_s'])} ms", va="center", fontsize=8)
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
    written.append(out / "comm_time.png")
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
            top.step(xs, [ceiling * 1.25 if v is None else v for v in ranks], where="post", lw=2,
                     label=f"stage {stage}")
            bottom.plot(xs, [r["stages"][stage]["sync_finish_s"] * 1000 for r in run.train], lw=1.2,
                        label=f"stage {stage}")
        top.axhline(ceiling * 1.25, color="#999999", ls=":", lw=1)
        top.text(run.train[0]["step"], ceiling * 1.27, "uncompressed", fontsize=8, color="#666666", va="bottom")
        top.set_ylim(0, ceiling * 1.45)
        top.set_ylabel("PowerSGD rank")
        top.set_title(run.label, fontsize=10)
        top.grid(alpha=0.3)
        top.legend(fontsize=8, loc="lower right")
        spreads = [sync_finish_spread(r) * 1000 for r in steady(run)]
        bottom.set_title("gradient sync finished, ms after the earliest stage's backward ended"
                         + (f"\nmedian spread between stages: {statistics.median(spreads):.1f} ms" if spreads else ""),
                         fontsize=9)
        bottom.set_xlabel("optimizer step")
        bottom.set_ylabel("sync finished (ms)")
        bottom.grid(alpha=0.3)
        bottom.legend(fontsize=8)
    fig.tight_layout(rect=(0, 0, 1, 0.95))
    fig.savefig(out / "stages.png", dpi=110)
    plt.close(fig)
    return out / "stages.png"


# ------------------------------------------------------------------------------------------ markdown
def summary_table(runs: list[Run]) -> str:
    base = baseline(runs)
    head = ["run", "steps", "train time", "final val loss", "val PPL", "median step (ms)", "median comm wait (ms)",
            "median compress (ms)", "MB sent/step", "ranks used"]
    if base is not None:
        head += ["bytes/step vs uncompressed", "comm vs uncompressed", "step time vs uncompressed",
                 "train time vs uncompressed", "Δ val loss vs uncompressed"]
    rows = []
    for run in runs:
        s = run.stats
        ranks = "–" if s["rank_min"] is None else (
            f"{s['rank_min']}" if s["rank_min"] == s["rank_max"] else f"{s['rank_min']}–{s['rank_max']}")
        row = [run.label, f"{s['steps']}", _fmt_duration(s["wall_s"]), _fmt(s["val_loss"], ".4f"),
               _fmt(s["val_ppl"], ".1f"), _fmt_ms(s["median_step_s"]), _fmt_ms(s["median_comm_s"]),
               _fmt_ms(s["median_compress_s"]), _fmt_mb(s["bytes_per_step"]), ranks]
        if base is not None:
            b = base.stats
            dv = None if s["val_loss"] is None or b["val_loss"] is None else s["val_loss"] - b["val_loss"]
            row += [_fmt_ratio(ratio(s["bytes_per_step"], b["bytes_per_step"])),
                    _fmt_ratio(ratio(s["median_comm_s"], b["median_comm_s"])),
                    _fmt_ratio(ratio(s["median_step_s"], b["median_step_s"])),
                    _fmt_ratio(ratio(s["wall_s"], b["wall_s"])),
                    _fmt(dv, "+.4f")]
        rows.append(row)
    lines = ["| " + " | ".join(head) + " |", "|" + "|".join("---" if i == 0 else "---:" for i in range(len(head))) + "|"]
    lines += ["| " + " | ".join(row) + " |" for row in rows]
    return "\n".join(lines)


def _setup_line(run: Run) -> str:
    c = run.config
    parts = [f"preset `{c.get('preset')}`"]
    if c.get("n_params"):
        parts.append(f"{c['n_params'] / 1e6:.2f}M parameters")
    parts.append(f"{c.get('world_size', '?')} processes")
    if c.get("micro_batch") and c.get("seq_len"):
        parts.append(f"{c['micro_batch']}×{c['seq_len']} tokens per rank per micro-batch"
                     + (f", {c['grad_accum']} micro-batches per step" if c.get("grad_accum", 1) > 1 else ""))
    parts.append(f"{c.get('steps', '?')} steps planned")
    if c.get("device_type"):
        parts.append(f"device {c['device_type']}")
    text = f"- **{run.label}** (`{run.path}`): " + ", ".join(parts) + f"; compressor `{run.compressor}`"
    e = run.edgc
    if e:
        keys = ("r_max", "r_min", "adaptive", "window", "rank_mapping", "entropy_estimator", "iteration_sample_ratio",
                "warmup_fraction", "warmup_error_test", "rank_step")
        text += " with " + ", ".join(f"{k}={e[k]}" for k in keys if k in e)
    if run.stats["steps"] != run.stats["planned_steps"]:
        text += f". **Stopped at step {run.stats['steps']}**"
    if run.ignored_lines:
        text += f" (its truncated last metrics line was ignored)"
    return text + "."


def write_markdown(runs: list[Run], out: Path, plots: list[Path]) -> Path:
    base = baseline(runs)
    first = runs[0].stats["median_from_step"]
    lines = [
        "# EDGC training report",
        "",
        f"Generated by `edgc report` on {datetime.now(timezone.utc).strftime('%Y-%m-%d %H:%M UTC')} from "
        f"{len(runs)} run{'s' if len(runs) != 1 else ''}: " + ", ".join(f"`{r.path}`" for r in runs) + ".",
        "",
        "## Summary",
        "",
        summary_table(runs),
        "",
        "How to read it:",
        "",
        "- **train time**: wall-clock seconds from the first to the last optimizer step (start-up, data "
        "preparation and the final checkpoint are not included; evaluations are).",
        "- **final val loss / val PPL**: the last evaluation (mean next-token cross-entropy on the held-out "
        "blocks, nats; PPL = e^loss).",
        f"- **median step / comm / compress**: medians over steps {first}–end; the first {SKIP_STEPS} steps carry "
        "one-off costs (allocation, DDP's bucket rebuild) and are left out. *comm* is rank 0's time inside the "
        "gradient collectives (including waiting there for a slower rank), *compress* the P/Q products, "
        "orthogonalisation and entropy sampling.",
        "- **MB sent/step**: gradient payload each rank hands to the all-reduces per optimizer step (elements × "
        "bytes per element), averaged over the whole run including the uncompressed warm-up; a ring all-reduce "
        "moves about 2(N−1)/N times this over each link.",
    ]
    if base is not None:
        lines += [f"- **… vs uncompressed**: this run's value divided by the uncompressed run **{base.label}**'s "
                  "(below 1× = less); Δ val loss is the difference (negative = better than uncompressed)."]
    else:
        lines += ["- No uncompressed run (compressor `none`) was given, so there are no ratio columns."]
    compressed = [r for r in runs if r.compressed_steps]
    if compressed or any(r.notices for r in runs):
        lines += ["", "## Rank schedules", ""]
        for run in compressed:
            s = run.stats
            full = f"{s['compressed_bytes_per_step'] / 1e6:.2f} MB/step while compressing"
            if base is not None:
                full += f" ({ratio(s['compressed_bytes_per_step'], base.stats['bytes_per_step']):.3f}× uncompressed)"
            lines.append(f"- **{run.label}**: compressed {s['compressed_fraction']:.0%} of the steps (from step "
                         f"{s['first_compressed_step']}), {s['rank_changes']} rank change(s), {full}. "
                         f"Steps → rank: {format_schedule(run)}.")
    for run in runs:
        for notice in run.notices:
            lines.append(f"- **{run.label}**, step {notice['step']}: {notice.get('message', notice.get('event'))}")
    uncompressed = [r for r in runs if not r.compressed_steps and r.compressor != "none" and not r.notices]
    for run in uncompressed:
        lines.append(f"- **{run.label}** never compressed (its warm-up lasted the whole run).")
    captions = {
        "loss_vs_step.png": "Training loss per step. Curves that lie on top of each other mean compression "
                            "did not slow learning per step.",
        "loss_vs_time.png": "The same against wall-clock time: what a faster (or slower) step buys.",
        "val_ppl.png": "Validation perplexity at each evaluation (log scale); the legend gives the final values.",
        "entropy.png": "Gradient entropy samples (dots) and their per-window means (bars), labelled with the rank "
                       "in force in that window. EDGC turns the change in this mean between the last two windows "
                       "into the next window's rank.",
        "rank.png": "Top: the rank EDGC chose for each window, between r_min and r_max (dashed). Bottom: bytes "
                    "sent per step, which follow the rank.",
        "stages.png": "Pipeline runs: top, the rank each stage used (stage 0 from the entropy; later stages from "
                      "the DAC alignment, drawn at the top when uncompressed); bottom, when each stage finished "
                      "its gradient sync. DAC aims to make the stages finish together (a small spread).",
        "comm_time.png": "Left: time in the gradient collectives per step. Right: where a median step's time "
                         "goes. When all processes share one host, moving the bytes over loopback is nearly free "
                         "and this time is mostly one process waiting for the other (they share the cores), so "
                         "compression cannot show a time saving here; the MB sent/step column is what it saves "
                         "on a real network.",
    }
    lines += ["", "## Plots", ""]
    for plot in plots:
        lines += [f"### {plot.stem.replace('_', ' ')}", "", captions.get(plot.name, ""), "",
                  f"![{plot.stem}]({plot.name})", ""]
    lines += ["## Runs", ""] + [_setup_line(r) for r in runs] + [""]
    path = out / "report.md"
    path.write_text("\n".join(lines), encoding="utf-8")
    return path


# ------------------------------------------------------------------------------------------ entry point
def default_out(paths: list[str | Path]) -> Path:
    return Path(paths[0]).parent / "report"


def build_report(paths: list[str | Path], out: str | Path | None = None) -> dict[str, Any]:
    """Load ``paths``, write the plots and ``report.md`` into ``out``; return what was written and the numbers."""
    if not paths:
        raise ReportError("give at least one run folder")
    runs = load_runs(paths)
    out = Path(out) if out is not None else default_out(paths)
    if out.exists() and not out.is_dir():
        raise ReportError(f"--out: {out} exists and is not a folder")
    out.mkdir(parents=True, exist_ok=True)
    plots = plot_all(runs, out)
    md = write_markdown(runs, out, plots)
    return {"out": out, "markdown": md, "plots": plots, "runs": runs, "baseline": baseline(runs)}
