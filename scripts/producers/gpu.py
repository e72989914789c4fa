"""Copy the figures of GPU runs (`python -m edgc_bench.gpu --out DIR`) into docs/gpu.md and the README.

    python scripts/to_docs.py gpu RUN [--before BEFORE] [--profiled PROFILED]

A run in parts (the folder holds summary.json: hook.json, sampled.json, outer.json, tests.json,
ncu.json) is shown by scripts/producers/gpu_measured.py, beside BEFORE and PROFILED, the earlier run's two
folders: ``python scripts/to_docs.py gpu RUN --before docs/gpu/h200-2026-11-27 --profiled
docs/gpu/h200-2026-11-27-profiled``. Otherwise:

RUN and BEFORE are folders of a run's files: env.json, engine.json, overlap.json, device.json and,
where the run wrote them, count.json and trace_nccl.json.gz / trace_gloo.json.gz. With --before,
every figure the two runs share is shown as before → after. Writes the block between
``<!-- gpu-figures:start -->`` … ``end`` in docs/gpu.md and the shorter ``gpu`` block in README.md, and
docs/img/gpu_overlap.png from RUN's trace (the NCCL run's, with its injected delay, else gloo's)
when RUN has one. The first run's small files are kept in docs/gpu/before/, so
``python scripts/to_docs.py gpu docs/gpu/before`` rebuilds the docs from a clean clone (the
picture then stays as it is). Nothing is typed: every figure comes from the files.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from doc_blocks import ROOT, write  # finds the page that holds a block and replaces it

from edgc_bench import gpu_trace
from producers import gpu_measured, gpu_profiled
from producers.gpu_runs import (  # a run's files, its rows and cells
    GOAL_RATIO,
    GOAL_SHARE,
    alone_row,
    describe,
    goal_rank,
    largest,
    load_run,
    ratio,
    read_json,
    shown,
    step_row,
    verdict,
)
from producers.gpu_tables import (  # the figures' tables and lines
    alone_table,
    bucket_table,
    count_table,
    device_table,
    overlap_lines,
    problems,
    step_table,
    trace_lines,
)

FIGURES, SUMMARY = "gpu-figures", "gpu"  # the blocks of docs/gpu.md and of the README


def goals(run: dict) -> list[str]:
    """The GPU goals at the goal rank on the largest model, met or missed by how much."""
    model, rank = largest(run), goal_rank(run)
    if model is None:
        return ["- Goals: no engine figures in this run."]
    lines = []
    for dtype in ("bfloat16", "float32"):
        ours, theirs = alone_row(run, model, "edgc", dtype, rank), alone_row(run, model, "powersgd", dtype, rank)
        if ours and theirs:
            lines.append(
                f"- EDGC ÷ powerSGD_hook, each hook alone on {dtype} gradients, GPT-2 {model} rank {rank}: "
                + verdict(ratio(ours["seconds"], theirs["seconds"]), GOAL_RATIO, "×", ".2f")
                + "."
            )
    ours, theirs = step_row(run, model, "edgc", rank), step_row(run, model, "powersgd", rank)
    if ours and theirs:
        lines.append(
            f"- EDGC ÷ powerSGD_hook, the hook's share of a bf16 training step, GPT-2 {model} rank {rank}: "
            + verdict(ratio(ours["hook_s"], theirs["hook_s"]), GOAL_RATIO, "×", ".2f")
            + "."
        )
    if ours:
        lines.append(
            f"- EDGC's added step time ÷ backward, GPT-2 {model} rank {rank}: "
            + verdict(ours["hook_over_backward"] * 100, GOAL_SHARE * 100, " %", ".3g")
            + "."
        )
    alone = alone_row(run, model, "edgc", "bfloat16", rank)
    if alone and alone.get("plain_backward_s"):
        lines.append(
            f"- EDGC's hook alone ÷ backward (all of its work, none hidden), GPT-2 {model} rank {rank}: "
            + verdict(alone["seconds"] / alone["plain_backward_s"] * 100, GOAL_SHARE * 100, " %", ".3g")
            + "."
        )
    return lines


def picture(run: dict, image: Path) -> list[str]:
    """Draws ``image`` from RUN's trace; the line that shows it (and says where it came from)."""
    if run["trace"] is None or not gpu_trace.device_spans(trace := gpu_trace.read_trace(run["trace"])):
        return [
            f"![device work per stream](img/{image.name})",
            "",
            f"(`{shown(run['folder'])}` has no trace of device work: the picture above is kept from an earlier run.)",
        ]
    overlap = run["overlap"].get(run["trace"].name.removeprefix("trace_").removesuffix(".json.gz"), {})
    title = (
        f"{run['env'].get('device', '?')}: one compressed step, {overlap.get('backend', '?')}, "
        f"{overlap.get('world_size', '?')} process(es), GPT-2 {overlap.get('model', '?')}, "
        f"{overlap.get('delay_ms', 0):g} ms injected per all-reduce"
    )
    gpu_trace.plot(trace, image, title)
    return [
        f"![device work per stream](img/{image.name})",
        "",
        f"Device work per CUDA stream in the profiled step of `{shown(run['trace'])}`.",
    ]


