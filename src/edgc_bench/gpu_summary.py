"""The GPU run's closing summary: each part's status and time, and its headline figures, read back from
the part's file (what the console of a device call shows last)."""

from __future__ import annotations

import json
from pathlib import Path


def _ms(seconds) -> str:
    return "–" if seconds is None else f"{seconds * 1e3:.1f} ms"


def _hook(data: dict) -> list[str]:
    lines = []
    for row in data.get("steps", []):
        if row["mode"] != "plain":
            lines.append(
                f"step {row['bucket_cap_mb']:g} MB {row['mode']}: +{_ms(row['added_s'])} "
                f"({row['added_over_backward']:.0%} of backward {_ms(row['plain_backward_s'])}), "
                f"drain {_ms(row.get('drain_s'))} (host {_ms(row.get('drain_host_s'))})"
            )
    for row in data.get("alone", []):
        lines.append(
            f"alone {row['bucket_cap_mb']:g} MB {row['mode']}: {_ms(row['seconds'])} on the device, "
            f"{_ms(row['host_s'])} issuing, {row['dispatches']} dispatches "
            f"({row['host_s_per_dispatch'] * 1e6:.1f} µs each), kernels {row['kernels']}"
        )
    return lines


def _sampled(data: dict) -> list[str]:
    return [
        f"{row['kind']} {row['mode']}: {_ms(row['seconds'])}, kernels {row['kernels']}, "
        f"{row['dispatches']} dispatches, host reads {row['host_reads_per_call']:g} a call"
        for row in data.get("alone", [])
    ]


def _outer(data: dict) -> list[str]:
    lines = []
    for row in data.get("rows", []):
        peak = row["peak_beyond_held_bytes"]
        lines.append(
            f"{row['model']} ({row['params'] / 1e9:.2f} B) {row['method']}: outer step {_ms(row['outer_step_s'])}, "
            f"{row['dispatches']} dispatches, peak beyond the training state "
            + ("–" if peak is None else f"{peak / 2**30:.2f} GiB")
        )
    return lines


def _tests(data: dict) -> list[str]:
    return [
        f"{run['run']}: exit {run['exit']}, {run['outcomes']}, {run['seconds']:.0f} s" for run in data.get("runs", [])
    ]


def _ncu(data: dict) -> list[str]:
    return [
        f"{row['method']} ({row['what']}): {row['kernels']} kernels, "
        f"{row['bytes_per_compressed_element']:.2f} B per compressed element"
        for row in data.get("rows", [])
    ]


HEADLINES = {"hook": _hook, "sampled": _sampled, "outer": _outer, "tests": _tests, "ncu": _ncu}


def summary_lines(out: Path, summary: dict) -> list[str]:
    """The table of parts (status, seconds, limit, errors) and each part's headline figures."""
    lines = [f"== summary: {summary.get('seconds', 0):.0f} s of a {summary['budget_s']:.0f} s budget; files in {out}"]
    for name, entry in summary["parts"].items():
        path = out / entry["file"]
        data = json.loads(path.read_text()) if path.exists() else {}
        errors, unavailable = len(data.get("errors", [])), len(data.get("unavailable", []))
        lines.append(
            f"{name:8} {entry['status']:24} {entry.get('seconds', 0):6.0f} s of {entry['limit_s']:4.0f}"
            f"  errors {errors}, not available {unavailable}"
        )
        try:
            lines += [f"    {line}" for line in HEADLINES.get(name, lambda _: [])(data)]
        except (KeyError, TypeError, ValueError) as error:  # a partial row: the file has it all
            lines.append(f"    (headline not read: {error!r})")
    return lines
