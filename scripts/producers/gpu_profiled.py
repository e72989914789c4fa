"""The profiled GPU run's sections of docs/gpu.md and the README (`scripts/to_docs.py gpu --profiled DIR`).

DIR holds what one call of the device tool wrote with

    python -m edgc_bench.gpu --out DIR --parts env,engine --sizes xl --ranks 32 --skip-steps
    python -m edgc_bench.gpu --out DIR --parts outer --outer-sizes xl,medium
    python -m edgc_bench.gpu_hbm --out DIR

(``engine.json`` whose hook rows carry a ``kernel_profile``, ``outer.json``, ``hbm*.json``). Each
figure is read from those files, and the CPU's count beside it from docs/engine/cost.json
(`python -m edgc_bench.engine_cost`).
"""

from __future__ import annotations

import json
from pathlib import Path

from doc_blocks import ROOT

DASH = "–"


def _read(path: Path):
    return json.loads(path.read_text()) if path.exists() else None


def load(folder: Path) -> dict:
    hbm = {"rows": [], "errors": []}
    for path in sorted(folder.glob("hbm*.json")):
        found = _read(path)
        hbm["rows"] += found.get("rows", [])
        hbm["errors"] += found.get("errors", [])
    return {
        "folder": folder,
        "env": _read(folder / "env.json") or {},
        "engine": _read(folder / "engine.json") or {"hook_alone": [], "errors": []},
        "outer": _read(folder / "outer.json") or {"rows": [], "errors": []},
        "hbm": hbm,
        "cost": _read(ROOT / "docs" / "engine" / "cost.json") or {},
    }


def _table(titles: list[str], align: str, rows: list[list[str]]) -> list[str]:
    rule = "|" + "".join(" --- |" if side == "l" else " ---: |" for side in align)
    return ["| " + " | ".join(titles) + " |", rule, *("| " + " | ".join(row) + " |" for row in rows)]


def _kernel_name(name: str, width: int = 48) -> str:
    short = name.removeprefix("void ").split("(")[0].split("<")[0]
    return f"`{short[:width]}`"


def profile_table(run: dict) -> list[str]:
    """Where a hook's time went on the device: wall time against the kernels' summed time."""
    rows = []
    for row in run["engine"]["hook_alone"]:
        profile = row.get("kernel_profile")
        if not profile:
            continue
        top_name, _, top_s = profile["top"][0] if profile["top"] else ("", 0, 0.0)
        rows.append(
            [
                row["model"],
                row["method"],
                row["grad_dtype"],
                f"{row['bucket_cap_mb']:g}",
                f"{row['seconds'] * 1e3:.1f}",
                str(profile["kernels"]),
                f"{profile['device_s'] * 1e3:.1f}",
                f"{profile['device_s'] / row['seconds']:.0%}",
                f"{_kernel_name(top_name)} {top_s / max(profile['device_s'], 1e-12):.0%}",
            ]
        )
    titles = ["model", "hook", "gradients", "bucket MB", "wall ms", "kernels", "kernels' time ms", "busy"]
    return _table([*titles, "the longest kernel, its share"], "lllrrrrrl", rows)


def _alone(run: dict, method: str) -> dict | None:
    return next(
        (
            r
            for r in run["engine"]["hook_alone"]
            if r["method"] == method and r["grad_dtype"] == "bfloat16" and r.get("ddp_default")
        ),
        None,
    )


