"""Text table and stacked time-breakdown plot of simulated runs."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from .iteration import BREAKDOWN_KEYS
from .methods import METHOD_LABELS, RunResult

DAY = 86_400


def reductions(result: RunResult, baseline: RunResult) -> tuple:
    """(DP comm latency reduction, run time reduction) vs the baseline, as fractions."""
    return 1 - result.dp_sync_s / baseline.dp_sync_s, 1 - result.total_s / baseline.total_s


def format_table(results: Sequence[RunResult], baseline: RunResult) -> str:
    """Markdown table: per-iteration DP comm latency and iteration time (run averages), run time,
    and the reductions vs the uncompressed baseline."""
    head = [
        "method",
        "ranks (stage 0..P-1)",
        "DP comm/iter (ms)",
        "iter (s)",
        "run (days)",
        "comm reduction",
        "time reduction",
    ]
    rows = []
    for r in results:
        d_comm, d_time = reductions(r, baseline)
        rows.append(
            [
                METHOD_LABELS.get(r.method, r.method),
                r.ranks,
                f"{1000 * r.dp_sync_s:.1f}",
                f"{r.iteration_s:.3f}",
                f"{r.total_s / DAY:.2f}",
                f"{100 * d_comm:+.2f}%",
                f"{100 * d_time:+.2f}%",
            ]
        )
    widths = [max(len(str(x)) for x in col) for col in zip(head, *rows)]
    line = lambda cells: "| " + " | ".join(str(c).ljust(w) for c, w in zip(cells, widths)) + " |"  # noqa: E731
    return "\n".join([line(head), "|" + "|".join("-" * (w + 2) for w in widths) + "|"] + [line(r) for r in rows])


def plot_breakdown(results: Sequence[RunResult], title: str, path: str | Path) -> Path:
    """Stacked bars: run-average seconds per iteration along pipeline stage 0, by component."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    labels = [METHOD_LABELS.get(r.method, r.method).replace(" (", "\n(") for r in results]
    fig, ax = plt.subplots(figsize=(1.8 + 1.6 * len(results), 4.5))
    bottom = [0.0] * len(results)
    colors = plt.get_cmap("tab10").colors
    for i, key in enumerate(BREAKDOWN_KEYS):
        values = [r.breakdown[key] for r in results]
        if not any(values):
            continue
        ax.bar(labels, values, bottom=bottom, label=key, color=colors[i % len(colors)])
        bottom = [b + v for b, v in zip(bottom, values)]
    ax.set_ylabel("seconds per iteration (run average)")
    ax.set_title(title, fontsize=10)
    ax.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.0, 1.0))
    fig.tight_layout()
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path
