"""The bench's comparison: one row per method, every figure also as a ratio to ``none`` of the same run.

``none`` is DDP with no hook (its native all-reduce, overlapped with backward): what users run today.
``nosync`` is the same training with no gradient sync, the compute floor; every step time is also
given as a multiple of it, a ratio that carries across machines better than the one to ``none``.
Per method, from rank 0's ``metrics.jsonl``: medians over all optimizer steps of the DP comm time
(– where it is not measurable: DDP's native all-reduce runs inside C++ and overlaps backward),
step time, compress/decompress time and tokens/s; the mean bytes this rank sent per step (warm-up
steps included); the final validation loss and perplexity; and the wall time (as logged by the run,
evaluations included) of the first evaluation whose loss is ≤ ``none``'s final validation loss × 1.01.
"""

from __future__ import annotations

import json
from pathlib import Path

from .bench_folder import method_dir, read_run
from .targets import median_of, reached_at, recoverable_bound, target_breakdown, target_loss

UNTIMED = ("none", "nosync")  # methods whose logged comm time is 0 because nothing of ours ran


def rows(results: dict[str, dict], r_max: int | None, pipeline: bool = False) -> list[dict]:
    """One row per method. ``pipeline`` (--tp/--pp): ``none`` is our per-stage all-reduce, which is timed."""
    untimed = ("nosync",) if pipeline else UNTIMED
    target = target_loss(results)
    out = []
    for method, run in results.items():
        train = run["train"]
        ranks = sorted({r["rank"] for r in train if r.get("rank")})
        hit = reached_at(run, target)
        reached = hit["wall_s"] if hit else None
        row = {
            "method": method,
            "rank": (f"{ranks[0]}–{ranks[-1]}" if len(ranks) > 1 else str(ranks[0])) if ranks else "",
            # DDP's native all-reduce overlaps backward inside C++: its time is not separable.
            "comm_s": None if method in untimed else median_of(run, "comm_time_s"),
            "step_s": median_of(run, "step_time_s"),
            "compress_s": median_of(run, "compress_time_s"),
            "tokens_per_s": median_of(run, "tokens_per_s"),
            "bytes_per_step": sum(r["bytes_sent"] for r in train) / len(train),
            "val_loss": run["eval"][-1]["val_loss"],
            "val_ppl": run["eval"][-1]["val_ppl"],
            "wall_s": train[-1]["wall_s"],
            "time_to_target_s": reached,
        }
        row["comm_share"] = row["comm_s"] / row["step_s"] if row["step_s"] and row["comm_s"] is not None else None
        if any("interstage_bytes_raw" in r for r in train):  # a pipeline run: its activation-gradient traffic
            row["interstage_sent_per_step"] = sum(r.get("interstage_bytes_sent", 0) for r in train) / len(train)
            row["interstage_raw_per_step"] = sum(r.get("interstage_bytes_raw", 0) for r in train) / len(train)
            row["interstage_s"] = median_of(run, "interstage_time_s")
        if any("expert_bytes_sent" in r for r in train):  # a mixture of experts: each group's bytes
            for group in ("dense", "expert"):
                row[f"{group}_per_step"] = sum(r[f"{group}_bytes_sent"] for r in train) / len(train)
                row[f"{group}_raw_per_step"] = sum(r[f"{group}_bytes_raw"] for r in train) / len(train)
        out.append(row)
    # the reference: none (DDP's native all-reduce), or our uncompressed all-reduce where there is no DDP (MoE)
    ref = next((r for r in out if r["method"] == "none"), next((r for r in out if r["method"] == "allreduce"), None))
    floor = next((r for r in out if r["method"] == "nosync"), None)
    for row in out:
        for key in ("comm_s", "step_s", "tokens_per_s", "bytes_per_step", "val_loss", "val_ppl", "time_to_target_s"):
            value, reference = row[key], ref[key] if ref else None
            row[key + "_x"] = value / reference if value is not None and reference else None
        row["step_floor_x"] = row["step_s"] / floor["step_s"] if floor and floor["step_s"] else None
    return out


def _x(value) -> str:
    return f" ({value:.2f}×)" if value is not None else ""


