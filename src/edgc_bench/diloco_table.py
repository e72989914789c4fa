"""bench.md of `edgc bench --diloco` (diloco_bench.py): measures from the workers' logs, the tables, the checks.

    python -m edgc_bench.diloco_table OUT     # re-render OUT/bench.md from OUT/results.json

Time to target: the target of a link is the highest of its runs' lowest validation losses, so every
run reaches it; a run's time is group 0's training clock (launch, data and evaluation excluded) at
its first validation point at or below it. Loss at equal tokens: the validation loss after the
run's ``--steps`` inner steps (every method sees the same tokens per inner step).
"""

from __future__ import annotations

import json
import statistics
import sys
from collections import Counter
from pathlib import Path

from edgc_probes.participation import participation

from .torchft_bench import read_lines

LABELS = {
    "ddp": "DDP (torchft, uncompressed, every step)",
    "ddp-edgc": "DDP + EDGC (torchft, every step)",
    "diloco": "DiLoCo (torchft's, uncompressed)",
    "diloco-edgc": "DiLoCo + EDGC",
    "streaming-diloco": "Streaming DiLoCo (torchft's, uncompressed)",
    "streaming-diloco-edgc": "Streaming DiLoCo + EDGC",
}
SRC_START, SRC_END = "<!-- bench:start -->", "<!-- bench:end -->"


def label(method: str) -> str:
    """A method's name in the tables; ``diloco-edgc@SPEC`` (a second outer sync) names its SPEC."""
    base, _, spec = method.partition("@")
    return f"{LABELS.get(base, base)} ({spec})" if spec else LABELS.get(base, base)


def measure(run_dir: Path, hosts: int, steps: int, kill_t: float | None) -> dict:
    """One run, from its ``group<G>.jsonl`` logs (diloco_train.py)."""
    groups = [read_lines(run_dir / f"group{g}.jsonl") for g in range(hosts)]
    evals = sorted((r["step"], r["clock"], r["val_loss"]) for r in groups[0] if r["kind"] == "eval")
    finals = [[r for r in g if r["kind"] == "final"] for g in groups]
    syncs = [[r for r in g if r["kind"] == "step" and r.get("sync")] for g in groups]
    done = finals[0][-1]["steps"] if finals[0] else None
    outer_steps = max((r["outer"] + 1 for g in syncs for r in g if r["committed"]), default=0)
    as_steps = [
        [
            {
                "kind": "step",
                "step": r["outer"],
                "committed": r["committed"],
                "participants": r["participants"],
                "participating": r["participating"],
                "healed": r["healed"],
            }
            for r in g
        ]
        for g in syncs
    ]
    inner = [r["step_s"] for r in groups[0] if r["kind"] == "step" and not r.get("sync")]
    wire = [r["wire"] for g in syncs for r in g if r["committed"] and r["participants"] == hosts and "wire" in r]
    full = [r["step_s"] for r in syncs[0] if r["committed"] and r["participants"] == hosts]
    payload = [r["bytes"] for r in syncs[0] if r["committed"] and r.get("bytes") is not None]
    after = [[r for r in g if kill_t and r["t"] > kill_t and r["committed"]] for g in syncs]
    outers = [r["outer"] for r in syncs[0] if r["committed"]]
    return {
        "evals": evals,
        "final_loss": evals[-1][2] if evals else None,
        "clock_s": evals[-1][1] if evals else None,
        "steps_done": done,
        "outer_steps": outer_steps,
        "identical": all(finals) and len({f[-1]["checksum"] for f in finals}) == 1,
        "tensors": finals[0][-1].get("tensors") if finals[0] else None,  # the shared model's parameter tensors
        "participation": participation(as_steps, outer_steps)
        if outer_steps
        else {"per_step": [], "fraction": [0.0] * hosts, "heals": [0] * hosts, "alone": []},
        "payload_bytes": statistics.fmean(payload) if payload else None,
        "shapes": next((r["shapes"] for r in groups[0] if r["kind"] == "model"), None),
        "floor_s": statistics.median(inner) if inner else None,
        "sync_step_s": statistics.median(full) if full else None,
        "outer_step_s": outer_step_s(groups[0], hosts),
        "wire_bytes": statistics.fmean(wire) if wire else None,  # per process and outer step, from its sockets
        "discarded": sum(not r["committed"] for r in syncs[0]),
        "rolled_back": any(b <= a for a, b in zip(outers, outers[1:])),  # a committed outer step repeated
        "stall_s": after[0][0]["t"] - kill_t if after[0] else None,  # survivors: to their next committed outer step
        "heal_s": after[1][0]["t"] - kill_t if after[1] else None,
    }  # the killed group: to its first one


