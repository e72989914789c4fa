"""bench.md of `edgc bench --torchft` (see torchft_bench.py): the table and the acceptance checks."""

from __future__ import annotations

LABELS = {
    "ddp-edgc": "EDGC on plain DDP, no failure (reference)",
    "torchft-nofail": "torchft DDP, no failure",
    "torchft-edgc-nofail": "torchft + EDGC, no failure",
    "torchft": "torchft DDP (plain all-reduce)",
    "torchft-edgc": "torchft + EDGC",
    "elastic-edgc": "EDGC + torchrun elastic restart from the last checkpoint",
}
# The part of bench.md that scripts/to_docs.py bench copies into the manual (the torchft results' block).
SRC_START, SRC_END = "<!-- bench:start -->", "<!-- bench:end -->"


def _fmt(value, digits: int = 3, suffix: str = "") -> str:
    return "–" if value is None else f"{value:.{digits}f}{suffix}"


def table(summary: dict) -> str:
    results = summary["results"]
    lines = [
        "| run | step time (median) | total wall | steps lost | heal (kill → training again) "
        "| final val loss | replicas identical | load (1 min) |",
        "|---|---:|---:|---:|---:|---:|:---:|---:|",
    ]
    for name, r in results.items():
        identical = "–" if r.get("identical") is None else "yes" if r["identical"] else "no"
        lines.append(
            f"| {LABELS.get(name, name)} | {_fmt(r['step_s'], 3, ' s')} | {_fmt(r['wall_s'], 1, ' s')} "
            f"| {'–' if r['steps_lost'] is None else r['steps_lost']} | {_fmt(r['heal_s'], 1, ' s')} "
            f"| {_fmt(r['val_loss'], 4)} | {identical} | {_fmt(r.get('load'), 1)} |"
        )
    return "\n".join(lines)


def run_length(values: list[int]) -> str:
    """``[3, 3, 2, 3]`` as ``3 ×2, 2, 3``: the quorum of every step, short."""
    runs: list[list[int]] = []
    for value in values:
        if runs and runs[-1][0] == value:
            runs[-1][1] += 1
        else:
            runs.append([value, 1])
    return ", ".join(f"{value} ×{count}" if count > 1 else str(value) for value, count in runs)


def participation_table(summary: dict) -> str:
    lines = [
        "| run | quorum per step (groups × steps) | took part, per group | heals from a peer, per group "
        "| steps in a quorum of one |",
        "|---|---|---|---|---:|",
    ]
    for name, r in summary["results"].items():
        p = r.get("participation")
        if p:
            lines.append(
                f"| {LABELS.get(name, name)} | {run_length(p['per_step'])} "
                f"| {' · '.join(f'{f:.0%}' for f in p['fraction'])} | {' · '.join(map(str, p['heals']))} "
                f"| {len(p['alone'])} |"
            )
    return "\n".join(lines)


def replica_warnings(summary: dict) -> list[str]:
    """One loud line per torchft run whose groups ended with different parameters."""
    out = []
    for name, r in summary["results"].items():
        if r.get("identical") is False:
            alone = (r.get("participation") or {}).get("alone")
            out.append(
                f"**⚠ REPLICAS DIFFER: {LABELS.get(name, name)} ended with different parameters on its "
                f"groups{f'; steps in a quorum of one: {alone}' if alone else ''}.**"
            )
    return out


def participation_checks(summary: dict) -> list[str]:
    """Every group in (nearly) every step of a failure-free run, and identical replicas at its end."""
    out = []
    for name in ("torchft-nofail", "torchft-edgc-nofail"):
        r = summary["results"].get(name, {})
        if r.get("participation"):
            lowest = min(r["participation"]["fraction"])
            ok = lowest >= 0.95 and r.get("identical") is True
            out.append(
                f"- {'✓' if ok else '✗'} {LABELS[name]}: every group took part in ≥ 95 % of the steps "
                f"(lowest {lowest:.0%}), replicas bit-identical at the end ({'yes' if r.get('identical') else 'NO'})"
            )
    return out