def _num(value, digits: int = 3) -> str:
    return f"{value:.{digits}f}" if value is not None else "–"


LABELS = {
    "none": "none (DDP native all-reduce)",
    "nosync": "nosync (compute floor)",
    "allreduce": "allreduce (our hook, uncompressed)",
    "allreduce-blocking": "allreduce-blocking (paper: sync after backward)",
}


def result_table(rows_: list[dict], fsdp: bool = False, reference: str = "none") -> str:
    labels = {**LABELS, "none": "none (native HSDP)"} if fsdp else LABELS
    head = (
        f"| method | rank | DP comm s/step | step s (× {reference}) | × floor | comm share | tokens/s | MB sent/step "
        "| compress s/step | final val loss | val ppl | time to target |\n"
        "| --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |\n"
    )
    lines = []
    for r in rows_:
        target = (
            f"{r['time_to_target_s']:.0f} s{_x(r['time_to_target_s_x'])}"
            if r["time_to_target_s"] is not None
            else "not reached"
        )
        lines.append(
            f"| {labels.get(r['method'], r['method'])} | {r['rank']} | {_num(r['comm_s'])}{_x(r['comm_s_x'])} "
            f"| {r['step_s']:.3f}{_x(r['step_s_x'])} | {_num(r['step_floor_x'], 2)} "
            f"| {_num(r['comm_share'] and 100 * r['comm_share'], 0)}% | "
            f"{r['tokens_per_s']:.0f}{_x(r['tokens_per_s_x'])} "
            f"| {r['bytes_per_step'] / 1e6:.2f}{_x(r['bytes_per_step_x'])} | {_num(r['compress_s'])} "
            f"| {r['val_loss']:.4f}{_x(r['val_loss_x'])} | {r['val_ppl']:.1f} | {target} |"
        )
    return head + "\n".join(lines) + "\n"


def groups_table(rows_: list[dict]) -> str:
    """--moe-experts: per method each group's MB sent per step over the link and against its raw bytes."""
    if not any("expert_per_step" in r for r in rows_):
        return ""
    head = (
        "| method | step s | dense MB sent/step (× raw) | expert MB sent/step (× raw) |\n| --- | ---: | ---: | ---: |\n"
    )
    lines = [
        f"| {r['method']} | {r['step_s']:.3f}{_x(r['step_s_x'])} | "
        + " | ".join(
            f"{r[f'{g}_per_step'] / 1e6:.3f} ({r[f'{g}_per_step'] / r[f'{g}_raw_per_step']:.3f}×)"
            for g in ("dense", "expert")
        )
        + " |"
        for r in rows_
        if "expert_per_step" in r
    ]
    return head + "\n".join(lines) + "\n"


PIPELINE_LABELS = {"none": "none (our all-reduce per stage, uncompressed)"}


def pipeline_table(rows_: list[dict]) -> str:
    """--tp/--pp: per method the step, the DP bytes over the link and the inter-stage traffic inside a host."""
    head = (
        "| method | rank | step s (× none) | DP MB sent/step | inter-stage MB/step sent (raw) | × raw "
        "| inter-stage s/step | inter-stage share of step |\n"
        "| --- | --- | ---: | ---: | ---: | ---: | ---: | ---: |\n"
    )
    lines = []
    for r in rows_:
        sent, raw, seconds = r.get("interstage_sent_per_step"), r.get("interstage_raw_per_step"), r.get("interstage_s")
        lines.append(
            f"| {PIPELINE_LABELS.get(r['method'], r['method'])} | {r['rank']} | {r['step_s']:.3f}{_x(r['step_s_x'])} "
            f"| {r['bytes_per_step'] / 1e6:.2f}{_x(r['bytes_per_step_x'])} "
            f"| {_num(sent and sent / 1e6)} ({_num(raw and raw / 1e6)}) | "
            f"{_num(sent / raw if sent and raw else None, 2)} "
            f"| {_num(seconds)} | {_num(seconds and 100 * seconds / r['step_s'], 0)}% |"
        )
    return head + "\n".join(lines) + "\n"