def outer_step_s(lines: list[dict], hosts: int) -> float | None:
    """The median time of an outer step on one group's training thread: its inner steps' times up to
    and including the sync step, over the committed outer steps every group took part in (the first
    left out: it carries the start-up)."""
    spans, running = [], 0.0
    for r in lines:
        if r["kind"] != "step":
            continue
        running += r["step_s"]
        if r.get("sync"):
            if r["committed"] and r["participants"] == hosts:
                spans.append(running)
            running = 0.0
    return statistics.median(spans[1:]) if len(spans) > 1 else None


def final_loss(r: dict) -> float:
    return r["final_loss"] if r.get("final_loss") is not None else float("inf")


def time_to(r: dict, target: float) -> float | None:
    return next((clock for _, clock, loss in r.get("evals", []) if loss <= target), None)


def target_of(results: list[dict], finished_only: bool = False, steps: int | None = None) -> tuple[float, str]:
    """The highest of the runs' lowest losses (every run reaches it), and which run set it; with
    ``finished_only``, of the runs that took all ``steps`` (not stopped by the time budget)."""
    lowest = [
        (min(loss for _, _, loss in r["evals"]), f"{r['method']} round {r['round']}")
        for r in results
        if r.get("evals") and (not finished_only or r.get("steps_done") == steps)
    ]
    return max(lowest) if lowest else (float("nan"), "–")


def _range(values: list, digits: int, unit: str = "") -> str:
    values = [v for v in values if v is not None]
    if not values:
        return "–"
    low, high = f"{min(values):.{digits}f}", f"{max(values):.{digits}f}"
    mean = f"{statistics.fmean(values):.{digits}f}{unit}"
    return mean if low == high else f"{mean} [{low}–{high}]"


def _mb(value: float | None) -> float | None:
    return None if value is None else value / 1e6


def by_method(results: list[dict]) -> dict[str, list[dict]]:
    grouped: dict[str, list[dict]] = {}
    for r in results:
        grouped.setdefault(r["method"], []).append(r)
    return grouped


def wire_per_sync(r: dict) -> float | None:
    syncs = r.get("outer_steps")
    return statistics.fmean(r["tx_bytes"]) / syncs if syncs and r.get("tx_bytes") else None


def link_table(link: dict, steps: int) -> list[str]:
    target, setter = target_of(link["results"])
    late, late_setter = target_of(link["results"], True, steps)
    lines = [
        f"Target validation loss {target:.4f}: the highest of the runs' lowest, set by {setter}; a later "
        f"target {late:.4f}: the same over the runs that took all {steps} steps, set by {late_setter}. "
        "Mean [range] over the rounds.",
        "",
        f"| method | time to target | time to later target | val loss after {steps} inner steps | syncs "
        "| payload per sync | wire per sync (sockets, per process) "
        "| interface per sync | step: sync / inner | participation (lowest group) | replicas identical |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|:---:|",
    ]
    for method, runs in by_method(link["results"]).items():
        losses = [r["final_loss"] for r in runs if r.get("steps_done") == steps]
        stopped = [r for r in runs if r.get("steps_done") != steps]
        cut = Counter(f"stopped at {r['steps_done']}: {final_loss(r):.4f}" for r in stopped)
        loss = "; ".join([_range(losses, 4)] * bool(losses) + [f"{t} ×{n}" if n > 1 else t for t, n in cut.items()])
        times = [time_to(r, target) for r in runs]
        finished = [time_to(r, late) for r in runs if r.get("steps_done") == steps]
        later = _range(finished, 1, " s") if finished else "stopped by the budget"
        lowest = min((min(r["participation"]["fraction"], default=0) for r in runs), default=0)
        identical = sum(bool(r.get("identical")) for r in runs)
        lines.append(
            f"| {label(method)} | {_range(times, 1, ' s')} | {later} | {loss} | "
            f"{_range([r['outer_steps'] for r in runs], 0)} "
            f"| {_range([_mb(r['payload_bytes']) for r in runs], 3, ' MB')} "
            f"| {_range([_mb(r.get('wire_bytes')) for r in runs], 3, ' MB')} "  # –: a run that did not count it
            f"| {_range([_mb(wire_per_sync(r)) for r in runs], 3, ' MB')} "
            f"| {_range([r['sync_step_s'] for r in runs], 2, ' s')} / {_range([r['floor_s'] for r in runs], 2, ' s')} "
            f"| {lowest:.0%} | {'yes' if identical == len(runs) else 'NO'} ({identical}/{len(runs)}) |"
        )
    return lines


def mean_of(runs: list[dict], key) -> float | None:
    values = [key(r) for r in runs]
    values = [v for v in values if v is not None]
    return statistics.fmean(values) if values else None


