"""The engine's bytes and memory per compressed element, before and now, into docs/concepts/engine.md.

    python -m edgc_bench.engine_cost --out docs/engine/cost.json     # this engine, CPU, ~1 min
    python scripts/to_docs.py engine-cost                              # the block

Reads docs/engine/cost.json (this engine) and docs/engine/cost-before.json (the same command run on
the engine of commit 0eee217, which gathered the gradients into one copy per job, added it to the
error feedback and copied Ĝ back from a second one) and writes the ``engine-cost`` block: the
dispatches, the bytes per compressed element by op, the passes over the matrices beside their
floors, and the memory beyond the gradients. tests/bench/test_dispatch_count.py checks that
cost.json is this engine's and that the page shows it. Nothing is typed: every figure comes from
the two files.
"""

from __future__ import annotations

import json

from doc_blocks import ROOT, write

CURRENT, BEFORE = ROOT / "docs" / "engine" / "cost.json", ROOT / "docs" / "engine" / "cost-before.json"


def block(now: dict, before: dict) -> str:
    ops = list(dict.fromkeys([*now["bytes_by_op"], *before["bytes_by_op"]]))
    lines = ["| op | bytes per compressed element, before | now |", "| --- | ---: | ---: |"]
    for op in ops:
        cells = [
            f"{figures['bytes_by_op'][op]:.2f}" if op in figures["bytes_by_op"] else "–" for figures in (before, now)
        ]
        lines.append(f"| `{op}` | {cells[0]} | {cells[1]} |")
    lines.append(f"| **all ops** | **{before['bytes']:.2f}** | **{now['bytes']:.2f}** |")
    lines.append(
        f"| passes over M, G, e, Ĝ (rank-independent part) | {before['matrix_bytes']:.2f} | {now['matrix_bytes']:.2f} |"
    )
    floors, half = now["floors"], now["floors_gradient_error_feedback"]
    memory, memory_before = now["memory"], before["memory"]
    lines += [
        "",
        f"GPT-2 {now['model'].upper()} ({now['compressed_elements'] / 1e9:.2f} billion compressed elements), "
        f"{now['dtype']} gradients through the DDP hook, DDP's {now['bucket_cap_mb']} MB buckets fused into the "
        f"accelerator's jobs, rank {now['rank']}, torch {now['torch']}; counted on fake tensors by "
        "`python -m edgc_bench.engine_cost`.",
        "",
        f"- **Dispatches per step:** {before['dispatches']} before, {now['dispatches']} now.",
        f"- **Bytes:** the passes over M, G, e and Ĝ take {now['matrix_bytes']:.1f} B per compressed element "
        f"(before: {before['matrix_bytes']:.1f}); their floor is {floors['stock']} B with PyTorch's ops (M = G + e "
        f"into the error feedback, two products reading M, Ĝ written into the gradients, e = M − P·Qᵀ reading M "
        f"and writing e) and {floors['fused']} B with fused kernels (M formed inside the first product, Ĝ and e "
        f"written by one kernel). The factors, their casts and their orthonormalisation add "
        f"{now['bytes'] - now['matrix_bytes']:.1f} B. With error feedback in bf16: "
        f"{now['bytes_gradient_error_feedback']:.1f} B "
        f"in all (floors {half['stock']} and {half['fused']} B).",
        f"- **Memory beyond the gradients** (the most alive at once during the step, the error feedback and Q "
        f"included): {memory['float32']:.2f} B per compressed element with float32 error feedback (before: "
        f"{memory_before['float32']:.2f}), {memory['gradient']:.2f} B with error feedback in bf16 (before: "
        f"{memory_before['gradient']:.2f}).",
    ]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:  # no arguments: every input is committed
    page = write("engine-cost", block(json.loads(CURRENT.read_text()), json.loads(BEFORE.read_text())))
    print(f"wrote the engine-cost block of {page.relative_to(ROOT)}")
    return 0
