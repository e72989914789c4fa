"""Every step kind's kernels, bytes and memory per compressed element, into docs/concepts/engine.md.

    python -m edgc_bench.step_kinds --out docs/engine/step-kinds.json     # GPT-2 XL, rank 32, minutes
    python scripts/to_docs.py step-kinds                                   # the block

Reads docs/engine/step-kinds.json and writes the ``step-kinds`` block: per step kind (static,
sampled, rank change, torchft's uncommitted step) the dispatches, the bytes moved and the memory
beyond the gradients (live tensors at their peak, transient buffers included), the process's peak
on the CPU beside it, each against the limit it is held to; the sampled step again at a smaller
entropy sample; the DiLoCo outer sync's figures per parameter. tests/bench/test_step_kinds.py checks
that the file is this engine's and that the page shows it. Nothing is typed: every figure comes
from the file.
"""

from __future__ import annotations

import json

from doc_blocks import ROOT, write

FIGURES = ROOT / "docs" / "engine" / "step-kinds.json"
BEFORE = ROOT / "docs" / "engine" / "step-kinds-before.json"  # the engine before jobs over fixed buffers
# What a step at GPT-2 XL widths is held to (the hook at the device's pace): dispatches eager and with
# CUDA graphs, after the last bucket's entry, a sampled step's beyond a static one's, host reads a step
PACE_GOALS = {
    "static": 450,
    "static_graphs": 150,
    "after_last_bucket": 90,
    "sampled_extra": 30,
    "host_reads": 1,
    "histogram": 0.01,  # of the sampled step's bytes
}
PACE_BLOCKS = ("step-pace", "gpu-step-pace")  # the engine page's and the GPU page's
NAMES = {
    "static": "static",
    "sampled": "sampled (entropy sample, error measured)",
    "rank-change": "rank change (rank halved)",
    "torchft": "torchft (uncommitted, then committed)",
}


def _mark(value: float, limit: float) -> str:
    return f"{value:g}" if value <= limit else f"**{value:g}** (over {limit:g})"


