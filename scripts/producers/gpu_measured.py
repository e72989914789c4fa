"""The figures of a GPU run in parts (`python -m edgc_bench.gpu`: summary.json, hook.json, sampled.json,
outer.json, tests.json, ncu.json) as docs/gpu.md's block and the README's, each beside the earlier
run's (``--before`` a whole run's folder, ``--profiled`` its profiled companion: engine.json with the
kernels, outer.json, hbm*.json) as before → after. scripts/to_docs.py gpu calls `build` when the run's
folder has a summary.json."""

from __future__ import annotations

from pathlib import Path

from producers.gpu_runs import DASH, GIB, describe, fmt, markdown_table, read_json, shown

GOAL_ADDED, GOAL_SAMPLED, GOAL_OUTER_S = 0.05, 0.10, 1.0  # ≤ 5 % of backward; ≤ a static step + 10 %; ≤ 1 s
MODEL, RANK = "xl", 32  # the goals' model and rank, when a run does not say


def load(folder: Path | None, profiled: Path | None = None) -> dict | None:
    """A run's files by part (an earlier run's engine.json, count.json, outer.json and hbm.json too)."""
    if folder is None:
        return None
    names = ("summary", "env", "hook", "sampled", "outer", "tests", "ncu", "engine", "count")
    run = {name: read_json(folder, name) or {} for name in names}
    run["folder"], run["profiled"] = folder, {}
    run["model"] = (run["hook"].get("settings") or run["sampled"].get("settings") or {}).get("size", MODEL)
    if profiled is not None:
        run["profiled"] = {name: read_json(profiled, name) or {} for name in ("engine", "outer", "hbm", "hbm_sampled")}
    return run


def _find(rows: list, **keys) -> dict | None:
    return next((row for row in rows or [] if all(row.get(k) == v for k, v in keys.items())), None)


def both(after, before, spec: str = ".3g", scale: float = 1.0) -> str:
    """``before → after`` (``after`` alone where no earlier run is given: ``before`` False)."""
    return fmt(after, spec, scale) if before is False else f"{fmt(before, spec, scale)} → {fmt(after, spec, scale)}"


def earlier(row: dict | None, before: dict | None):
    """What `both` is given for an earlier run's ``row``: a getter of its values, False with no earlier run."""
    if before is None:
        return lambda key: False
    return lambda key: (row or {}).get(key)


# ---------------------------------------------------------------------------- the earlier run's rows
def before_step(before: dict | None, cap, model: str) -> dict | None:
    """The earlier run's EDGC step at ``cap`` in the new files' keys (added = hook_s)."""
    if before is None:
        return None
    steps = before["engine"].get("steps", [])
    row = _find(steps, model=model, method="edgc", rank=RANK, bucket_cap_mb=cap)
    plain = _find(steps, model=model, method="none", bucket_cap_mb=cap)
    if row is None:
        return None
    return {
        "step_s": row["step_s"],
        "plain_step_s": plain and plain["step_s"],
        "added_s": row["hook_s"],
        "added_over_backward": row["hook_over_backward"],
        "hook_kernels": row.get("hook_kernels"),
    }


def before_alone(before: dict | None, cap, model: str, method: str = "edgc") -> dict | None:
    """The earlier run's hook alone (the profiled run's, with its kernels, else the whole run's)."""
    if before is None:
        return None
    for engine in (before["profiled"].get("engine", {}), before["engine"]):
        row = _find(engine.get("hook_alone", []), model=model, method=method, grad_dtype="bfloat16", bucket_cap_mb=cap)
        if row is not None:
            profile = row.get("kernel_profile") or {}
            busy = profile.get("device_s", 0) / row["seconds"] if profile else None
            count = _find(before["count"].get("hook", []), model=model, bucket_cap_mb=cap) if method == "edgc" else None
            return dict(row, busy=busy, dispatches=count and count["dispatches"])
    return None


def _cap(row: dict) -> str:
    return f"{row['bucket_cap_mb']:g}" + (" (default)" if row.get("ddp_default") else "")


# ---------------------------------------------------------------------------- the tables
def step_table(run: dict, before: dict | None) -> list[str]:
    rows = []
    for row in run["hook"].get("steps", []):
        if row["mode"] == "plain":
            continue
        was = before_step(before, row["bucket_cap_mb"], run["model"]) if row["mode"] == "eager" else None
        b = earlier(was, before)
        rows.append(
            [
                _cap(row),
                row["mode"],
                fmt(row["plain_step_s"], ".1f", 1e3),
                both(row["step_s"], b("step_s"), ".1f", 1e3),
                both(row["added_s"], b("added_s"), ".1f", 1e3),
                both(row["added_over_backward"], b("added_over_backward"), ".0%"),
                fmt(row.get("drain_s"), ".1f", 1e3),
                fmt(row.get("drain_host_s"), ".1f", 1e3),
                both(row.get("hook_kernels"), b("hook_kernels"), ""),
            ]
        )
    titles = ["DDP bucket MB", "mode", "plain step ms", "hooked step ms", "added ms", "added ÷ backward"]
    titles += ["drain ms (device)", "drain ms (host)", "hook's kernels"]
    return markdown_table(titles, "llrrrrrrr", rows)


