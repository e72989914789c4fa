"""The mixed-precision comparison (bf16 against fp32 through EDGC's hook) into docs/integrations.md.

    python -m edgc_bench.mixed_precision --out docs/integrations/mixed-precision.json   # CPU, minutes
    python scripts/to_docs.py mixed-precision [FILE]                                    # the block

Reads the figures `edgc_bench.mixed_precision` wrote (default: the committed run) and writes the
``mixed-precision`` block. Nothing is typed.
"""

from __future__ import annotations

import json
from pathlib import Path

from doc_blocks import ROOT, write

BLOCK = "mixed-precision"
DEFAULT = ROOT / "docs" / "integrations" / "mixed-precision.json"


def percent(change: float) -> str:
    return f"{change:+.2%}".replace("%", " %")


def read(path: Path) -> dict:
    return json.loads(path.read_text())


def block(measured: dict) -> str:
    model, loss = measured["model"], measured["final_loss"]
    first, last = measured["final_loss_steps"]
    sent, wire = measured["bf16_over_fp32_bytes_sent"], measured["bfloat16_wire"]
    if sent["min"] == sent["max"]:
        ratio = f"{sent['min']:g} exactly"
    else:  # the one-element non-finite flag per DDP bucket: bf16 gradients fill fewer buckets
        ratio = f"{sent['min']:.6f} to {sent['max']:.6f} (one flag element per DDP bucket differs)"
    pq = wire["pq_bytes_ratio"]
    return "\n".join(
        [
            f"Measured (`python -m edgc_bench.mixed_precision`, tiny GPT-2: {model['layers']} layers, width "
            f"{model['width']}, vocab {model['vocab']}; {measured['processes']} processes; {measured['steps']} "
            f"steps, EDGC compressing from step {measured['first_compressed_step']}; the bf16 run keeps fp32 "
            f"master weights in the optimizer; torch {measured['torch']}):",
            "",
            "| | fp32 | bf16 |",
            "| --- | --- | --- |",
            f"| mean training loss, steps {first}–{last} | {loss['fp32']:.4f} | {loss['bf16']:.4f} "
            f"({percent(loss['bf16'] / loss['fp32'] - 1)}) |",
            f"| bytes sent per compressed step, bf16 / fp32 | | {ratio} on the {sent['steps']} compressed steps "
            "at equal ranks |",
            "",
            f"With fp32 gradients and `engine.communication_dtype='bfloat16'`, only P and Q halve (ratio "
            f"{pq:g}{' exactly' if pq == 0.5 else ''}); the uncompressed tensors (biases, LayerNorm) stay "
            f"fp32, so on this model the step's bytes fall to {wire['step_bytes_ratio']:.2f}×. With "
            "`engine.error_feedback_dtype='gradient'` (bf16 error feedback, half its memory) the bf16 run "
            f"ends at {loss['bf16_ef']:.4f} ({percent(loss['bf16_ef'] / loss['bf16'] - 1)} against fp32 error "
            "feedback).",
        ]
    )


def main(argv: list[str]) -> int:
    source = Path(argv[0]) if argv else DEFAULT
    page = write(BLOCK, block(read(source)))
    print(f"wrote the {BLOCK} block of {page.relative_to(ROOT)} from {source}")
    return 0