def block(figures: dict) -> str:
    limits = figures["limits"]
    lines = [
        "| step kind | dispatches | bytes / element | memory / element, live tensors | CPU process peak / element |",
        "| --- | ---: | ---: | ---: | ---: |",
    ]
    for kind, row in figures["kinds"].items():
        cells = [
            NAMES[kind],
            _mark(row["dispatches"], limits["dispatches"]),
            _mark(row["bytes"], limits["bytes"]),
            _mark(row["memory"], limits.get(kind, limits["memory"])),
            f"{row['process']['peak_beyond_gradients']:g}",
        ]
        lines.append("| " + " | ".join(cells) + " |")
    small, outers = figures["sampled_small_cap"], figures["diloco"]
    layers = figures["kinds"]["static"]["process"]["layers"]
    lines += [
        "",
        f"GPT-2 {figures['model'].upper()}, rank {figures['rank']}, {figures['dtype']} gradients through the DDP hook, "
        f"DDP's buckets fused into the accelerator's jobs, torch {figures['torch']}; counted on fake tensors by "
        "`python -m edgc_bench.step_kinds` (the step's settle included, where a sampled step estimates its "
        f"entropy). Limits: {limits['dispatches']} dispatches, {limits['bytes']:g} B moved and {limits['memory']:g} B "
        f"of memory per compressed element ({limits['rank-change']:g} for a rank change while the old arena "
        f"lives, {limits['torchft']:g} for torchft's spare arena). The CPU process peak: the same step on real "
        f"tensors at XL widths with {layers} blocks, the process's peak resident memory during it beyond the "
        "gradients'; a CPU's mixed-dtype add (bf16 gradient into the fp32 error feedback) first casts the "
        "gradient whole, the largest matrix's at a time, which a GPU's kernel does as it reads.",
        "",
        f"- **Sampled step:** its entropy sample holds up to `EDGCConfig.entropy_sample_cap` = "
        f"{figures['entropy_sample_cap']:,} elements; at {small['entropy_sample_cap']:,} it moves "
        f"{small['bytes']:g} B per element ({small['dispatches']} dispatches, {small['memory']:g} B of memory).",
        f"- **DiLoCo outer sync** (`{outers[0]['method']}`, every parameter's fp32 pseudo-gradient as one "
        "flat buffer, one of N replica groups; memory per parameter beyond the pseudo-gradients, and beyond "
        "the error feedback too, the sender's and the chunk owner's):",
        "",
        "| model | parameters | groups | dispatches | collectives | rollback: dispatches | bytes moved / param "
        "| memory / param | beyond the error feedback | wire / param |",
        "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for outer in outers:
        lines.append(
            f"| GPT-2 {outer['model']} | {outer['params']:,} | {outer['groups']} | {outer['dispatches']} "
            f"| {outer['collectives']} | {outer['rollback_dispatches']} | {outer['bytes_per_param']:g} "
            f"| {outer['memory_per_param']:g} | {outer['transient_per_param']:g} | {outer['bytes_sent_per_param']:g} |"
        )
    return "\n".join(lines)


def _held(value: float, goal: float | None) -> str:
    return f"{value:,}" if goal is None or value <= goal else f"**{value:,}** (goal ≤ {goal:,})"


def _share(value: float | None, goal: float | None) -> str:
    if value is None:
        return "not counted"
    return f"{value:.2%}" if goal is None or value <= goal else f"**{value:.2%}** (goal ≤ {goal:.0%})"


def pace_block(figures: dict, before: dict) -> str:
    """The hook at the device's pace per model width (`edgc_bench.step_kinds.pace`), held to its goals at XL."""
    lines = [
        "| GPT-2 | buckets / matrices compressed | static step, eager | static, CUDA graphs on | sampled step "
        "| after the last bucket's entry: static / graphs / sampled | host reads: static / sampled "
        "| sampled bytes beyond static | its histogram's bytes |",
        "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for model, row in figures["pace"].items():
        goal = PACE_GOALS if model == "xl" else dict.fromkeys(PACE_GOALS)
        counts, tail, reads = row["dispatches"], row["after_last_bucket"], row["host_reads"]
        sampled_goal = None if goal["sampled_extra"] is None else counts["static"] + goal["sampled_extra"]
        cells = [
            model,
            f"{row['buckets']} / {row['compressed_matrices']}",
            _held(counts["static"], goal["static"]),
            f"{_held(counts['static_graphs'], goal['static_graphs'])} ({row['graph_replays']} replays)",
            _held(counts["sampled"], sampled_goal),
            " / ".join(  # the goal is a static step's: its last job alone
                [_held(tail["static"], goal["after_last_bucket"]), f"{tail['static_graphs']:,}", f"{tail['sampled']:,}"]
            ),
            " / ".join(_held(reads[kind], goal["host_reads"]) for kind in ("static", "sampled")),
            f"{row['sampled_extra_bytes_share']:.2%}",
            _share(row.get("histogram_bytes_share"), goal["histogram"]),
        ]
        lines.append("| " + " | ".join(cells) + " |")
    old, rank = before["kinds"], next(iter(figures["pace"].values()))["rank"]
    lines += [
        "",
        f"Rank {rank}, bfloat16 gradients through the DDP hook, DDP's default buckets fused into the "
        f"accelerator's jobs, torch {figures['torch']}; counted on fake tensors by "
        "`python -m edgc_bench.step_kinds --pace` (how dispatches are counted: below). With CUDA graphs on, a "
        "stretch the capture checker passes over four steady steps counts one launch per call; the CPU runs it "
        "eagerly, so whether cuSOLVER's calls capture is the GPU run's to see. Goals at XL: "
        f"{PACE_GOALS['static']} eager, {PACE_GOALS['static_graphs']} with graphs, "
        f"{PACE_GOALS['after_last_bucket']} after the last bucket's entry of a static step, a sampled step "
        f"at most {PACE_GOALS['sampled_extra']} beyond a static one, {PACE_GOALS['host_reads']} host read a "
        f"step, the histogram's bytes at most {PACE_GOALS['histogram']:.0%} of the sampled step's (counted "
        "over a sample of `entropy_sample_cap` elements, the most a decision's sample holds); a sampled "
        "step's bytes beyond a static one's are its sample's gather and histogram and its error measurement "
        f"together. Before (`docs/engine/step-kinds-before.json`, GPT-2 {before['model'].upper()}): "
        f"{old['static']['dispatches']:,} dispatches a static step, {old['sampled']['dispatches']:,} a sampled one.",
    ]
    xl = figures["pace"].get("xl", {})
    if "floors" in xl:
        lines += ["", _missed(xl, figures["limits"]["bytes"])]
    return "\n".join(lines)


def _sharing(matrices: int) -> str:
    if matrices == 0:
        return "no two compressed matrices of one shape share a bucket"
    return f"only {matrices} compressed matrices share a bucket with another of their shape"


def _missed(row: dict, bytes_limit: float) -> str:
    """Where the XL step misses its goals, and why, from the pace row's ``floors``."""
    floors, counts = row["floors"], row["dispatches"]
    static, per_gradient, extra = counts["static"], floors["per_gradient"], floors["sampled_extra"]
    copied = row["bytes"]["static"] + floors["copy_bytes_per_element"]
    parts = []
    if static > PACE_GOALS["static"]:
        parts.append(
            f"a static step eager is {static:,} against {PACE_GOALS['static']:,}: {per_gradient:,} of its dispatches "
            f"are per gradient, where DDP's buckets hold them ({row['compressed_matrices']} matrices: Ĝ = P·Qᵀ "
            "written into each, and M = G + e, a mixed-dtype add a GPU runs tensor by tensor); "
            f"{_sharing(floors['matrices_sharing_a_bucket_with_their_shape'])}, so a batched op per shape group "
            "would first copy the gradients into one "
            f"buffer: {floors['copy_bytes_per_element']} B more per element, {copied:.2f} B against the "
            f"{bytes_limit:g} B the step is held to. The other {static - per_gradient:,} are the jobs' factor "
            f"work and collectives. With CUDA graphs on, {counts['static_graphs']:,} against "
            f"{PACE_GOALS['static_graphs']:,}"
        )
    sampled_extra = counts["sampled"] - static
    if sampled_extra > PACE_GOALS["sampled_extra"]:
        parts.append(
            f"a sampled step adds {sampled_extra} against {PACE_GOALS['sampled_extra']}: the error measurement "
            f"{extra['error_measurement']} (‖M‖ and ‖e‖ of every job, each squared: M is overwritten by its residual "
            f"within the job), the entropy sample's gather {extra['sample_gather']} (one a job), the histogram "
            f"and the entropy {extra['histogram_and_entropy']} (once a step); within the goal only by measuring "
            "fewer jobs, a different estimate"
        )
    return "Where GPT-2 XL misses its goals: " + "; ".join(parts) + "." if parts else "GPT-2 XL holds every goal."


def main(argv: list[str] | None = None) -> int:  # no arguments: every input is committed
    figures = json.loads(FIGURES.read_text())
    page = write("step-kinds", block(figures))
    print(f"wrote the step-kinds block of {page.relative_to(ROOT)}")
    if "pace" in figures:
        text = pace_block(figures, json.loads(BEFORE.read_text()))
        for name in PACE_BLOCKS:
            page = write(name, text)
            print(f"wrote the {name} block of {page.relative_to(ROOT)}")
    return 0
