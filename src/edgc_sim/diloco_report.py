"""`edgc simulate --diloco`: the tables of DiLoCo at internet scale (`edgc_sim.diloco`), and the model
against the bench's scaling runs (``--diloco-bench``: `calibrate_on_bench`).

The bench's link is priced by four numbers fitted to its 3- and 6-host outer steps without added
latency (least squares on the outer steps' relative errors, every cost ≥ 0: `nonnegative_fit`): the
rate, a fixed cost per outer step, the CPU codec's seconds per value and pass, and a cost per round;
the inner step is the bench's own compute floor and the wire the model's
(`edgc_sim.diloco.wire_bytes`, checked against the sockets' count). Runs with a delay added to the
emulated links (``--delay-ms``) are not fitted: the model prices them with that link and each round
of each collective waiting one way of the delay's round trip (`edgc_sim.diloco.latencies`,
`edgc_sim.diloco.Link.per_round_s`), which is what they check. Any other host count of the bench is
an extrapolation, said so.
"""

from __future__ import annotations

import itertools
import math
import statistics
from dataclasses import replace

import torch

from .diloco import (
    MODELS,
    OUTER_SYNCS,
    Link,
    Site,
    codec_passes,
    collectives,
    crossover,
    latencies,
    outer_step,
    sync_seconds,
    wire_bytes,
)

LINK_BITS = (1e8, 1e9, 1e10)
GROUPS = (8, 32, 128, 512, 1024)
TOKENS = 1e12
FIT_HOSTS = (3, 6)
LATENCY_CHECK_WITHIN = 0.15  # the model against the bench's runs with a delay added to its links
# The collectives the bench's process group (gloo) runs at once: ProcessGroupGloo's worker threads (its
# options' default). Over the delayed links 52 all-reduces issued at once took half as long as in turn.
GLOO_IN_FLIGHT = 2


def _rate(bits: float) -> str:
    return f"{bits / 1e9:g} Gbit/s" if bits >= 1e9 else f"{bits / 1e6:g} Mbit/s"


def _days(days: float) -> str:
    return "never" if math.isinf(days) else f"{days:.1f} d" if days >= 1 else f"{24 * days:.1f} h"


def one_collective_each(site: Site) -> dict:
    """Every method as the model priced it before latency was charged per collective: one bucket a sync."""
    return {name: replace(sync, bucket_values=math.inf) for name, sync in OUTER_SYNCS.items()}


