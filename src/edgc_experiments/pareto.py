"""`edgc experiment pareto` — does the entropy-driven rank beat a fixed rank (loss against bytes)?

`edgc train` runs that differ only in the gradient sync, on the same data, seed and 10 %
uncompressed warm-up: uncompressed, static PowerSGD (our engine, error feedback) at r_max/4,
r_max/2, r_max and 2·r_max, and EDGC with r_max given and each rank mapping (``delta``, ``cqm``,
``error-band``). Each run's point is (total bytes sent, final validation loss); the static ranks
and the uncompressed run span the frontier (straight lines between neighbouring non-dominated
points: alternating two static ranks reaches any point between them). EDGC earns its keep when
its point lies on or below that frontier.

Bytes are the measure (on one host the link is loopback, where time says little); with
``--link-mbit RATE`` a second plot shows a modelled wall time: each run's measured compute and
compression time plus its bytes over a RATE Mbit/s link.
"""
from __future__ import annotations

from edgc_train.report_runs import format_schedule, load_run, run_stats

from . import common
from .common import fmt, markdown_table

NAME = "pareto"
HELP = "static PowerSGD ranks vs EDGC's mappings vs uncompressed: final validation loss against total bytes"
DEFAULT_STEPS = 400
TINY_STEPS = 40
R_MAX = 16
MAPPINGS = ("delta", "cqm", "error-band")


def add_arguments(p) -> None:
    p.add_argument("--r-max", type=int, default=R_MAX, metavar="R",
                   help=f"EDGC's rank ceiling; static ranks R/4, R/2, R, 2R (default {R_MAX})")
    p.add_argument("--mappings", default=",".join(MAPPINGS), metavar="M,M,...",
                   help=f"EDGC rank mappings to run (default {','.join(MAPPINGS)})")
    p.add_argument("--nproc", type=int, default=1, metavar="N",
                   help="data-parallel processes per run (default 1: bytes do not depend on it, time does)")
    p.add_argument("--eval-batches", type=int, default=32, metavar="N",
                   help="validation batches of the final loss (default 32; fewer = noisier points)")
    p.add_argument("--link-mbit", type=float, metavar="RATE",
                   help="also plot a modelled wall time on a RATE Mbit/s link (compute + compression + bytes/RATE)")


def parse_mappings(raw: str) -> list[str]:
    from edgc.config import RANK_MAPPINGS

    mappings = [m.strip() for m in raw.split(",") if m.strip()]
    unknown = [m for m in mappings if m not in RANK_MAPPINGS]
    if not mappings or unknown:
        raise common.CLIError(f"--mappings: expected some of {', '.join(RANK_MAPPINGS)}, got {raw!r}")
    return mappings


def validate(args, setting) -> None:
    parse_mappings(args.mappings)
    if args.r_max < 4:
        raise common.CLIError(f"--r-max: must be ≥ 4 (the lowest static rank is r_max/4), got {args.r_max}")
    if args.nproc < 1:
        raise common.CLIError(f"--nproc: must be ≥ 1, got {args.nproc}")
    if args.eval_batches < 1:
        raise common.CLIError(f"--eval-batches: must be ≥ 1, got {args.eval_batches}")
    if args.link_mbit is not None and not args.link_mbit > 0:
        raise common.CLIError(f"--link-mbit: must be > 0 Mbit/s, got {args.link_mbit:g}")