def floor_target(rate_mbit: float | None, fsdp: bool = False) -> float:
    """EDGC's step over the compute floor that the bench asks for: ≤ 1.15× on links of 1 Gbit/s and
    faster (unlimited too), where the factors can hide behind backward; ≤ 1.25× on slower links,
    where part of them cannot. The HSDP bench keeps ≤ 1.25× at any rate."""
    return 1.25 if fsdp or (rate_mbit is not None and rate_mbit < 1000) else 1.15


def edgc_first(edgc_s: float | None, static_s: float | None) -> bool:
    """EDGC reached the target before static PowerSGD at r_max (None: never reached it)."""
    return edgc_s is not None and (static_s is None or edgc_s < static_s)


def checks(rows_: list[dict], r_max: int | None, fsdp: bool = False, rate_mbit: float | None = None) -> list[str]:
    """The issue's acceptance targets, evaluated on this run's numbers (``rate_mbit``: the host link)."""
    by = {r["method"]: r for r in rows_}
    e, n, ours = by.get("edgc"), by.get("none"), by.get("allreduce")
    out = []

    def bound(label: str, value: float | None, limit: float, unit: str) -> None:
        if value is not None:
            out.append(
                f"{label} {value:.2f}× {unit} (target ≤ {limit:.2f}×): {'holds' if value <= limit else 'MISSED'}"
            )

    if ours and n:
        out.append(
            f"our uncompressed hook step time {ours['step_s_x']:.2f}× native DDP (target within 5%): "
            f"{'holds' if abs(ours['step_s_x'] - 1) <= 0.05 else 'MISSED'}"
        )
    reference = "native HSDP" if fsdp else "native DDP"
    if e and n:
        bound("EDGC step time", e["step_s_x"], 0.75 if fsdp else 0.70, reference)
        diff = e["val_loss"] / n["val_loss"] - 1
        out.append(
            f"EDGC final validation loss {100 * diff:+.2f}% vs {reference} (target within ±1%): "
            f"{'holds' if abs(diff) <= 0.01 else 'MISSED'}"
        )
    if e:
        bound("EDGC step time", e["step_floor_x"], floor_target(rate_mbit, fsdp), "the compute floor")
    if by.get("powersgd@rmax") and n:
        bound(f"static PowerSGD at r_max = {r_max} step time", by["powersgd@rmax"]["step_s_x"], 0.70, "native DDP")
    torch_psgd, ours_static = by.get("torch-powersgd"), by.get("powersgd@rmax")
    if torch_psgd and ours_static:
        out.append(
            f"static PowerSGD at r_max = {r_max}: ours {ours_static['step_s']:.3f} s vs PyTorch's powerSGD_hook "
            f"{torch_psgd['step_s']:.3f} s per step ({ours_static['step_s'] / torch_psgd['step_s']:.2f}×)"
        )
    hi, lo = by.get("powersgd@rmax"), by.get("powersgd@rmin")
    if e and hi:
        te, th = e["time_to_target_s"], hi["time_to_target_s"]
        verdict = "holds" if edgc_first(te, th) else "MISSED"
        fmt = lambda t: f"{t:.0f} s" if t is not None else "not reached"  # noqa: E731
        out.append(
            f"time to target: EDGC {fmt(te)} vs static PowerSGD at r_max = {r_max} {fmt(th)} "
            f"(target: EDGC less): {verdict}"
        )
    if e and lo:
        better = e["val_loss"] < lo["val_loss"]
        out.append(
            f"final validation loss: EDGC {e['val_loss']:.4f} vs static PowerSGD at r_min = "
            f"{max(1, (r_max or 4) // 4)} {lo['val_loss']:.4f}: EDGC is {'lower' if better else 'NOT lower'}"
        )
    return out


def _took(summary: dict) -> str:
    """How long the bench took, or for one round of several: which round, in which order, how long."""
    minutes = f"{summary['elapsed_s'] / 60:.1f} min"
    if not summary.get("round"):
        return f"whole bench {minutes}"
    return f"{summary['round']} of {summary['settings']['rounds']} (order {', '.join(summary['order'])}) {minutes}"


