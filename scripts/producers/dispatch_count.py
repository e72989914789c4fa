"""The dispatch counts of this checkout's engine, and the DDP bucket size they recommend, into docs/gpu.md.

    python -m edgc_bench.gpu --count-only --out docs/gpu/count     # counts on the CPU (~30 s)
    python scripts/to_docs.py dispatch-count                        # the block below, and the README's line

Reads docs/gpu/count/count.json (this engine) and docs/gpu/before/count.json (the engine the first GPU
run measured, counted on the CPU afterwards) and writes the ``dispatch-counts`` block of docs/gpu.md.
tests/bench/test_dispatch_count.py checks that the committed count is this engine's, so a change to the
engine without a new count fails CI. Nothing is typed: every figure comes from the two files.
"""

from __future__ import annotations

import json

from doc_blocks import ROOT, write

CURRENT, BEFORE = ROOT / "docs" / "gpu" / "count" / "count.json", ROOT / "docs" / "gpu" / "before" / "count.json"
SIZES = ("medium", "large", "xl")


def rows(count: dict) -> dict[tuple[str, float], dict]:
    return {(row["model"], float(row["bucket_cap_mb"])): row for row in count["hook"]}


def recommended_cap(count: dict, model: str = "xl") -> float:
    """The DDP bucket size with the fewest dispatches for ``model`` (ties: the smaller, for overlap)."""
    candidates = [(row["dispatches"], float(row["bucket_cap_mb"])) for row in count["hook"] if row["model"] == model]
    return min(candidates)[1]


def block(current: dict, before: dict | None) -> str:
    now, then = rows(current), rows(before) if before else {}
    lines = [
        "| model | DDP bucket MB | dispatches, this engine | first GPU run's engine | linalg calls | "
        "collectives | host reads |",
        "| --- | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for (model, cap), row in sorted(now.items(), key=lambda item: (SIZES.index(item[0][0]), item[0][1])):
        old = then.get((model, cap), {}).get("dispatches", "–")
        label = f"{cap:g}{' (DDP default)' if row['ddp_default'] else ''}"
        lines.append(
            f"| {model} | {label} | {row['dispatches']} | {old} | {row['linalg']} | {row['collectives']} | "
            f"{row['host_reads']} |"
        )
    same = ", ".join(f"{row['matrices']} → {row['dispatches']}" for row in current["engine_same_shape"])
    shape = "×".join(map(str, current["engine_same_shape"][0]["shape"]))
    cap = recommended_cap(current)
    default = next(row for row in current["hook"] if row["model"] == "xl" and row["ddp_default"])
    best = rows(current)[("xl", cap)]
    lines += [
        "",
        f"One engine call on one bucket of same-shape {shape} matrices (matrices → dispatches): {same}.",
        f"Rank {current['rank']}, {current['dtype']} gradients, torch {current['torch']}; the GPU's path (DDP "
        f"buckets fused into jobs of `EDGCConfig.fusion_mb`, batched CholeskyQR2); counted: {current['rule']}.",
        "",
        f"**Bucket size.** Recommended: `bucket_cap_mb={cap:g}`, the fewest dispatches for GPT-2 XL "
        f"({best['dispatches']}). DDP's default buckets cost little more ({default['dispatches']}), since EDGC "
        "gathers consecutive buckets into jobs itself; which of the two is faster on a GPU, where the first "
        "job starts later with larger buckets, is for the next GPU run to measure.",
    ]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:  # no arguments: every input is committed
    current = json.loads(CURRENT.read_text())
    before = json.loads(BEFORE.read_text()) if BEFORE.exists() else None
    write("dispatch-counts", block(current, before))
    return 0