def static_ranks(r_max: int) -> list[int]:
    return sorted({max(1, r_max // 4), max(1, r_max // 2), r_max, 2 * r_max})


def frontier(points: list[tuple[float, float]]) -> list[tuple[float, float]]:
    """The non-dominated (bytes, loss) points, by increasing bytes (so by decreasing loss)."""
    kept: list[tuple[float, float]] = []
    for b, loss in sorted(points):
        if not kept or loss < kept[-1][1]:
            kept.append((b, loss))
    return kept


def frontier_loss(front: list[tuple[float, float]], nbytes: float) -> float | None:
    """The frontier's loss at ``nbytes`` (linear between its points); None below its fewest bytes."""
    if not front or nbytes < front[0][0]:
        return None
    for (b0, l0), (b1, l1) in zip(front, front[1:]):
        if b0 <= nbytes <= b1:
            return l0 + (l1 - l0) * (nbytes - b0) / (b1 - b0) if b1 > b0 else min(l0, l1)
    return front[-1][1]


def frontier_bytes(front: list[tuple[float, float]], loss: float) -> float | None:
    """The fewest bytes on the frontier that reach ``loss`` (linear between points); None if none does."""
    for (b0, l0), (b1, l1) in zip(front, front[1:]):
        if l1 <= loss <= l0:
            return b0 + (b1 - b0) * (l0 - loss) / (l0 - l1) if l0 > l1 else b0
    if front and loss >= front[0][1]:
        return front[0][0]
    return None


def modelled_seconds(run, link_mbit: float) -> float:
    """Σ (step time − communication time) + bytes sent · 8 / link rate, over every step of the run."""
    compute = sum(max(0.0, r["step_time_s"] - r["comm_time_s"]) for r in run.train)
    sent = sum(r.get("bytes_sent") or 0 for r in run.train)
    return compute + sent * 8 / (link_mbit * 1e6)


def run(args, out, setting, log=print) -> dict:
    mappings = parse_mappings(args.mappings)
    ranks = static_ranks(args.r_max)
    nproc = 1 if args.tiny else args.nproc
    flags = ["--eval-every", str(max(1, setting.steps // 4)), "--eval-batches", str(args.eval_batches)]
    jobs: list[tuple[str, str, list[str]]] = [("none", "uncompressed", ["--compressor", "none"])]
    jobs += [(f"rank{r}", f"static r={r}", ["--compressor", "powersgd", "--powersgd-rank", str(r)]) for r in ranks]
    for mapping in mappings:
        fields = {"r_max": args.r_max, "rank_mapping": mapping, "warmup_error_test": False}
        jobs.append((f"edgc-{mapping}", f"EDGC {mapping}",
                     ["--compressor", "edgc", *(a for k, v in fields.items()
                                                for a in ("--edgc", f"{k}={str(v).lower() if isinstance(v, bool) else v}"))]))
    for folder, label, extra in jobs:
        log(f"  {label}")
        common.edgc_train(setting, out / folder, nproc, [*flags, *extra], log)
    return summarise(args, out, setting, nproc, [(folder, label) for folder, label, _ in jobs])


def summarise(args, out, setting, nproc: int, jobs: list[tuple[str, str]]) -> dict:
    """Read the finished runs in ``out`` and write the table, plots, summary.md and results.json."""
    results = []
    for folder, label in jobs:
        loaded = load_run(out / folder)
        stats = run_stats(loaded)
        results.append({
            "run": folder, "label": label, "kind": "edgc" if folder.startswith("edgc") else "static",
            "val_loss": stats["val_loss"], "bytes": stats["bytes_per_step"] * len(loaded.train),
            "mean_rank": (sum(r["rank"] for r in loaded.compressed_steps) / len(loaded.compressed_steps)
                          if loaded.compressed_steps else None),
            "rank_changes": stats["rank_changes"], "decisions": _decisions(loaded),
            "schedule": format_schedule(loaded, limit=10), "wall_s": stats["wall_s"],
            "modelled_s": modelled_seconds(loaded, args.link_mbit) if args.link_mbit else None,
        })
    front = frontier([(r["bytes"], r["val_loss"]) for r in results if r["kind"] == "static"])
    for r in results:
        at_bytes = frontier_loss(front, r["bytes"])
        r["gap_loss"] = None if at_bytes is None else r["val_loss"] - at_bytes
        same_loss = frontier_bytes(front, r["val_loss"])
        r["bytes_vs_frontier"] = None if same_loss is None else r["bytes"] / same_loss
    edgc = [r for r in results if r["kind"] == "edgc"]
    verdicts = [f"{r['label']}: {_verdict(r)}" for r in edgc]
    headline = "; ".join(verdicts)
    base_bytes = results[0]["bytes"]
    rows = [[r["label"], f"{r['bytes'] / 1e9:.3f}", f"{r['bytes'] / base_bytes:.3f}", f"{r['val_loss']:.4f}",
             fmt(r["mean_rank"], ".1f") if r["mean_rank"] is not None else "–",
             str(r["rank_changes"]) if r["kind"] == "edgc" else "–",
             fmt(r["gap_loss"], "+.4f") if r["gap_loss"] is not None else "–",
             fmt(r["bytes_vs_frontier"], ".3f") if r["bytes_vs_frontier"] is not None else "–",
             *([f"{r['modelled_s']:.0f}"] if args.link_mbit else [])] for r in results]
    header = ["run", "GB sent", "bytes vs none", "val loss", "mean rank", "rank changes",
              "Δ loss vs frontier at same bytes", "bytes vs frontier at same loss",
              *([f"modelled s at {args.link_mbit:g} Mbit/s"] if args.link_mbit else [])]
    plots = [_plot(out, results, front, "bytes", "total bytes sent (GB, per process)", "pareto.png")]
    if args.link_mbit:
        plots.append(_plot(out, results, None, "modelled_s",
                           f"modelled wall time at {args.link_mbit:g} Mbit/s (s)", "pareto_time.png"))
    summary = [
        f"# Experiment `{NAME}`: entropy-driven rank vs static ranks",
        "",
        f"**Headline:** {headline}.",
        "",
        f"Setting: {setting.describe(nproc)}; {nproc} process(es); every run has the same 10 % uncompressed "
        f"warm-up (EDGC's warm-up error test is off so that only the rank differs); EDGC: r_max = {args.r_max}, "
        f"r_min = r_max/4, the run-length-scaled window of `edgc train`. Validation loss at step {setting.steps} "
        f"over {args.eval_batches} batches. The frontier joins the non-dominated static points "
        "(uncompressed and static PowerSGD); Δ loss < 0 or a bytes ratio < 1 puts a run below it.",
        "",
        markdown_table(header, rows),
        "",
        "Rank schedules (steps: rank):",
        *(f"- {r['label']} ({r['decisions']} decisions): {r['schedule']}" for r in edgc),
        "",
        "Plots: " + ", ".join(f"`{p.relative_to(out)}`" for p in plots),
    ]
    (out / "summary.md").write_text("\n".join(summary) + "\n")
    common.write_json(out / "results.json", {"setting": vars(setting), "nproc": nproc, "r_max": args.r_max,
                                            "results": results, "frontier": front})
    return {"headline": headline, "results": results, "frontier": front}


def _decisions(run) -> int:
    """Window boundaries while compressing = the rank decisions the controller took."""
    from edgc_train.config import scaled_edgc_defaults

    if run.compressor != "edgc":
        return 0
    steps = int(run.config.get("steps") or len(run.train))
    window = run.edgc.get("window") or scaled_edgc_defaults(steps)["window"]
    return len(run.compressed_steps) // int(window)


def _verdict(r: dict) -> str:
    gap, ratio = r["gap_loss"], r["bytes_vs_frontier"]
    if r["rank_changes"] == 0 and r["mean_rank"] is not None:
        return (f"never changed its rank in {r['decisions']} decisions, so it is static PowerSGD at "
                f"r={r['mean_rank']:.0f} (on the frontier only by being one of its points)")
    parts = []
    if gap is not None:
        parts.append(f"Δ loss {gap:+.4f} at the same bytes")
    if ratio is not None:
        parts.append(f"{ratio:.3f}× the frontier's bytes at the same loss")
    below = (gap is not None and gap <= 0) or (ratio is not None and ratio <= 1)
    return ("on/below the static frontier" if below else "above the static frontier") + (
        f" ({', '.join(parts)})" if parts else "")


def _plot(out, results, front, key, xlabel, name):
    plt = common.pyplot()
    fig, ax = plt.subplots(figsize=(6.4, 4.2))
    scale = 1e9 if key == "bytes" else 1.0
    if front:
        ax.plot([b / scale for b, _ in front], [loss for _, loss in front], "-", color="grey", lw=1,
                label="static frontier")
    for r in results:
        x = r[key] / scale
        style = dict(marker="*", ms=12, color="tab:red") if r["kind"] == "edgc" else dict(marker="o", ms=6,
                                                                                        color="tab:blue")
        if r["run"] == "none":
            style = dict(marker="s", ms=6, color="black")
        ax.plot([x], [r["val_loss"]], linestyle="none", **style)
        ax.annotate(r["label"], (x, r["val_loss"]), textcoords="offset points", xytext=(5, 4), fontsize=7)
    ax.set_xscale("log")
    ax.set_xlabel(xlabel)
    ax.set_ylabel("final validation loss (nats/token)")
    ax.set_title("Loss against cost: lower left is better", fontsize=9)
    if front:
        ax.legend(fontsize=7)
    return common.save(fig, out / name)

