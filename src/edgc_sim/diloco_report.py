"""`edgc simulate --diloco`: the tables of DiLoCo at internet scale (`edgc_sim.diloco`), and the model
against the bench's scaling runs (``--diloco-bench``: `calibrate_on_bench`).

The bench's link is priced by three numbers fitted (least squares) to its 3- and 6-host outer steps:
the rate, a fixed cost per outer step, and the CPU codec's seconds per value and pass; the inner step
is the bench's own compute floor and the wire the model's (`edgc_sim.diloco.wire_bytes`, checked
against the sockets' count). Any other host count of the bench is an extrapolation, said so.
"""

from __future__ import annotations

import math
from dataclasses import replace

import torch

from .diloco import OUTER_SYNCS, Link, Site, codec_passes, crossover, outer_step, sync_seconds, wire_bytes

PARAMS = (1e9, 8e9, 70e9)
LINK_BITS = (1e8, 1e9, 1e10)
GROUPS = (8, 32, 128, 512, 1024)
TOKENS = 1e12
FIT_HOSTS = (3, 6)


def _size(params: float) -> str:
    return f"{params / 1e9:g}B"


def _rate(bits: float) -> str:
    return f"{bits / 1e9:g} Gbit/s" if bits >= 1e9 else f"{bits / 1e6:g} Mbit/s"


def _days(days: float) -> str:
    return "never" if math.isinf(days) else f"{days:.1f} d" if days >= 1 else f"{24 * days:.1f} h"