def alone_table(run: dict, before: dict | None) -> list[str]:
    rows = []
    for row in run["hook"].get("alone", []):
        was = before_alone(before, row["bucket_cap_mb"], run["model"]) if row["mode"] == "eager" else None
        b = earlier(was, before)
        peak = row.get("peak_extra_bytes")
        rows.append(
            [
                _cap(row),
                row["mode"],
                both(row["seconds"], b("seconds"), ".1f", 1e3),
                fmt(row["host_s"], ".1f", 1e3),
                both(row["dispatches"], b("dispatches"), ""),
                fmt(row["host_s_per_dispatch"], ".1f", 1e6),
                both(row["kernels"], b("kernels"), ""),
                both(row.get("busy"), b("busy"), ".0%"),
                fmt(row.get("region_calls_per_call", {}).get("replay"), ".0f"),
                DASH if peak is None else f"{peak / GIB:.2f}",
            ]
        )
    titles = ["DDP bucket MB", "mode", "device ms", "host ms issuing", "dispatches", "host µs a dispatch"]
    titles += ["kernels", "busy", "graph replays a call", "peak beyond the gradients GiB"]
    return markdown_table(titles, "llrrrrrrrr", rows)


def sampled_table(run: dict, before: dict | None) -> list[str]:
    rows = []
    for row in run["sampled"].get("alone", []):
        method = "edgc-sampled" if row["kind"] == "sampled" else "edgc"
        was = before_alone(before, 25, run["model"], method) if row["mode"] == "eager" else None
        b = earlier(was, before)
        rows.append(
            [
                row["kind"],
                row["mode"],
                both(row["seconds"], b("seconds"), ".1f", 1e3),
                both(row["kernels"], b("kernels"), ""),
                fmt(row["dispatches"], ""),
                fmt(row["host_reads_per_call"], "g"),
                DASH if row.get("peak_extra_bytes") is None else f"{row['peak_extra_bytes'] / GIB:.2f}",
            ]
        )
    titles = ["step", "mode", "hook alone ms", "kernels", "dispatches", "host reads a call", "peak GiB"]
    return markdown_table(titles, "llrrrrr", rows)


def outer_table(run: dict, before: dict | None) -> list[str]:
    measured_before = [] if before is None else before["profiled"].get("outer", {}).get("rows", [])
    rows = []
    for row in run["outer"].get("rows", []):
        was = _find(measured_before, model=row["model"], method=row["method"].removesuffix("-2s"))
        b = earlier(was, before)
        held = row.get("peak_beyond_held_bytes")
        rows.append(
            [
                row["model"] + (" (the largest that fits)" if row.get("largest") else ""),
                f"{row['params'] / 1e9:.2f}",
                row["method"] if not was or was["method"] == row["method"] else f"{was['method']} → {row['method']}",
                both(row["outer_step_s"], b("outer_step_s"), ".0f", 1e3),
                fmt(row["inner_step_s"], ".1f", 1e3),
                fmt(row["dispatches"], ""),
                both(row.get("peak_beyond_held_bytes_per_param"), b("peak_beyond_held_bytes_per_param"), ".1f"),
                DASH if held is None else f"{held / GIB:.1f}",
            ]
        )
    titles = ["model", "params (B)", "outer sync", "outer step ms", "inner step ms", "dispatches"]
    titles += ["peak beyond the training state B/param", "GiB"]
    return markdown_table(titles, "lrlrrrrr", rows)


def test_lines(run: dict) -> list[str]:
    lines = []
    for entry in run["tests"].get("runs", []):
        outcome = ", ".join(f"{n} {kind}" for kind, n in sorted(entry["outcomes"].items())) or "no test reported"
        status = "ran out of time" if entry["timed_out"] else f"exit {entry['exit']}"
        command = " ".join(entry["arguments"])
        lines.append(f"- `pytest {command}` ({entry['run']}): {outcome}; {status}, {entry['seconds']:.0f} s.")
        lines += [
            f"  - {case['test']}: {case['outcome']}: {case['message'][:300]}"
            for case in entry["tests"]
            if case["outcome"] in ("failed", "error")
        ]
    return lines


def ncu_lines(run: dict, before: dict | None) -> list[str]:
    earlier = {} if before is None else before["profiled"]
    lines = []
    for row in run["ncu"].get("rows", []):
        was = (
            _find(earlier.get("hbm", {}).get("rows", []), method=row["method"]) if not row.get("only_kernels") else None
        )
        value = row["bytes_per_compressed_element"]
        shown_value = fmt(value, ".1f") if was is None else both(value, was["bytes_per_compressed_element"], ".1f")
        lines.append(
            f"- {row['method']}, {row['what']} ({row['kernels']} kernels): {shown_value} B per compressed element "
            f"({row['bytes_read'] / 1e9:.2f} GB read, {row['bytes_written'] / 1e9:.2f} GB written)."
        )
    for error in run["ncu"].get("errors", []):
        lines.append(f"- {error.get('method', '?')}: not measured: `{error['error'].strip().splitlines()[-1][:200]}`.")
    return lines