def floor_of(results: list[dict]) -> float | None:
    """The compute floor: the median inner step (no sync) of the link's DiLoCo runs."""
    values = [r["floor_s"] for r in results if r.get("floor_s") is not None]
    return statistics.median(values) if values else None


def gpu_factor(settings: dict, floor_s: float | None) -> float | None:
    """How many times faster an H100 computes this model's step: the measured floor over the step's
    matmul FLOPs at the simulator's h100 preset (TF32 at its assumed 40 % MFU)."""
    from edgc_sim.cost_model import layer_forward_flops, logits_forward_flops
    from edgc_sim.hardware import DEVICES
    from edgc_train.model import PRESETS

    if not floor_s or settings["preset"] not in PRESETS:
        return None
    shape = PRESETS[settings["preset"]]
    b, s, h = settings["micro_batch"], settings["seq_len"], shape["n_embd"]
    forward = shape["n_layer"] * layer_forward_flops(b, s, h) + logits_forward_flops(b, s, h, settings["vocab_size"])
    return floor_s / (3 * forward / DEVICES["h100"].flops_per_s("tf32"))


def _value(value: float | None, spec: str, unit: str = "") -> str:
    return "–" if value is None else f"{value:{spec}}{unit}"


def check(ok: bool | None, text: str) -> str:
    return f"- {'✓' if ok else '✗' if ok is not None else '?'} {text}"


def participation_checks(link: dict) -> list[str]:
    """Every group in ≥ 95 % of the outer steps of every failure-free run, identical replicas at its end."""
    out = []
    for method, runs in by_method(link["results"]).items():
        lowest = min(min(r["participation"]["fraction"], default=0) for r in runs)
        identical = all(r.get("identical") for r in runs)
        out.append(
            check(
                lowest >= 0.95 and identical,
                f"{label(method)}: every group in ≥ 95 % of the "
                f"syncs (lowest {lowest:.0%}), replicas bit-identical at the end (shared-model digests: "
                f"{'equal' if identical else 'DIFFER'}) in every round",
            )
        )
    return out


def link_steps(results: list[dict]) -> int | None:
    """The run length: the most steps any run of the link took."""
    return max((r.get("steps_done") or 0 for r in results), default=None)


def slow_link_checks(link: dict) -> list[str]:
    """At the slowest link: the slow-link condition, who reaches the target first, EDGC against uncompressed DiLoCo."""
    results, out = link["results"], []
    target, _ = target_of(results)
    runs = by_method(results)
    floor = floor_of(results)
    step = mean_of(runs.get("ddp-edgc", []), lambda r: r["sync_step_s"])
    if floor and step:
        out.append(
            check(
                step >= 2 * floor,
                f"slow link: DDP + EDGC's step {step:.2f} s = {step / floor:.1f} × the "
                f"compute floor {floor:.2f} s (≥ 2 ×)",
            )
        )
    times = {m: mean_of(rs, lambda r: time_to(r, target)) for m, rs in runs.items()}
    mine = times.get("diloco-edgc")
    others = {m: t for m, t in times.items() if m != "diloco-edgc"}
    if mine is not None and others:
        runner_up = min(others, key=lambda m: others[m] if others[m] is not None else float("inf"))
        rival = others[runner_up]
        out.append(
            check(
                rival is None or mine < rival,
                f"DiLoCo + EDGC reaches the target first: {mine:.1f} s, next "
                f"{label(runner_up)} {_value(rival, '.1f', ' s')}",
            )
        )
    plain = times.get("diloco")
    if mine and plain:
        out.append(
            check(
                plain / mine >= 2,
                f"DiLoCo + EDGC vs uncompressed DiLoCo (same H): target {plain / mine:.2f} × sooner (≥ 2 ×)",
            )
        )
    late, _ = target_of(results, True, link_steps(results))
    mine, plain = (mean_of(runs.get(m, []), lambda r: time_to(r, late)) for m in ("diloco-edgc", "diloco"))
    if mine and plain:
        out.append(check(plain / mine >= 2, f"… and at the later target: {plain / mine:.2f} × sooner (≥ 2 ×)"))
    losses = [mean_of(runs.get(m, []), lambda r: r["final_loss"]) for m in ("diloco-edgc", "diloco")]
    if all(losses):
        change = losses[0] / losses[1] - 1
        out.append(
            check(abs(change) <= 0.01, f"loss at equal tokens, DiLoCo + EDGC vs DiLoCo: {change:+.2%} (within 1 %)")
        )
    for key, limit, what in (
        ("payload_bytes", 0.1, "payload per outer step (the pseudo-gradient's message)"),
        ("wire_bytes", 0.12, "wire per outer step (what each process wrote to its sockets)"),
    ):
        mine, theirs = (mean_of(runs.get(m, []), lambda r: r.get(key)) for m in ("diloco-edgc", "diloco"))
        if mine and theirs:
            out.append(
                check(mine / theirs <= limit, f"{what}, DiLoCo + EDGC / DiLoCo = {mine / theirs:.3f} (≤ {limit:g})")
            )
    return out


