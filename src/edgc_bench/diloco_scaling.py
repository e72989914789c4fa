"""`edgc bench --diloco --scaling 3,6,12`: the wire of one process per outer step, and the outer step's
time, at each number of replica groups (one per emulated host), for torchft's DiLoCo and each outer
sync of ``--scaling-syncs`` (the evaluation's: today's one-stage ``quant3``, the two-stage
``quant3-2s``).

One network per host count at the slowest of ``--rates``; each method runs once (``--steps`` inner
steps, an outer step every ``--sync-every``; no kill). The wire is counted from the sockets: each
worker logs the bytes its process wrote during every sync step (``wire``: the kernel's ``wchar`` of
the process, gloo's traffic whatever edgc's counters say; diloco_train.py), and the table gives the
mean over groups and committed outer steps, against the raw pseudo-gradient (4 bytes a parameter).
A ring all-reduce writes 2 (N − 1)/N of its buffer per process, so torchft's column grows towards
2×; the ratio to it is what stays flat or does not.

Beside torchft's fp32 DiLoCo, two syncs users compare with are priced (neither runs here): a bf16
pseudo-gradient's ring all-reduce (half torchft's measured fp32 wire), and torchft's FP8 path
(``should_quantize=True``: `fp8_path_bytes`, its two stages 2 (N − 1)/N of that message, as torchft's
measured wire is of the fp32 one; it needs Triton and a GPU).
"""

from __future__ import annotations

import json
import math
import os
import time
from dataclasses import replace
from pathlib import Path

from .diloco_table import measure
from .netns import Network
from .run import BenchSettings

LABEL = {"diloco": "torchft's DiLoCo (ring all-reduce)"}


def run_scaling(s: BenchSettings, o, out: Path, command: str, say=print) -> dict:
    """Every host count of ``o.scaling``, torchft's DiLoCo and each of ``o.scaling_syncs``."""
    from edgc_train.data import prepare_data

    from .diloco_bench import run_method

    out.mkdir(parents=True, exist_ok=True)
    prepare_data(s.data, s.vocab_size, 0.1, s.max_chars, None, log=lambda *a, **k: None)
    rate, started, rows = o.rates[-1], time.time(), []
    for hosts in o.scaling:
        settings = replace(s, hosts=hosts)
        for sync in ("diloco", *o.scaling_syncs):
            method, options = ("diloco", o) if sync == "diloco" else ("diloco-edgc", replace(o, outer_sync=sync))
            for delay in o.delays_ms:  # one after the other: a method's runs see the shared machine alike
                run_dir = out / f"{hosts}hosts" / (f"{delay:g}ms" if delay else "") / sync
                say(f"[{time.time() - started:6.0f} s] {hosts} groups at {rate:g} Mbit/s, {delay:g} ms: {sync}")
                with Network(hosts, rate, delay_ms=delay) as net:
                    result = run_method(net, settings, options, method, run_dir)
                result.update(measure(run_dir, hosts, settings.steps, None), load=os.getloadavg()[0])
                result.update(hosts=hosts, sync=sync, delay_ms=delay)
                rows.append(result)
                say(
                    f"    wire {(result['wire_bytes'] or 0) / 1e6:.3f} MB per process per outer step, "
                    f"outer step {result.get('outer_step_s') or 0:.2f} s"
                )
    summary = {
        "settings": s.__dict__,
        "options": o.__dict__,
        "command": command,
        "rate_mbit": rate,
        "rows": rows,
        "elapsed_s": time.time() - started,
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime(started)),
    }
    (out / "results.json").write_text(json.dumps(summary, indent=1, default=str))
    (out / "scaling.md").write_text(markdown(summary))
    return summary