def markdown(summary: dict, results: dict[str, dict] | None = None) -> str:
    from .link_calibration import table as calibration_table

    s = summary["settings"]
    rate = "unlimited" if s["rate_mbit"] is None else f"{s['rate_mbit']:g} Mbit/s"
    rows_ = summary["rows"]
    # The communication share of a step, where it can be measured: the paper's sync after backward.
    blocking = next((r for r in rows_ if r["method"] == "allreduce-blocking"), None)
    share = f"{100 * blocking['comm_share']:.0f}%" if blocking and blocking["comm_share"] is not None else "–"
    load = summary["load_start"], summary["load_end"]
    pipeline = s.get("tp", 1) > 1 or s.get("pp", 1) > 1
    if pipeline:
        return _pipeline_markdown(summary, rate)
    hsdp = (
        " as HSDP (FSDP2 shards inside a host, hosts are replicas; none = native HSDP: FSDP2 on the 2-D mesh, "
        "its own replica all-reduce)"
        if s.get("fsdp")
        else f" with {s['moe_experts']} experts per MLP split over a host's processes (EP {s['nproc']}), hosts "
        "the experts' replicas (no DDP: ratios are to `allreduce`, our uncompressed sync of both groups)"
        if s.get("moe_experts")
        else ""
    )
    parts = [
        "# edgc bench\n",
        f"Date: {summary['date']}. Command: `{summary['command']}`\n",
        "<!-- bench:start -->",
        f"`{summary['command']}` — {summary['date']}, {s['hosts']} hosts × {s['nproc']} process(es)"
        f"{hsdp}, "
        f"{rate} per host link (tc tbf on both ends of each veth), preset `{s['preset']}`, "
        f"{s['micro_batch']} × {s['seq_len']} tokens per rank per step, {s['steps']} steps, seed {s['seed']}; "
        f"uncompressed communication share (sync after backward) {share}; EDGC r_max = {summary['r_max']}. "
        f"Load average {load[0][0]:.1f} at start, {load[1][0]:.1f} at end; {_took(summary)}.\n",
        result_table(rows_, bool(s.get("fsdp")), "allreduce" if s.get("moe_experts") else "none"),
        groups_table(rows_),
        (
            "Ratios are to `none` (native HSDP: FSDP2's own replica all-reduce) in the same "
            if s.get("fsdp")
            else "Ratios (and the target) are to `allreduce` (our uncompressed sync of both groups) in the same "
            if s.get("moe_experts")
            else "Ratios are to `none` (DDP with no hook: its native all-reduce, overlapped with backward) in the same "
        )
        + "invocation; × floor is the step time over `nosync`'s (no gradient sync at all). Times are medians over "
        "all steps (rank 0); DP comm is the time from issuing each collective to its completion, summed (it "
        "overlaps backward and other collectives, so it can exceed the step's share of waiting); "
        "MB sent/step is the mean (warm-up steps included); time to target = wall time to the first "
        "validation loss ≤ 1.01 × the reference's final one."
        + (
            ""
            if summary.get("round")
            else " The methods run one after another, so a drift of the machine's speed "
            "between their runs moves these ratios; `--rounds 2` or more reverses the order every other round "
            "and judges the targets on the rounds' mean (docs/bench.md)."
        )
        + "\n",
        *[f"- {line}" for line in checks(rows_, summary["r_max"], bool(s.get("fsdp")), s["rate_mbit"])],
        *(
            [
                "\nWhere the wall time to the target went (sums over the steps up to the evaluation that reached "
                "it):\n",
                breakdown,
            ]
            if (breakdown := target_breakdown(results or {}))
            else []
        ),
        *([bound, ""] if (bound := recoverable_bound(results or {})) else []),
        "<!-- bench:end -->\n",
        "## Link calibration (gloo all-reduce between the hosts)\n",
        calibration_table(summary["calibration"], s["rate_mbit"]),
    ]
    if summary["notes"]:
        parts += ["## Notes\n", *[f"- {n}" for n in summary["notes"]], ""]
    parts += ["Plots: `val_loss.png` (validation loss vs wall time), `step_time.png` (step time split).\n"]
    return "\n".join(parts)