def goals(run: dict, before: dict | None) -> list[str]:
    """The goals of the run at GPT-2 XL rank 32, with how far from each."""
    lines = []
    for row in run["hook"].get("steps", []):
        if row["mode"] != "plain":
            was = before_step(before, row["bucket_cap_mb"], run["model"]) if row["mode"] == "eager" else None
            value = row["added_over_backward"]
            lines.append(
                f"- Added step time ÷ backward, {_cap(row)} MB buckets, {row['mode']}: "
                + (f"{was['added_over_backward']:.0%} → " if was else "")
                + f"{value:.1%}: {'met' if value <= GOAL_ADDED else f'missed by {value - GOAL_ADDED:.1%} of backward'} "
                f"(goal ≤ {GOAL_ADDED:.0%})."
            )
    for mode in ("eager", "graphs"):
        static = _find(run["sampled"].get("alone", []), kind="static", mode=mode)
        sampled = _find(run["sampled"].get("alone", []), kind="sampled", mode=mode)
        if static and sampled:
            extra = sampled["seconds"] / static["seconds"] - 1
            lines.append(
                f"- A sampled step against a static one, {mode}: +{extra:.0%}: "
                + ("met" if extra <= GOAL_SAMPLED else f"missed by {extra - GOAL_SAMPLED:.0%}")
                + f" (goal ≤ +{GOAL_SAMPLED:.0%})."
            )
    for row in run["outer"].get("rows", []):
        if not row.get("largest"):
            value = row["outer_step_s"]
            verdict = "met" if value <= GOAL_OUTER_S else f"missed by {value - GOAL_OUTER_S:.2f} s"
            lines.append(
                f"- One DiLoCo outer step, GPT-2 {row['model']} ({row['method']}): {value:.2f} s: {verdict} "
                "(goal ≤ 1 s)."
            )
    return lines or ["- Goals: none of their figures is in this run."]


def status_lines(run: dict) -> list[str]:
    lines = []
    for name, entry in run["summary"].get("parts", {}).items():
        data = run.get(name) or {}
        extra = [f"{len(data.get('errors', []))} errors"] if data.get("errors") else []
        extra += [f"not available: {data['unavailable'][0]['reason']}"] if data.get("unavailable") else []
        lines.append(
            f"- {name}: {entry['status']}, {entry.get('seconds', 0):.0f} s of {entry['limit_s']:.0f}"
            + "".join(f"; {e}" for e in extra)
            + "."
        )
    return lines


def build(run: dict, before: dict | None) -> tuple[list[str], list[str]]:
    """docs/gpu.md's block and the README's."""
    heads = [describe({"folder": run["folder"], "env": run["env"]}, "This run" if before else "The run")]
    if before:
        heads.append(describe({"folder": before["folder"], "env": before["env"]}, "Before"))
    rank = (run["hook"].get("settings") or {}).get("rank", RANK)
    intro = f"GPT-2 {run['model']}, rank {rank}, bf16 gradients; DDP on NCCL, one process"
    docs = [*heads, "", f"**Goals** ({intro}):", "", *goals(run, before)]
    docs += [
        "",
        f"**The hook in a training step** ({intro}; added = hooked step − plain step; the drain: from "
        "the last bucket's hook call to backward's end):",
        "",
        *step_table(run, before),
    ]
    docs += [
        "",
        "**The hook alone** (one backward's gradients in DDP's buckets; dispatches counted on the device "
        "by edgc_probes.dispatch_count's rule, before: the CPU's count; busy = the kernels' time ÷ the call's):",
        "",
        *alone_table(run, before),
    ]
    docs += [
        "",
        "**A sampled step against a static one** (the hook alone, DDP's default buckets, random gradients "
        "of the model's shapes):",
        "",
        *sampled_table(run, before),
    ]
    docs += [
        "",
        "**One DiLoCo outer step** (one process, fp32 parameters, AdamW inner; peak beyond the training state):",
        "",
        *outer_table(run, before),
    ]
    docs += ["", "**tests/gpu:**", "", *(test_lines(run) or ["- not run."])]
    docs += ["", "**HBM bytes, Nsight Compute:**", "", *(ncu_lines(run, before) or ["- not measured."])]
    docs += ["", f"**The run's parts** (`{shown(run['folder'])}/summary.json`):", "", *status_lines(run)]
    readme = [*heads, *goals(run, before)]
    readme.append("\nEvery figure, before → after: [docs/gpu.md](docs/gpu.md).")
    return docs, readme