def markdown(summary: dict) -> str:
    """The scaling table and its checks (the runs without added latency), and the outer steps of those with it."""
    rows = [r for r in summary["rows"] if not r.get("delay_ms")]
    syncs = [r["sync"] for r in rows if r["hosts"] == rows[0]["hosts"]]
    hosts = sorted({r["hosts"] for r in rows})
    cell = {(r["hosts"], r["sync"]): r for r in rows}
    raw = {h: cell[(h, "diloco")]["payload_bytes"] for h in hosts if (h, "diloco") in cell}
    s = summary["settings"]
    head = [
        "<!-- bench-diloco-scaling:start -->",
        f"`{summary['command']}`: {', '.join(map(str, hosts))} replica groups (one per emulated host) at "
        f"{summary['rate_mbit']:g} Mbit/s per host link, preset {s['preset']}, {s['steps']} inner steps, an outer "
        f"step every {summary['options']['sync_every']}; {summary['date']}, {summary['elapsed_s'] / 60:.0f} min. "
        "Wire: the bytes each worker process wrote to its sockets per outer step (the kernel's count, mean over "
        "groups and committed outer steps), × the raw pseudo-gradient (4 bytes a parameter); ÷: against "
        "torchft's DiLoCo at the same groups. Outer step: its median time on group 0's training thread (its "
        "inner steps and the sync), beside the compute floor (the median inner step without a sync).",
        "",
        "| groups | "
        + " | ".join(f"{LABEL.get(x, x)}: wire" for x in syncs)
        + " | outer step: "
        + " / ".join(syncs)
        + " |",
        "|---:|" + "---:|" * len(syncs) + "---:|",
    ]
    lines = []
    for h in hosts:
        wire = [cell.get((h, x), {}).get("wire_bytes") for x in syncs]
        parts = [_wire(w, raw.get(h), wire[0], x == "diloco") for w, x in zip(wire, syncs)]
        times = " / ".join(_seconds(cell.get((h, x), {}).get("outer_step_s")) for x in syncs)
        floor = cell.get((h, "diloco"), {}).get("floor_s")
        lines.append(f"| {h} | " + " | ".join(parts) + f" | {times} (floor {_seconds(floor)}) |")
    tail = [*checks(cell, hosts, syncs), *priced(cell, hosts, syncs), *delayed_lines(summary["rows"], syncs)]
    return "\n".join([*head, *lines, "", *tail, "<!-- bench-diloco-scaling:end -->", ""])


def delayed_lines(rows: list[dict], syncs: list[str]) -> list[str]:
    """The outer steps with a delay added between hosts (the round trip twice it), per groups and delay."""
    points = sorted({(r["hosts"], r["delay_ms"]) for r in rows if r.get("delay_ms")})
    if not points:
        return []
    cell = {(r["hosts"], r.get("delay_ms", 0), r["sync"]): r for r in rows}
    lines = [
        "",
        "With a delay added on every path between two hosts (`--delay-ms`; a round trip is twice it), the outer step:",
        "",
        "| groups | round trip added | outer step: " + " / ".join(syncs) + " |",
        "|---:|---:|---:|",
    ]
    for hosts, delay in points:
        times = [cell.get((hosts, delay, x), {}).get("outer_step_s") for x in syncs]
        plain = [cell.get((hosts, 0, x), {}).get("outer_step_s") for x in syncs]
        lines.append(
            f"| {hosts} | {2 * delay:g} ms | "
            + " / ".join(f"{_seconds(t)} (no delay {_seconds(p)})" for t, p in zip(times, plain))
            + " |"
        )
    return lines


def _wire(wire: float | None, raw: float | None, reference: float | None, is_reference: bool) -> str:
    if wire is None or not raw:
        return "–"
    text = f"{wire / 1e6:.2f} MB = {wire / raw:.2f}×"
    return text if is_reference or not reference else f"{text} (÷ {wire / reference:.3f})"


def _seconds(value: float | None) -> str:
    return "–" if value is None else f"{value:.2f} s"


def fp8_path_bytes(shapes: list[list[int]], groups: int) -> int:
    """Bytes of torchft's FP8 message for tensors of ``shapes`` over ``groups``, one call a parameter
    (DiLoCo's default), as torchft.quantization lays it out: a tensor's rows (a 1-D tensor: a row a
    value) padded to a multiple of the groups, each row an fp32 scale and a byte a value, padded to 4."""
    total = 0
    for shape in shapes:
        rows, cols = (shape[0], 1) if len(shape) == 1 else (shape[0], math.prod(shape[1:]))
        total += math.ceil(rows / groups) * groups * (math.ceil(cols / 4) + 1) * 4
    return total


