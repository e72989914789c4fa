"""The calibrations as markdown tables: measured harness runs (`format_calibration`) and bench
folders (`format_bench_calibration`), as `edgc simulate --calibrate` prints them."""

from __future__ import annotations

import math
from collections.abc import Sequence

from .bench_link import BenchLink
from .calibrate import CalibrationRow
from .calibrate_bench import BLOCKING_REFERENCE, COMPUTE_FLOOR, REFERENCE, BenchRow
from .hardware import DeviceSpec


def format_calibration(rows: Sequence[CalibrationRow]) -> str:
    """Markdown table, one line per row, errors in percent."""
    head = (
        "| run | compressor | rank | steps | step meas (s) | step pred (s) | step err | "
        "comm meas (s) | comm pred (s) | comm err |"
    )
    lines = [head, "|" + "---|" * 10]
    for r in rows:
        lines.append(
            f"| {r.run} | {r.compressor} | {'-' if r.rank is None else r.rank} | {r.steps} | "
            f"{r.step_measured_s:.4f} | {r.step_predicted_s:.4f} | {100 * r.step_error:+.1f}% | "
            f"{r.comm_measured_s:.4f} | {r.comm_predicted_s:.4f} | {100 * r.comm_error:+.1f}% |"
        )
    return "\n".join(lines)


def format_bench_calibration(rows: Sequence[BenchRow], link: BenchLink, device: DeviceSpec) -> str:
    """Markdown: the model's inputs, then one line per (run, rank), times in ms, errors in %."""
    ms = lambda s: "-" if math.isnan(s) else f"{1e3 * s:.0f}"  # noqa: E731
    pct = lambda e: "-" if math.isnan(e) else f"{100 * e:+.1f}%"  # noqa: E731
    ci = lambda lo_hi: "-" if math.isnan(lo_hi[0]) else f"{ms(lo_hi[0])}–{ms(lo_hi[1])}"  # noqa: E731
    lines = [
        f"link: {link.source or link.describe()}; host: {device.flops_per_s('fp32') / 1e9:.1f} GFLOP/s, "
        f"{device.mem_bytes_per_s / 1e9:.1f} GB/s, {device.launch_s * 1e6:.1f} us/op ({device.source})",
        "",
        "| run | rank | steps | MB sent | collectives | us per collective | latency | bytes | link pred "
        "| link meas | link meas 95% | link err | link err, sweep latency | wait pred | comm pred | comm meas "
        "| comm meas 95% | comm err | step pred | step meas | step err | compress pred | compress meas |",
        "|" + "---|" * 23,
    ]
    for r in rows:
        comp = ms(r.compress_predicted_s) + ("" if r.compress_modelled else " (meas)")
        ref = " (ref)" if r.compressor in (REFERENCE, COMPUTE_FLOOR, BLOCKING_REFERENCE) else ""
        count = f"{r.collectives:g}" + ("" if r.collectives_measured else " (pattern)")
        lines.append(
            f"| {r.run} | {'-' if r.rank is None else r.rank} | {r.steps} | {r.bytes_sent / 1e6:.2f} | {count} | "
            f"{f'{1e6 * r.latency_s / r.collectives:.0f}' if r.collectives else '-'}"
            f"{'' if r.latency_from == 'sweep' else ' (traced)'} | "
            f"{ms(r.latency_s)} | {ms(r.bytes_s)} | {ms(r.link_predicted_s)} | {ms(r.link_measured_s)} | "
            f"{ci(r.link_ci_s)} | {pct(r.link_error)} | {pct(r.link_sweep_error)} | {ms(r.wait_s)} | "
            f"{ms(r.comm_predicted_s)} | "
            f"{ms(r.comm_measured_s)} | {ci(r.comm_ci_s)} | {pct(r.comm_error)}{ref} | {ms(r.step_predicted_s)} | "
            f"{ms(r.step_measured_s)} | {pct(r.step_error)}{'' if r.step_model == 'sum' else f' ({r.step_model})'} | "
            f"{comp} | {ms(r.compress_measured_s)} |"
        )
    lines.append("")
    lines.append(
        "times in ms, medians over the compressed steps after the first 10%; 95%: bootstrap interval of "
        "that median (how precisely the run pins it). collectives: per step, the logged median or "
        "(pattern) the method's pattern over DDP's buckets. us per collective: the fixed cost of one, "
        "from the link sweep or (traced) from the comm traces of the *other* runs (leave one run out: "
        "the mean over their latency-bound groups of (link meas - bytes) / collectives; link err, sweep "
        "latency: the same prediction with the sweep's fixed cost). link pred = latency (collectives x the "
        "fixed cost of one) + bytes (each collective's bytes beyond the burst / beta) (+ compress pred for "
        "torch-powersgd, whose timer spans its compression); link meas = per step, the sum over its "
        "collectives of the minimum over ranks of each one's duration (the last rank to arrive waits for "
        "nobody; `edgc train --comm-trace`). comm = rank 0's comm_time_s, which adds waiting for the "
        "slower peer: comm pred = link pred + wait pred (the reference run's peer-wait share of its work "
        "x reference compute + compress pred). step pred = reference compute + compress pred + comm pred; "
        "(hook) / (native): overlapped with backward, from the step timeline (calibrate.step_timeline: "
        "our non-blocking hook, DDP's native all-reduce), comm pred = the sum of each collective's issue "
        "to completion + wait pred. In folders with a nosync run (today's bench) the reference compute is nosync's "
        "step, the "
        "peer wait allreduce-blocking's; none (DDP native) and nosync have no comm timer (-)."
    )
    sources = {}
    for r in rows:
        sources.setdefault(r.latency_from, []).append(r.run + ("" if r.rank is None else f" r={r.rank}"))
    for source, members in sources.items():
        lines.append("")
        lines.append(
            f"fixed cost per collective of {', '.join(dict.fromkeys(members))}: "
            + ("the link sweep's" if source == "sweep" else "traced in " + source.removeprefix("traced: "))
        )
    return "\n".join(lines)