def checks(summary: dict) -> list[str]:
    """What torchft + EDGC must show, each check with its numbers and ✓/✗: a step no slower than EDGC on
    plain DDP and well below torchft's uncompressed one, at most the failed step lost to a kill, a
    heal faster than an elastic restart, the failure-free loss, and replicas still bit-identical."""
    r = summary["results"]
    out = []

    def check(ok: bool | None, text: str) -> None:
        out.append(f"- {'✓' if ok else '✗' if ok is not None else '?'} {text}")

    ft_edgc, ddp, elastic = (r.get(k, {}) for k in ("torchft-edgc", "ddp-edgc", "elastic-edgc"))
    # Step times from the failure-free runs, back to back (those with a kill add restarts and healing).
    ft_free, ft_edgc_free = r.get("torchft-nofail") or r.get("torchft", {}), r.get("torchft-edgc-nofail") or ft_edgc
    if ft_free.get("step_s") and ft_edgc_free.get("step_s"):
        ratio = ft_edgc_free["step_s"] / ft_free["step_s"]
        check(ratio <= 0.65, f"step time torchft + EDGC / torchft DDP = {ratio:.2f} (≤ 0.65)")
    if ddp.get("step_s") and ft_edgc_free.get("step_s"):
        ratio = ft_edgc_free["step_s"] / ddp["step_s"]
        check(abs(ratio - 1) <= 0.10, f"step time torchft + EDGC / EDGC on plain DDP = {ratio:.2f} (within 10 %)")
    if ft_edgc.get("steps_lost") is not None and "torchft-edgc-nofail" in r:
        check(r["torchft-edgc-nofail"].get("steps_lost") == 0, "torchft + EDGC without a failure lost no step")
    if ft_edgc.get("steps_lost") is not None:
        check(
            ft_edgc["steps_lost"] <= 1,
            f"torchft + EDGC lost {ft_edgc['steps_lost']} step(s) to the kill "
            f"(≤ 1: the failed step) and healed in {_fmt(ft_edgc.get('heal_s'), 1, ' s')}, no checkpoint rollback",
        )
    if ft_edgc.get("wall_s") and elastic.get("wall_s"):
        check(
            ft_edgc["wall_s"] < elastic["wall_s"],
            f"total wall time torchft + EDGC {ft_edgc['wall_s']:.1f} s < elastic restart {elastic['wall_s']:.1f} s",
        )
    reference = r.get("torchft-edgc-nofail") or ddp
    if ft_edgc.get("val_loss") and reference.get("val_loss"):
        change = ft_edgc["val_loss"] / reference["val_loss"] - 1
        check(
            abs(change) <= 0.01,
            f"final val loss torchft + EDGC (with the kill) vs failure-free: {change:+.2%} (within 1 %)",
        )
    if ft_edgc.get("identical") is not None:
        check(ft_edgc["identical"], "torchft + EDGC replicas bit-identical at the end (parameter digests)")
    return out + participation_checks(summary)


def markdown(summary: dict) -> str:
    s = summary["settings"]
    rate = "unlimited" if s["rate_mbit"] is None else f"{s['rate_mbit']:g} Mbit/s"
    setting = (
        f"{s['hosts']} hosts (one replica group each) at {rate}, preset {s['preset']}, {s['steps']} steps, "
        f"micro-batch {s['micro_batch']} × {s['seq_len']} tokens; host 1's worker SIGKILLed at step "
        f"{summary['kill_at']}; elastic run checkpoints every {summary['ckpt_every']} steps; "
        f"{summary['date']}, load {summary['load'][0]:.1f}"
    )
    warnings = replica_warnings(summary)
    return "\n".join(
        [
            "# edgc bench --torchft",
            "",
            SRC_START,
            f"`{summary['command']}`: {setting}",
            "",
            *(warnings + [""] if warnings else []),
            table(summary),
            "",
            "Participation (a group takes part in a step it commits as one of the quorum's participants):",
            "",
            participation_table(summary),
            "",
            *checks(summary),
            SRC_END,
            "",
        ]
    )