def build(
    run: dict, before: dict | None, image: Path, current_count: dict | None = None
) -> tuple[list[str], list[str]]:
    """docs/gpu.md's block and the README's. ``current_count``: this checkout's dispatch count
    (docs/gpu/count), which the README states instead of the run's when given."""
    heads = [describe(run, "This run" if before else "The run")] + ([describe(before, "Before")] if before else [])
    model, rank = largest(run), goal_rank(run)
    docs = [*heads, "", f"**Goals** (GPT-2 {model}, rank {rank}):", "", *goals(run)]
    if before:
        docs += ["", "Before:", "", *goals(before)]
    docs += [
        "",
        "**The hooks in a training step** (DDP on NCCL, one process, bf16, DDP's default buckets; the hook's share "
        "is the hooked step minus the plain one):",
        "",
        *step_table(run, before),
    ]
    if run["engine"]["hook_alone"]:
        docs += [
            "",
            "**Each hook alone** (one backward's gradients in DDP's default buckets, restored before every call; "
            "ratio = EDGC ÷ powerSGD_hook; kernels from the profiler, dispatches from the CPU count):",
            "",
            *alone_table(run),
            "",
            f"**DDP's bucket size** (EDGC at rank {rank}):",
            "",
            *bucket_table(run),
        ]
    if run["count"] and "hook" in run["count"]:
        docs += [
            "",
            "**Dispatches of one compressed step, counted on the CPU** (`python -m edgc_bench.gpu --count-only`):",
            "",
            *count_table(run["count"]),
        ]
    docs += [
        "",
        "**Overlap and host reads:**",
        "",
        *overlap_lines(run, before),
        *trace_lines(run),
        "",
        *picture(run, image),
    ]
    if run["device"] and "measured" in run["device"]:
        docs += ["", "**The simulator's host profile on this GPU:**", "", *device_table(run, before)]
    if trouble := problems(run):
        docs += ["", "**What failed or was skipped in this run:**", "", *trouble]
    readme = [*heads, *goals(run)]
    if current_count:
        count, whose = current_count, "CPU count, this checkout's engine"
    else:
        count, whose = run["count"] or {}, "CPU count"
    xl = [row for row in count.get("hook", []) if row["model"] == model]
    if xl:
        readme.append(
            f"- Dispatches of one compressed step of GPT-2 {model} ({whose}): "
            + ", ".join(f"{row['dispatches']} at {row['bucket_cap_mb']:g} MB buckets" for row in xl)
            + "; [the recommended bucket size](docs/gpu.md#this-checkouts-engine)."
        )
    for key, result in run["overlap"].items():
        for line in overlap_lines({"overlap": {key: result}}, None):
            if "injected" in line:
                readme.append(f"- Overlap, the {key} run: w{line.removeprefix('  - W')}")
    readme.append("\nEvery figure, the trace's picture and the simulator comparison: [docs/gpu.md](docs/gpu.md).")
    return docs, readme


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="to_docs.py gpu", description=__doc__.strip().splitlines()[0])
    parser.add_argument("run", type=Path, help="the run's folder")
    parser.add_argument("--before", type=Path, help="an earlier run's folder, shown beside it")
    parser.add_argument("--profiled", type=Path, help="a profiled run's folder (scripts/producers/gpu_profiled.py)")
    args = parser.parse_args(argv)
    if (args.run / "summary.json").exists():  # a run in parts: --profiled is the earlier run's companion
        docs, readme = gpu_measured.build(gpu_measured.load(args.run), gpu_measured.load(args.before, args.profiled))
        for block, lines in ((FIGURES, docs), (SUMMARY, readme)):
            write(block, "\n".join(lines))
        return 0
    run, before = load_run(args.run), load_run(args.before) if args.before else None
    docs, readme = build(
        run, before, ROOT / "docs" / "img" / "gpu_overlap.png", read_json(ROOT / "docs" / "gpu" / "count", "count")
    )
    if args.profiled:
        more_docs, more_readme = gpu_profiled.sections(args.profiled)
        docs += more_docs
        readme[-1:-1] = more_readme  # before the closing line that points to the page
    for block, lines in ((FIGURES, docs), (SUMMARY, readme)):
        write(block, "\n".join(lines))
    return 0