def internet_table(site: Site, groups: int = 1024, tokens: float = TOKENS) -> str:
    """Per model size and link, each method: outer step, utilisation, time to ``tokens`` with failures;
    beside it the outer step with one collective a sync (the latency as it was charged before)."""
    methods = list(OUTER_SYNCS)
    before = one_collective_each(site)
    head = "| model | link | " + " | ".join(OUTER_SYNCS[m].label for m in methods) + " |"
    lines = [head, "|---|---|" + "---:|" * len(methods)]
    for model in MODELS:
        for bits in LINK_BITS:
            point = replace(site, link_bits_per_s=bits)
            cells = []
            for m in methods:
                step = outer_step(OUTER_SYNCS[m], model, groups, point)
                old = outer_step(before[m], model, groups, point)
                cells.append(
                    f"{step.outer_s:,.0f} s · {step.utilisation:.0%} · {_days(step.days_to(tokens, point, groups))} "
                    f"(one collective: {old.outer_s:,.0f} s)"
                )
            lines.append(f"| {model.label} | {_rate(bits)} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def collectives_line(groups: int = 1024) -> str:
    """Collectives per outer sync of each method at each model size, at ``groups`` groups."""
    parts = []
    for sync in OUTER_SYNCS.values():
        counts = " / ".join(f"{collectives(sync, model.params, model.tensors, groups):,}" for model in MODELS)
        parts.append(f"{sync.label} {counts}")
    return (
        f"Collectives per outer sync at {' / '.join(model.label for model in MODELS)} and {groups:,} groups: "
        + "; ".join(parts)
        + "."
    )


FIXED_BUCKET_VALUES = 2**19  # the two-stage sync's bucket before its buckets were sized from the run


def fixed_buckets_line(site: Site, model=MODELS[1], bits: float = 1e9) -> str:
    """The two-stage sync's outer step with its buckets sized from the run, beside it at a fixed
    ``FIXED_BUCKET_VALUES`` values a bucket (thousands of collectives) and torchft's."""
    point = replace(site, link_bits_per_s=bits)
    sync = OUTER_SYNCS["quant3-2s"]
    fixed = replace(sync, bucket_values=FIXED_BUCKET_VALUES)
    cells = [
        f"{groups:,} groups {outer_step(sync, model, groups, point).outer_s:,.0f} s "
        f"({collectives(sync, model.params, model.tensors, groups)} collectives; at {FIXED_BUCKET_VALUES:,} values "
        f"a bucket, {collectives(fixed, model.params, model.tensors, groups):,} collectives: "
        f"{outer_step(fixed, model, groups, point).outer_s:,.0f} s; "
        f"torchft's: {outer_step(OUTER_SYNCS['torchft'], model, groups, point).outer_s:,.0f} s)"
        for groups in (GROUPS[0], GROUPS[-1])
    ]
    return (
        f"The two-stage sync's outer step at {model.label} and {_rate(bits)}, its buckets sized from the run: "
        + "; ".join(cells)
        + "."
    )


def crossover_table(site: Site) -> str:
    """The fewest groups at which each method's outer step is slower than torchft's DiLoCo's."""
    methods = [m for m in OUTER_SYNCS if m != "torchft"]
    lines = [
        "| model | link | " + " | ".join(OUTER_SYNCS[m].label for m in methods) + " |",
        "|---|---|" + "---:|" * len(methods),
    ]
    for model in MODELS:
        for bits in LINK_BITS:
            point = replace(site, link_bits_per_s=bits)
            found = [crossover(m, model, point) for m in methods]
            lines.append(
                f"| {model.label} | {_rate(bits)} | "
                + " | ".join("none up to 1,024" if n is None else f"{n}" for n in found)
                + " |"
            )
    return "\n".join(lines)


def groups_table(site: Site, model=MODELS[1], bits: float = 1e9) -> str:
    """Utilisation of each method as the groups grow, at one model and link."""
    point = replace(site, link_bits_per_s=bits)
    lines = ["| groups | " + " | ".join(OUTER_SYNCS[m].label for m in OUTER_SYNCS) + " |"]
    lines.append("|---:|" + "---:|" * len(OUTER_SYNCS))
    for groups in GROUPS:
        cells = [f"{outer_step(OUTER_SYNCS[m], model, groups, point).utilisation:.0%}" for m in OUTER_SYNCS]
        lines.append(f"| {groups:,} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


REPEAT_KEYS = ("hosts", "sync", "delay_ms")  # a run of the bench, the same in each repeat


def join_repeats(summaries: list[dict]) -> dict:
    """Repeats of one ``edgc bench --diloco --scaling`` command (the same options) as one summary: per
    run, the median of the repeats' outer steps and compute floors, their outer steps kept
    (``repeats_s``) so that the table shows their range and a miss inside it is said to be noise."""
    first = summaries[0]
    if any(s["options"] != first["options"] for s in summaries[1:]):
        raise ValueError("--diloco-bench: the folders hold runs of different bench options, not repeats")
    runs: dict[tuple, list[dict]] = {}
    for summary in summaries:
        for row in summary["rows"]:
            if row.get("outer_step_s") and row.get("floor_s"):
                runs.setdefault(tuple(row.get(key, 0.0) for key in REPEAT_KEYS), []).append(row)
    rows = []
    for repeats in runs.values():
        steps = [r["outer_step_s"] for r in repeats]
        rows.append(
            {
                **repeats[0],
                "outer_step_s": statistics.median(steps),
                "floor_s": statistics.median(r["floor_s"] for r in repeats),
                "repeats_s": steps,
                "load": max((r["load"] for r in repeats if r.get("load") is not None), default=None),
            }
        )
    return {**first, "rows": rows, "command": repeated_command([s["command"] for s in summaries])}


def repeated_command(commands: list[str]) -> str:
    """The bench command of several repeats, with each repeat's ``--out`` folder, so the block says how to remake it."""
    if len(commands) == 1:
        return commands[0]
    head, _, _ = commands[0].rpartition(" --out ")
    outs = [command.rpartition(" --out ")[2] for command in commands]
    if not head or any(command.rpartition(" --out ")[0] != head for command in commands):
        return f"{commands[0]} (× {len(commands)} repeats, medians)"
    return f"{head} --out {{{','.join(outs)}}} (× {len(commands)} repeats, medians)"


def _bench_rows(summary: dict) -> list[dict]:
    """The bench's scaling rows with what the model needs: groups, method, parameters, tensors, H,
    floor, outer step, and the round trip its links added (twice the one-way ``delay_ms``)."""
    rows = [r for r in summary["rows"] if r.get("outer_step_s") and r.get("floor_s")]
    params = {r["hosts"]: r["payload_bytes"] / 4 for r in rows if r["sync"] == "diloco"}
    h = summary["options"]["sync_every"]
    out = []
    for r in rows:
        name = "torchft" if r["sync"] == "diloco" else r["sync"]
        if not r.get("tensors"):
            raise ValueError(
                f"--diloco-bench: the {r['hosts']}-host {r['sync']} run names no parameter tensors (a bench from "
                "before they were logged: run it again)"
            )
        if name in OUTER_SYNCS and r["hosts"] in params:
            out.append(
                {
                    **r,
                    "name": name,
                    "params": params[r["hosts"]],
                    "sync_every": h,
                    "round_trip_s": 2 * r.get("delay_ms", 0.0) / 1e3,
                }
            )
    return out


def nonnegative_fit(design: torch.Tensor, target: torch.Tensor, weights: torch.Tensor) -> list[float]:
    """The coefficients ≥ 0 that minimise Σ (weight · (design·x − target))², the first one (the seconds a
    byte) always fitted: the least-squares solution on every support that holds the first column, the
    best whose coefficients are all ≥ 0 (the non-negative optimum is the least-squares solution on its
    own support, so a few columns need no iterative solver). A negative cost clamped after an
    unconstrained fit would leave the other coefficients fitted to it."""
    a, b = design * weights.unsqueeze(1), target * weights
    columns = design.shape[1]
    best: tuple[float, list[float]] | None = None
    for k in range(columns):
        for rest in itertools.combinations(range(1, columns), k):
            support = [0, *rest]
            x = torch.linalg.lstsq(a[:, support], b.unsqueeze(1)).solution.squeeze(1)
            if (x < 0).any():
                continue
            residual = float(((a[:, support] @ x - b) ** 2).sum())
            if best is None or residual < best[0]:
                full = [0.0] * columns
                for column, value in zip(support, x.tolist()):
                    full[column] = value
                best = (residual, full)
    if best is None:
        raise ValueError("--diloco-bench: no positive rate fits the runs without added latency")
    return best[1]


def calibrate_on_bench(summary: dict, fit_hosts: tuple[int, ...] = FIT_HOSTS) -> dict:
    """The fitted link (see the module docstring) and, per bench row, the model's outer step against the measured."""
    rows = _bench_rows(summary)
    fit = [r for r in rows if r["hosts"] in fit_hosts and not r["round_trip_s"]]
    if len(fit) < 4:
        raise ValueError(
            f"--diloco-bench: need ≥ 4 runs at {fit_hosts} hosts without added latency and with an outer step "
            f"time, got {len(fit)}"
        )
    design = torch.tensor(
        [
            [
                wire_bytes(OUTER_SYNCS[r["name"]], r["params"], r["hosts"]),
                1.0,
                codec_passes(OUTER_SYNCS[r["name"]], r["hosts"]) * r["params"],
                latencies(OUTER_SYNCS[r["name"]], r["hosts"], r["params"], r["tensors"], GLOO_IN_FLIGHT),
            ]
            for r in fit
        ],
        dtype=torch.float64,
    )
    target = torch.tensor([r["outer_step_s"] - r["sync_every"] * r["floor_s"] for r in fit], dtype=torch.float64)
    measured = torch.tensor([r["outer_step_s"] for r in fit], dtype=torch.float64)
    seconds_per_byte, overhead, codec, per_round = nonnegative_fit(design, target, weights=1 / measured)
    link = Link(1 / seconds_per_byte, per_round, overhead, GLOO_IN_FLIGHT)
    table = []
    for r in rows:
        sync = OUTER_SYNCS[r["name"]]
        delayed = replace(link, round_trip_s=r["round_trip_s"])
        model = r["sync_every"] * r["floor_s"] + sync_seconds(
            sync, r["params"], r["hosts"], delayed, codec, r["tensors"]
        )
        table.append(
            {
                "hosts": r["hosts"],
                "method": r["name"],
                "round_trip_s": r["round_trip_s"],
                "collectives": collectives(sync, r["params"], r["tensors"], r["hosts"]),
                "rounds": latencies(sync, r["hosts"], r["params"], r["tensors"], GLOO_IN_FLIGHT),
                "measured_s": r["outer_step_s"],
                "sync_measured_s": r["outer_step_s"] - r["sync_every"] * r["floor_s"],
                "latency_model_s": latencies(sync, r["hosts"], r["params"], r["tensors"], GLOO_IN_FLIGHT)
                * r["round_trip_s"]
                / 2,
                "model_s": model,
                "error": model / r["outer_step_s"] - 1,
                "fitted": r in fit,
                "extrapolated": r["hosts"] not in fit_hosts,
                "wire_measured": r.get("wire_bytes"),
                "wire_model": wire_bytes(sync, r["params"], r["hosts"]),
                "load": r.get("load"),
                "repeats_s": r.get("repeats_s", [r["outer_step_s"]]),
            }
        )
    return {"link": link, "codec_s_per_value": codec, "rows": table, "fit_hosts": fit_hosts}


def calibration_table(result: dict, rate_mbit: float) -> str:
    link = result["link"]
    lines = [
        f"Fitted on the {' and '.join(map(str, result['fit_hosts']))}-host runs without added latency: "
        f"{8 * link.bytes_per_s / 1e6:.1f} Mbit/s of the nominal {rate_mbit:g}, {link.overhead_s:.2f} s an "
        f"outer step, {1e3 * link.round_s:.2f} ms a round of a collective ({link.in_flight} collectives at once, "
        f"gloo's threads), the codec {1e9 * result['codec_s_per_value']:.1f} ns a value and pass on this CPU. With "
        "a delay added, each round also waits for its neighbour's message: one way, half the round trip.",
        "",
        "| groups | round trip added | method | collectives a sync | rounds in sequence | outer step, bench "
        "| outer step, model | model vs bench | wire, sockets | wire, model |",
        "|---:|---:|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in result["rows"]:
        note = " (fitted)" if r["fitted"] else " (extrapolation)" if r["extrapolated"] else ""
        wire = "–" if r["wire_measured"] is None else f"{r['wire_measured'] / 1e6:.2f} MB"
        lines.append(
            f"| {r['hosts']} | {1e3 * r['round_trip_s']:.0f} ms | {OUTER_SYNCS[r['method']].label} "
            f"| {r['collectives']:,} | {r['rounds']:g} | {r['measured_s']:.2f} s{_range(r)} | {r['model_s']:.2f} s "
            f"| {r['error']:+.1%}{note} | {wire} | {r['wire_model'] / 1e6:.2f} MB |"
        )
    checked = [r for r in result["rows"] if r["round_trip_s"] and not r["extrapolated"]]
    if checked:
        worst = max(abs(r["error"]) for r in checked)
        missed = [r for r in checked if abs(r["error"]) > LATENCY_CHECK_WITHIN]
        noise = missed and all(min(r["repeats_s"]) <= r["model_s"] <= max(r["repeats_s"]) for r in missed)
        mark = "✓" if not missed else "≈ (noise)" if noise else "✗"
        lines += [
            "",
            f"- {mark} with latency added, at {' and '.join(map(str, result['fit_hosts']))} hosts: the model within "
            f"{worst:.1%} of the bench (≤ {LATENCY_CHECK_WITHIN:.0%} at each run)"
            + (
                "; every run past it has the model's outer step inside the range of its repeats: a target inside "
                "the bench's own spread"
                if noise
                else ""
            ),
            "- what the delay added to the sync (the outer step less H inner steps, against the same run without "
            "it), bench / model: " + "; ".join(_added(r, result["rows"]) for r in checked),
        ]
    loads = [r["load"] for r in result["rows"] if r.get("load") is not None]
    if loads:
        lines.append(f"- the machine's load average at the runs' ends: {min(loads):.0f}–{max(loads):.0f}")
    return "\n".join(lines)


def _range(row: dict) -> str:
    """A run's repeats' range beside their median, where it was repeated."""
    steps = row["repeats_s"]
    return f" ({min(steps):.2f}–{max(steps):.2f})" if len(steps) > 1 else ""


def _added(row: dict, rows: list[dict]) -> str:
    """One delayed run's added sync time, measured against its run without the delay, beside the model's."""
    plain = next(
        (r for r in rows if (r["hosts"], r["method"]) == (row["hosts"], row["method"]) and not r["round_trip_s"]), None
    )
    measured = "–" if plain is None else f"{row['sync_measured_s'] - plain['sync_measured_s']:+.2f} s"
    return f"{row['hosts']} groups {row['method']} {measured} / {row['latency_model_s']:+.2f} s"


def markdown(site: Site, bench: dict | None = None) -> str:
    """Every table, in the blocks that `scripts/to_docs.py diloco-scale --sim` copies."""
    parts = [
        "<!-- sim-diloco-internet:start -->",
        f"`edgc simulate --diloco`: {site.gpus} H100-class GPUs a group ({site.flops_per_s / 1e12:.0f} TFLOP/s "
        f"achieved each), {site.tokens_per_step:,} tokens per inner step per group, H = {site.sync_every}, "
        f"a {1e3 * site.round_trip_s:.0f} ms round trip between sites (each round of each collective waits one way, "
        f"{1e3 * site.round_trip_s / 2:.0f} ms), "
        f"{site.step_overhead_s:g} s fixed per outer step, a group lost every {site.hours_between_losses:g} h "
        f"(healed over one site link). At 1,024 groups, per method: outer step · utilisation · time to "
        f"{TOKENS:.0e} tokens, failures included; in brackets the outer step with one collective a sync, as "
        "latency was charged before.",
        "",
        collectives_line(),
        "",
        internet_table(site),
        "",
        fixed_buckets_line(site),
        "<!-- sim-diloco-internet:end -->",
        "",
        "<!-- sim-diloco-crossover:start -->",
        crossover_table(site),
        "<!-- sim-diloco-crossover:end -->",
        "",
        "<!-- sim-diloco-groups:start -->",
        groups_table(site),
        "<!-- sim-diloco-groups:end -->",
    ]
    if bench is not None:
        result = calibrate_on_bench(bench)
        parts += [
            "",
            "<!-- sim-diloco-calibration:start -->",
            f"`{bench['command']}` against `edgc simulate --diloco --diloco-bench`:",
            "",
            calibration_table(result, bench["rate_mbit"]),
            "<!-- sim-diloco-calibration:end -->",
        ]
    return "\n".join(parts) + "\n"