def bytes_lines(run: dict) -> list[str]:
    """HBM bytes (ncu) and peak memory (the caching allocator) per compressed element, beside the CPU's count."""
    cost, lines = run["cost"], []
    for row in run["hbm"]["rows"]:
        counted = cost.get("bytes") if row["method"] == "edgc" and row["rank"] == cost.get("rank") else None
        lines.append(
            f"- HBM bytes of one {row['method']} hook call, GPT-2 {row['model']} rank {row['rank']}, bf16 "
            f"({row['source']}, {row['kernels']} kernels): {row['bytes_per_compressed_element']:.1f} B per compressed "
            f"element ({row['bytes_read'] / 1e9:.1f} GB read, {row['bytes_written'] / 1e9:.1f} GB written); "
            + (
                f"counted on the CPU: {counted:.1f} (`docs/engine/cost.json`)."
                if counted
                else "no CPU count beside it."
            )
        )
    for error in run["hbm"]["errors"]:
        lines.append(f"- HBM bytes of the {error['method']} hook: not measured: `{error['error'][:160]}`.")
    elements = run["hbm"]["rows"][0]["compressed_elements"] if run["hbm"]["rows"] else None
    counted_memory = cost.get("memory", {})
    for method, key in (("edgc", "float32"), ("edgc-bf16-ef", "gradient"), ("edgc-sampled", None)):
        row = _alone(run, method)
        if row is None or elements is None or row.get("peak_extra_bytes") is None:
            continue
        beside = counted_memory.get(key) if key else None
        lines.append(
            f"- Peak memory beyond the gradients, {method}, GPT-2 {row['model']} rank {row['rank']}: "
            f"{row['peak_extra_bytes'] / elements:.2f} B per compressed element (the caching allocator's peak); "
            + (f"counted on the CPU: {beside:.2f}." if beside is not None else "no CPU count beside it.")
        )
    static, sampled = _alone(run, "edgc"), _alone(run, "edgc-sampled")
    if static and sampled:
        lines.append(
            f"- A sampled step against a static one (hook alone, GPT-2 {static['model']} rank {static['rank']}): "
            f"{sampled['seconds'] * 1e3:.1f} ms against {static['seconds'] * 1e3:.1f} ms, "
            f"{sampled['kernels']} kernels against {static['kernels']}."
        )
    return lines


def outer_table(run: dict) -> list[str]:
    rows = [
        [
            row["model"],
            f"{row['params'] / 1e9:.2f}",
            row["method"],
            f"{row['outer_step_s'] * 1e3:.0f}",
            f"{row['inner_step_s'] * 1e3:.1f}",
            f"{row['peak_beyond_held_bytes_per_param']:.1f}",
            f"{row['peak_beyond_held_bytes'] / 2**30:.1f}",
        ]
        for row in run["outer"]["rows"]
    ]
    titles = ["model", "params (B)", "outer sync", "outer step ms", "inner step ms", "peak B/param", "peak GiB"]
    lines = _table(titles, "lrlrrrr", rows)
    for error in run["outer"]["errors"]:
        lines.append(f"- {error['model']} {error['method']}: failed: `{error['error'].strip().splitlines()[-1]}`")
    return lines


def sections(folder: Path) -> tuple[list[str], list[str]]:
    """(docs/gpu.md's lines, the README's lines) of the profiled run in ``folder``."""
    run = load(folder)
    env = run["env"]
    where = (
        f"`{folder.resolve().relative_to(ROOT) if folder.resolve().is_relative_to(ROOT) else folder}`: "
        f"{env.get('device', '?')}, torch {env.get('torch', '?')}, CUDA {env.get('cuda', DASH)}, {env.get('date', '?')}"
    )
    docs = [
        "",
        f"**Where a hook's time goes** (the profiled run, {where}; one call of each hook alone over one backward's "
        "gradients, torch.profiler's kernel list; busy = the kernels' summed time ÷ the call's wall time):",
        "",
        *profile_table(run),
        "",
        "**Bytes and memory on the device, beside the CPU's count:**",
        "",
        *bytes_lines(run),
        "",
        "**One DiLoCo outer step** (one process, NCCL, fp32 parameters, AdamW inner, θ_global in pinned host memory; "
        "the outer step's time is the inner optimizer's step that runs it minus a plain one; its memory is the peak "
        "during that step beyond what the process held just before it):",
        "",
        *outer_table(run),
    ]
    readme = [line for line in bytes_lines(run) if line.startswith(("- HBM bytes of one", "- A sampled step"))]
    for row in run["outer"]["rows"]:
        if row["method"] != "bf16":
            readme.append(
                f"- One DiLoCo outer step with the {row['method']} sync, GPT-2 {row['model']} "
                f"({row['params'] / 1e9:.2f}B parameters): {row['outer_step_s'] * 1e3:.0f} ms, "
                f"{row['peak_beyond_held_bytes_per_param']:.1f} B per parameter at its peak beyond the training state."
            )
    return docs, readme