def internet_table(site: Site, groups: int = 1024, tokens: float = TOKENS) -> str:
    """Per model size and link, each method: outer step, utilisation, time to ``tokens`` with failures."""
    methods = list(OUTER_SYNCS)
    head = "| model | link | " + " | ".join(OUTER_SYNCS[m].label for m in methods) + " |"
    lines = [head, "|---|---|" + "---:|" * len(methods)]
    for params in PARAMS:
        for bits in LINK_BITS:
            point = replace(site, link_bits_per_s=bits)
            cells = []
            for m in methods:
                step = outer_step(OUTER_SYNCS[m], params, groups, point)
                cells.append(
                    f"{step.outer_s:,.0f} s · {step.utilisation:.0%} · {_days(step.days_to(tokens, point, groups))}"
                )
            lines.append(f"| {_size(params)} | {_rate(bits)} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def crossover_table(site: Site) -> str:
    """The fewest groups at which each method's outer step is slower than torchft's DiLoCo's."""
    methods = [m for m in OUTER_SYNCS if m != "torchft"]
    lines = [
        "| model | link | " + " | ".join(OUTER_SYNCS[m].label for m in methods) + " |",
        "|---|---|" + "---:|" * len(methods),
    ]
    for params in PARAMS:
        for bits in LINK_BITS:
            point = replace(site, link_bits_per_s=bits)
            found = [crossover(m, params, point) for m in methods]
            lines.append(
                f"| {_size(params)} | {_rate(bits)} | "
                + " | ".join("none up to 1,024" if n is None else f"{n}" for n in found)
                + " |"
            )
    return "\n".join(lines)


def groups_table(site: Site, params: float = 8e9, bits: float = 1e9) -> str:
    """Utilisation of each method as the groups grow, at one model and link."""
    point = replace(site, link_bits_per_s=bits)
    lines = ["| groups | " + " | ".join(OUTER_SYNCS[m].label for m in OUTER_SYNCS) + " |"]
    lines.append("|---:|" + "---:|" * len(OUTER_SYNCS))
    for groups in GROUPS:
        cells = [f"{outer_step(OUTER_SYNCS[m], params, groups, point).utilisation:.0%}" for m in OUTER_SYNCS]
        lines.append(f"| {groups:,} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def _bench_rows(summary: dict) -> list[dict]:
    """The bench's scaling rows with what the model needs: groups, method, parameters, H, floor, outer step."""
    rows = [r for r in summary["rows"] if r.get("outer_step_s") and r.get("floor_s")]
    params = {r["hosts"]: r["payload_bytes"] / 4 for r in rows if r["sync"] == "diloco"}
    h = summary["options"]["sync_every"]
    out = []
    for r in rows:
        name = "torchft" if r["sync"] == "diloco" else r["sync"]
        if name in OUTER_SYNCS and r["hosts"] in params:
            out.append({**r, "name": name, "params": params[r["hosts"]], "sync_every": h})
    return out


def calibrate_on_bench(summary: dict, fit_hosts: tuple[int, ...] = FIT_HOSTS) -> dict:
    """The fitted link (see the module docstring) and, per bench row, the model's outer step against the measured."""
    rows = _bench_rows(summary)
    fit = [r for r in rows if r["hosts"] in fit_hosts]
    if len(fit) < 3:
        raise ValueError(f"--diloco-bench: need ≥ 3 runs at {fit_hosts} hosts with an outer step time, got {len(fit)}")
    design = torch.tensor(
        [
            [wire_bytes(OUTER_SYNCS[r["name"]], r["params"], r["hosts"]), 1.0]
            + [codec_passes(OUTER_SYNCS[r["name"]], r["hosts"]) * r["params"]]
            for r in fit
        ],
        dtype=torch.float64,
    )
    target = torch.tensor([r["outer_step_s"] - r["sync_every"] * r["floor_s"] for r in fit], dtype=torch.float64)
    seconds_per_byte, overhead, codec = torch.linalg.lstsq(design, target.unsqueeze(1)).solution.squeeze(1).tolist()
    link = Link(1 / seconds_per_byte, 0.0, max(0.0, overhead))
    table = []
    for r in rows:
        sync = OUTER_SYNCS[r["name"]]
        model = r["sync_every"] * r["floor_s"] + sync_seconds(sync, r["params"], r["hosts"], link, max(0.0, codec))
        table.append(
            {
                "hosts": r["hosts"],
                "method": r["name"],
                "measured_s": r["outer_step_s"],
                "model_s": model,
                "error": model / r["outer_step_s"] - 1,
                "fitted": r["hosts"] in fit_hosts,
                "wire_measured": r.get("wire_bytes"),
                "wire_model": wire_bytes(sync, r["params"], r["hosts"]),
            }
        )
    return {"link": link, "codec_s_per_value": max(0.0, codec), "rows": table, "fit_hosts": fit_hosts}


def calibration_table(result: dict, rate_mbit: float) -> str:
    link = result["link"]
    lines = [
        f"Fitted on the {' and '.join(map(str, result['fit_hosts']))}-host runs: "
        f"{8 * link.bytes_per_s / 1e6:.1f} Mbit/s of the nominal {rate_mbit:g}, {link.overhead_s:.2f} s an "
        f"outer step, the codec {1e9 * result['codec_s_per_value']:.1f} ns a value and pass on this CPU.",
        "",
        "| groups | method | outer step, bench | outer step, model | model vs bench | wire, sockets | wire, model |",
        "|---:|---|---:|---:|---:|---:|---:|",
    ]
    for r in result["rows"]:
        note = "" if r["fitted"] else " (extrapolation)"
        wire = "–" if r["wire_measured"] is None else f"{r['wire_measured'] / 1e6:.2f} MB"
        lines.append(
            f"| {r['hosts']} | {OUTER_SYNCS[r['method']].label} | {r['measured_s']:.2f} s | {r['model_s']:.2f} s "
            f"| {r['error']:+.1%}{note} | {wire} | {r['wire_model'] / 1e6:.2f} MB |"
        )
    return "\n".join(lines)


def markdown(site: Site, bench: dict | None = None) -> str:
    """Every table, in the blocks that scripts/diloco_sim_to_docs.py copies."""
    parts = [
        "<!-- sim-diloco-internet:start -->",
        f"`edgc simulate --diloco`: {site.gpus} H100-class GPUs a group ({site.flops_per_s / 1e12:.0f} TFLOP/s "
        f"achieved each), {site.tokens_per_step:,} tokens per inner step per group, H = {site.sync_every}, "
        f"{1e3 * site.latency_s:.0f} ms a message between sites, {site.step_overhead_s:g} s fixed per outer step, "
        f"a group lost every {site.hours_between_losses:g} h (healed over one site link). At 1,024 groups, per "
        f"method: outer step · utilisation · time to {TOKENS:.0e} tokens, failures included.",
        "",
        internet_table(site),
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