def priced(cell: dict, hosts: list[int], syncs: list[str]) -> list[str]:
    """Per compressed sync: its wire against a bf16 ring all-reduce's and torchft's FP8 path's, priced
    from torchft's measured fp32 wire (see the module docstring)."""
    out = []
    for sync in syncs[1:]:
        bf16, fp8, fp8_share = [], [], []
        for h in hosts:
            wire, torchft = cell.get((h, sync), {}).get("wire_bytes"), cell.get((h, "diloco"), {})
            shapes = torchft.get("shapes")
            if not (wire and torchft.get("wire_bytes") and shapes):
                break
            share = fp8_path_bytes(shapes, h) / (4 * sum(math.prod(s) for s in shapes))
            bf16.append(wire / (torchft["wire_bytes"] / 2))
            fp8.append(wire / (torchft["wire_bytes"] * share))
            fp8_share.append(share)
        if len(bf16) == len(hosts):
            out.append(
                f"- {sync}: wire ÷ a bf16 pseudo-gradient's ring all-reduce (priced) "
                f"{' · '.join(f'{r:.3f}' for r in bf16)}; ÷ torchft's FP8 path (priced, its message "
                f"{' · '.join(f'{r:.3f}' for r in fp8_share)}× the fp32 one) {' · '.join(f'{r:.3f}' for r in fp8)} "
                f"at {', '.join(map(str, hosts))} groups"
            )
    return out


def checks(cell: dict, hosts: list[int], syncs: list[str]) -> list[str]:
    """Per compressed outer sync: ≤ 0.12 × torchft's wire at every group count, and flat (max/min ≤ 1.1)."""
    from .diloco_table import check

    out = []
    for sync in syncs[1:]:
        ratios = [
            cell[(h, sync)]["wire_bytes"] / cell[(h, "diloco")]["wire_bytes"]
            for h in hosts
            if cell.get((h, sync), {}).get("wire_bytes") and cell.get((h, "diloco"), {}).get("wire_bytes")
        ]
        if len(ratios) < len(hosts):
            out.append(check(None, f"{sync}: a wire count is missing"))
            continue
        spread = max(ratios) / min(ratios) - 1
        out.append(
            check(
                max(ratios) <= 0.12 and spread <= 0.10,
                f"{sync}: wire ÷ torchft's {' · '.join(f'{r:.3f}' for r in ratios)} at {', '.join(map(str, hosts))} "
                f"groups (≤ 0.12 at each), spread {spread:.1%} (≤ 10 %)",
            )
        )
    return out


PER_RUN_OPTIONS = ("scaling", "delays_ms")  # what runs joined into one table may differ in, besides the hosts


def joined(summaries: list[dict]) -> dict:
    """Several scaling runs as one (the host counts of one, the rest of another), each run's rows as
    measured: their settings and options must agree but for the host counts and the delays."""
    first = summaries[0]
    for other in summaries[1:]:
        for part, skip in (("settings", ("hosts",)), ("options", PER_RUN_OPTIONS)):
            differ = sorted(
                k for k in {*first[part], *other[part]} - set(skip) if first[part].get(k) != other[part].get(k)
            )
            if differ:
                raise ValueError(f"scaling runs to join differ in {part} {', '.join(differ)}: `{other['command']}`")
        if other["rate_mbit"] != first["rate_mbit"]:
            raise ValueError(f"scaling runs to join differ in their rate: `{other['command']}`")
    seen = {(r["hosts"], r.get("delay_ms", 0), r["sync"]) for s in summaries[1:] for r in s["rows"]}
    return {
        **first,
        "rows": [r for r in first["rows"] if (r["hosts"], r.get("delay_ms", 0), r["sync"]) not in seen]
        + [r for s in summaries[1:] for r in s["rows"]],
        "command": "` and `".join(s["command"] for s in summaries),
        "elapsed_s": sum(s["elapsed_s"] for s in summaries),
    }


if __name__ == "__main__":
    import sys

    # FOLDER [MORE...]: FOLDER/scaling.md from its results.json and the others' (joined, `joined`)
    folders = [Path(arg) for arg in sys.argv[1:]]
    summary = joined([json.loads((folder / "results.json").read_text()) for folder in folders])
    (folders[0] / "scaling.md").write_text(markdown(summary))
    print(folders[0] / "scaling.md")
