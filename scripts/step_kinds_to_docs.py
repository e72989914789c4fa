"""Every step kind's kernels, bytes and memory per compressed element, into docs/concepts/engine.md.

    python -m edgc_bench.step_kinds --out docs/engine/step-kinds.json     # GPT-2 XL, rank 32, minutes
    python scripts/step_kinds_to_docs.py                                   # the block

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
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from doc_blocks import write  # noqa: E402

REPO = Path(__file__).resolve().parent.parent
FIGURES = REPO / "docs" / "engine" / "step-kinds.json"
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


def main(argv: list[str] | None = None) -> int:  # no arguments: every input is committed
    page = write("step-kinds", block(json.loads(FIGURES.read_text())))
    print(f"wrote the step-kinds block of {page.relative_to(REPO)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