def kill_lines(link: dict) -> list[str]:
    kill = link.get("kill")
    if not kill:
        return []
    free = by_method(link["results"]).get("diloco-edgc", [])
    loss, clock = mean_of(free, lambda r: r["final_loss"]), mean_of(free, lambda r: r["clock_s"])
    change = kill["final_loss"] / loss - 1 if kill.get("final_loss") and loss else None
    extra = kill["clock_s"] - clock if kill.get("clock_s") and clock else None
    fractions = " · ".join(f"{f:.0%}" for f in kill["participation"]["fraction"])
    lines = [
        f"Kill pass at {link['rate_mbit']:g} Mbit/s: DiLoCo + EDGC, host 1's worker SIGKILLed in an outer step; "
        "torchrun restarts it and it heals from a peer (reference: the failure-free DiLoCo + EDGC runs above).",
        "",
        "| outer steps discarded (group 0) | survivors' stall (kill → their next committed outer step) "
        "| killed group back (kill → its first committed outer step) | training clock vs failure-free "
        "| val loss vs failure-free | participation per group | replicas identical |",
        "|---:|---:|---:|---:|---:|---|:---:|",
        f"| {kill['discarded']} | {_value(kill['stall_s'], '.1f', ' s')} | {_value(kill['heal_s'], '.1f', ' s')} "
        f"| {_value(extra, '+.1f', ' s')} | {_value(change, '+.2%')} "
        f"| {fractions} | {'yes' if kill.get('identical') else 'NO'} |",
        "",
    ]
    lines.append(
        check(
            kill["discarded"] <= 1 and not kill["rolled_back"] and kill.get("kill_t") is not None,
            f"the kill cost at most the outer step in flight ({kill['discarded']} discarded) plus the heal, "
            f"no outer step rolled back{'' if kill.get('kill_t') else ' (NO KILL HAPPENED)'}",
        )
    )
    if change is not None:
        lines.append(
            check(abs(change) <= 0.01, f"final val loss with the kill vs failure-free: {change:+.2%} (within 1 %)")
        )
    return lines


def markdown(summary: dict) -> str:
    s, o = summary["settings"], summary["options"]
    streaming = (
        f"Streaming DiLoCo with {o['fragments']} fragments (one syncs every {o['sync_every'] // o['fragments']})"
    )
    head = (
        f"`{summary['command']}`: {s['hosts']} hosts, one torchft replica group per host, preset {s['preset']}, "
        f"{s['steps']} inner steps of micro-batch {s['micro_batch']} × {s['seq_len']} tokens per group, DiLoCo "
        f"H = {o['sync_every']}, {streaming}; {s['rounds']} round(s) per link, even rounds in reverse order; "
        f"time budget {o['time_budget_s']:g} s of training per run; {summary['date']}, whole bench "
        f"{summary['elapsed_s'] / 60:.0f} min, load {summary['load'][0]:.1f} at the end"
    )
    parts = ["# edgc bench --diloco", "", SRC_START, head, ""]
    for link in summary["links"]:
        floor = floor_of(link["results"])
        factor = gpu_factor(s, floor)
        gpu = (
            f"; an H100 computes this step ≈ {factor:,.0f} × faster, so this link is ≈ "
            f"{link['rate_mbit'] * factor / 1000:,.0f} Gbit/s beside an H100"
            if factor
            else ""
        )
        loads = [r["load"] for r in link["results"] if r.get("load") is not None]
        load = f"; load average {min(loads):.1f}–{max(loads):.1f} at its runs' ends" if loads else ""
        parts += [
            f"**{link['rate_mbit']:g} Mbit/s per host link** (compute floor {floor or 0:.2f} s per inner step"
            f"{gpu}{load})",
            "",
            *link_table(link, s["steps"]),
            "",
            *participation_checks(link),
        ]
        if link is summary["links"][-1]:
            parts += slow_link_checks(link)
        parts += ["", *kill_lines(link)]
    return "\n".join([*parts, SRC_END, ""])


def rewrite(out: Path) -> Path:
    summary = json.loads((out / "results.json").read_text())
    (out / "bench.md").write_text(markdown(summary))
    return out / "bench.md"


if __name__ == "__main__":
    print(rewrite(Path(sys.argv[1])))
