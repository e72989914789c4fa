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

from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from .report_plots import plot_all
from .report_runs import (
    SKIP_STEPS,
    ReportError,
    Run,
    baseline,
    fmt,
    fmt_duration,
    fmt_mb,
    fmt_ms,
    fmt_ratio,
    format_schedule,
    load_runs,
    ratio,
)


# ------------------------------------------------------------------------------------------ markdown
def summary_table(runs: list[Run]) -> str:
    base = baseline(runs)
    head = [
        "run",
        "steps",
        "train time",
        "final val loss",
        "val PPL",
        "median step (ms)",
        "median comm wait (ms)",
        "median compress (ms)",
        "MB sent/step",
        "ranks used",
    ]
    if base is not None:
        head += [
            "bytes/step vs uncompressed",
            "comm vs uncompressed",
            "step time vs uncompressed",
            "train time vs uncompressed",
            "Δ val loss vs uncompressed",
        ]
    rows = []
    for run in runs:
        s = run.stats
        ranks = (
            "–"
            if s["rank_min"] is None
            else (f"{s['rank_min']}" if s["rank_min"] == s["rank_max"] else f"{s['rank_min']}–{s['rank_max']}")
        )
        row = [
            run.label,
            f"{s['steps']}",
            fmt_duration(s["wall_s"]),
            fmt(s["val_loss"], ".4f"),
            fmt(s["val_ppl"], ".1f"),
            fmt_ms(s["median_step_s"]),
            fmt_ms(s["median_comm_s"]),
            fmt_ms(s["median_compress_s"]),
            fmt_mb(s["bytes_per_step"]),
            ranks,
        ]
        if base is not None:
            b = base.stats
            dv = None if s["val_loss"] is None or b["val_loss"] is None else s["val_loss"] - b["val_loss"]
            row += [
                fmt_ratio(ratio(s["bytes_per_step"], b["bytes_per_step"])),
                fmt_ratio(ratio(s["median_comm_s"], b["median_comm_s"])),
                fmt_ratio(ratio(s["median_step_s"], b["median_step_s"])),
                fmt_ratio(ratio(s["wall_s"], b["wall_s"])),
                fmt(dv, "+.4f"),
            ]
        rows.append(row)
    lines = [
        "| " + " | ".join(head) + " |",
        "|" + "|".join("---" if i == 0 else "---:" for i in range(len(head))) + "|",
    ]
    lines += ["| " + " | ".join(row) + " |" for row in rows]
    return "\n".join(lines)


def _setup_line(run: Run) -> str:
    c = run.config
    parts = [f"preset `{c.get('preset')}`"]
    if c.get("n_params"):
        parts.append(f"{c['n_params'] / 1e6:.2f}M parameters")
    parts.append(f"{c.get('world_size', '?')} processes")
    if c.get("micro_batch") and c.get("seq_len"):
        parts.append(
            f"{c['micro_batch']}×{c['seq_len']} tokens per rank per micro-batch"
            + (f", {c['grad_accum']} micro-batches per step" if c.get("grad_accum", 1) > 1 else "")
        )
    parts.append(f"{c.get('steps', '?')} steps planned")
    if c.get("device_type"):
        parts.append(f"device {c['device_type']}")
    text = f"- **{run.label}** (`{run.path}`): " + ", ".join(parts) + f"; compressor `{run.compressor}`"
    e = run.edgc
    if e:
        keys = (
            "r_max",
            "r_min",
            "adaptive",
            "window",
            "rank_mapping",
            "entropy_estimator",
            "iteration_sample_ratio",
            "warmup_fraction",
            "warmup_error_test",
            "rank_step",
        )
        text += " with " + ", ".join(f"{k}={e[k]}" for k in keys if k in e)
    if run.stats["steps"] != run.stats["planned_steps"]:
        text += f". **Stopped at step {run.stats['steps']}**"
    if run.ignored_lines:
        text += " (its truncated last metrics line was ignored)"
    return text + "."