def _pipeline_markdown(summary: dict, rate: str) -> str:
    """bench.md of a TP × PP × DP bench: one whole model per host, DP over the link (no DDP reference)."""
    from .link_calibration import table as calibration_table

    s, load = summary["settings"], (summary["load_start"], summary["load_end"])
    parts = [
        "# edgc bench\n",
        f"Date: {summary['date']}. Command: `{summary['command']}`\n",
        "<!-- bench:start -->",
        f"`{summary['command']}` — {summary['date']}, {s['hosts']} hosts × TP{s['tp']} × PP{s['pp']} "
        f"({s['nproc']} processes per host: one whole model per host, each stage's DP group crosses the link), "
        f"{rate} per host link (tc tbf on both ends of each veth), preset `{s['preset']}`, {s['grad_accum']} "
        f"micro-batches of {s['micro_batch']} × {s['seq_len']} tokens per step, {s['steps']} steps, seed {s['seed']}; "
        f"inter-stage {s['interstage']} at rank {s['interstage_rank']}; EDGC r_max = {summary['r_max']}. "
        f"Load average {load[0][0]:.1f} at start, {load[1][0]:.1f} at end; {_took(summary)}.\n",
        pipeline_table(summary["rows"]),
        "Ratios are to `none` (each stage all-reduces its gradients uncompressed) in the same invocation; every "
        "method runs the same `--interstage` setting, so the methods differ only in the DP sync. Step "
        "time and inter-stage time are medians over all steps (rank 0's record); bytes are means per step "
        "(warm-up steps included). DP MB: what the pipeline's stages (replica 0, all TP ranks) sent over the "
        "link; inter-stage MB: the activation gradients replica 0's stages sent back to their predecessors "
        "(TP rank 0, inside the host), raw = uncompressed. Inter-stage s: summed over the stages, the time in "
        "each activation-gradient exchange (sender: compress and issue; receiver: blocked in the receive, "
        "waiting for the next stage's backward included, and decompress).\n",
        "<!-- bench:end -->\n",
        "## Link calibration (gloo all-reduce between the hosts)\n",
        calibration_table(summary["calibration"], s["rate_mbit"]),
    ]
    if summary["notes"]:
        parts += ["## Notes\n", *[f"- {n}" for n in summary["notes"]], ""]
    return "\n".join(parts)


def plots(results: dict[str, dict], out: Path) -> None:
    if not results:
        return
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 5))
    for method, run in results.items():
        ax.plot([e["wall_s"] for e in run["eval"]], [e["val_loss"] for e in run["eval"]], marker=".", label=method)
    if (target := target_loss(results)) is not None:
        ax.axhline(target, color="grey", ls=":", label="target")
    ax.set(xlabel="wall time (s)", ylabel="validation loss", title="validation loss vs wall time")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(out / "val_loss.png", dpi=110)
    plt.close(fig)

    fig, ax = plt.subplots(figsize=(8, 5))
    names = list(results)
    comm = [median_of(results[m], "comm_time_s") for m in names]
    comp = [median_of(results[m], "compress_time_s") for m in names]
    step = [median_of(results[m], "step_time_s") for m in names]
    rest = [max(0.0, s - c - k) for s, c, k in zip(step, comm, comp)]
    ax.bar(names, rest, label="compute")
    ax.bar(names, comp, bottom=rest, label="compress/decompress")
    ax.bar(names, comm, bottom=[a + b for a, b in zip(rest, comp)], label="DP communication")
    ax.set(ylabel="median seconds per step", title="step time")
    ax.tick_params(axis="x", rotation=30)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(out / "step_time.png", dpi=110)
    plt.close(fig)


def rewrite(out: Path) -> Path:
    """Re-render ``OUT/bench.md`` and the plots from a finished bench's results.json and run folders."""
    summary = json.loads((out / "results.json").read_text())
    if summary.get("rounds"):
        raise SystemExit(f"{out} is a bench of rounds: python -m edgc_bench.rounds {out}")
    results = {r["method"]: read_run(method_dir(out, r["method"])) for r in summary["rows"]}
    s = summary["settings"]
    summary["rows"] = rows(results, summary["r_max"], s.get("tp", 1) > 1 or s.get("pp", 1) > 1)
    (out / "bench.md").write_text(markdown(summary, results))
    plots(results, out)
    return out / "bench.md"


if __name__ == "__main__":  # python -m edgc_bench.table OUT: re-render after a change to this module
    import sys

    print(rewrite(Path(sys.argv[1])))