def rank_schedule_lines(runs: list[Run], base: Run | None) -> list[str]:
    """The report's Rank schedules: each compressing run's steps, rank changes and bytes, its byte
    budget, then every run's notices and the runs that never compressed."""
    lines: list[str] = []
    compressed = [r for r in runs if r.compressed_steps]
    if compressed or any(r.notices for r in runs):
        lines += ["", "## Rank schedules", ""]
        for run in compressed:
            s = run.stats
            full = f"{s['compressed_bytes_per_step'] / 1e6:.2f} MB/step while compressing"
            if base is not None:
                full += f" ({ratio(s['compressed_bytes_per_step'], base.stats['bytes_per_step']):.3f}× uncompressed)"
            lines.append(
                f"- **{run.label}**: compressed {s['compressed_fraction']:.0%} of the steps (from step "
                f"{s['first_compressed_step']}), {s['rank_changes']} rank change(s), {full}. "
                f"Steps → rank: {format_schedule(run)}."
            )
            budget = run.edgc.get("rank_budget")
            spent = [r["mean_rank"] for r in run.train if r.get("mean_rank") is not None]
            if budget is not None and spent:
                lines.append(
                    f"  Byte budget: mean rank {budget:g} (signal `{run.edgc.get('budget_signal')}`); "
                    f"spent {spent[-1]:.2f} ({spent[-1] / budget - 1:+.1%})."
                )
    for run in runs:
        for notice in run.notices:
            lines.append(f"- **{run.label}**, step {notice['step']}: {notice.get('message', notice.get('event'))}")
    uncompressed = [r for r in runs if not r.compressed_steps and r.compressor != "none" and not r.notices]
    for run in uncompressed:
        lines.append(f"- **{run.label}** never compressed (its warm-up lasted the whole run).")
    return lines


def plot_captions(compressed: list[Run]) -> dict[str, str]:
    """Each plot's caption, by file name; those of the entropy and rank plots say whether a byte
    budget or the paper's rules set the ranks."""
    budgeted = any(r.edgc.get("rank_budget") is not None for r in compressed)
    ruled = any(r.edgc.get("rank_budget") is None for r in compressed) or not budgeted  # the paper's rules
    return {
        "loss_vs_step.png": "Training loss per step. Curves that lie on top of each other mean compression "
        "did not slow learning per step.",
        "loss_vs_time.png": "The same against wall-clock time: what a faster (or slower) step buys.",
        "val_ppl.png": "Validation perplexity at each evaluation (log scale); the legend gives the final values.",
        "entropy.png": "Gradient entropy samples (dots) and their per-window means (bars), labelled with the rank "
        "in force in that window."
        + (
            " Under a byte budget the rank follows the budget's signal (named under Rank schedules; "
            "with `schedule` the entropy is recorded for reference only)."
            if budgeted
            else ""
        )
        + (
            " In the paper's mode (no budget) EDGC turns the change in this mean between the last "
            "two windows into the next window's rank."
            if ruled
            else ""
        ),
        "rank.png": "Top: the rank EDGC chose for each window, between r_min and r_max (dashed)"
        + (", and the mean rank spent so far (dash-dot) against the byte budget (dotted)" if budgeted else "")
        + ". Bottom: bytes sent per step, which follow the rank.",
        "stages.png": "Pipeline runs: top, the rank each stage used (stage 0 from the entropy; later stages from "
        "the DAC alignment, drawn at the top when uncompressed); bottom, when each stage finished "
        "its gradient sync. DAC aims to make the stages finish together (a small spread).",
        "comm_time.png": "Left: time in the gradient collectives per step. Right: where a median step's time "
        "goes. When all processes share one host, moving the bytes over loopback is nearly free "
        "and this time is mostly one process waiting for the other (they share the cores), so "
        "compression cannot show a time saving here; the MB sent/step column is what it saves "
        "on a real network.",
    }


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
        lines += [
            f"- **… vs uncompressed**: this run's value divided by the uncompressed run **{base.label}**'s "
            "(below 1× = less); Δ val loss is the difference (negative = better than uncompressed)."
        ]
    else:
        lines += ["- No uncompressed run (compressor `none`) was given, so there are no ratio columns."]
    compressed = [r for r in runs if r.compressed_steps]
    lines += rank_schedule_lines(runs, base)
    captions = plot_captions(compressed)
    lines += ["", "## Plots", ""]
    for plot in plots:
        lines += [
            f"### {plot.stem.replace('_', ' ')}",
            "",
            captions.get(plot.name, ""),
            "",
            f"![{plot.stem}]({plot.name})",
            "",
        ]
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
