"""What a compressed step costs the device besides its collectives: bytes moved and memory kept,
per compressed gradient element, counted on the CPU.

    python -m edgc_bench.engine_cost --out docs/engine/cost.json      # GPT-2 XL, ~1 min

One steady compressed step through the public DDP hook on GPT-2 ``--model``'s parameters in bf16,
DDP's default 25 MB buckets fused into the accelerator's jobs, rank ``--rank``, on the accelerator's
path (`edgc_probes.dispatch_count.count_hook_step`, fake tensors: nothing is allocated):
- ``bytes``: every kernel-launching op's inputs read and outputs written (`op_traffic`), per op;
- ``matrix_bytes``: the part that does not grow with the rank, the passes over M, G, e and Ĝ: the
  step counted at rank r and r/2, extrapolated to rank 0 (the factors P and Q, their casts and
  their orthonormalisation move bytes in proportion to r, the r × r Gram matrices aside);
- ``floors``: the fewest bytes those passes can take (`matrix_byte_floors`), with PyTorch's ops and
  with fused kernels;
- ``memory``: the most bytes alive at once beyond the gradients (`edgc_probes.live_memory`), the
  engine's state included, with float32 error feedback and with error feedback in the gradient's
  dtype (``error_feedback_dtype='gradient'``).
"""

from __future__ import annotations

import argparse
import json
from dataclasses import replace
from pathlib import Path

import torch

from edgc_probes.dispatch_count import StepCount, count_hook_step
from edgc_probes.gpt2_layout import gpt2_parameters
from edgc_probes.hook_steps import _static_config

GRADIENT_BYTES = 2  # bf16


def matrix_byte_floors(gradient: int, error: int) -> dict[str, int]:
    """Bytes per compressed element of the passes over M, G, e and Ĝ at their fewest, for gradients
    of ``gradient`` bytes and error feedback of ``error`` bytes per element.

    With PyTorch's ops: M = G + e into the error feedback (read G and e, write M), the two products
    that read M (P = M·Q, Q = Mᵀ·P), Ĝ written into the gradients, e = M − P·Qᵀ as a product that
    reads M and writes e. With fused kernels: M = G + e formed inside the P product (read G and e,
    write M), the Q product's read, and Ĝ and e = M − Ĝ written by one kernel that reads M once."""
    stock = (gradient + 2 * error) + 2 * error + gradient + 2 * error
    fused = (gradient + 2 * error) + error + (error + gradient + error)
    return {"stock": stock, "fused": fused}


def step(model: str, rank: int, error_feedback_dtype: str = "float32") -> StepCount:
    config = _static_config(rank)
    config = replace(config, engine=replace(config.engine, error_feedback_dtype=error_feedback_dtype))
    return count_hook_step(gpt2_parameters(model), rank=rank, dtype=torch.bfloat16, config=config)


def per_element(count: StepCount, value: float) -> float:
    return round(value / count.compressed_elements, 3)


def measure(model: str = "xl", rank: int = 32) -> dict:
    """The figures of the module docstring, as ``--out`` writes them."""
    full, half = step(model, rank), step(model, rank // 2)
    matrix = 2 * full.per_compressed_element(half.bytes) - full.per_compressed_element(full.bytes)
    gradient_dtype = step(model, rank, "gradient")
    return {
        "model": model,
        "rank": rank,
        "dtype": "bfloat16",
        "bucket_cap_mb": 25,
        "torch": torch.__version__,
        "compressed_elements": full.compressed_elements,
        "dispatches": full.dispatches,
        "bytes": per_element(full, full.bytes),
        "bytes_by_op": {
            name: per_element(full, value)
            for name, value in sorted(full.bytes_by_op.items(), key=lambda item: -item[1])
            if per_element(full, value) >= 0.005
        },
        "matrix_bytes": round(matrix, 2),
        "floors": matrix_byte_floors(GRADIENT_BYTES, 4),
        "memory": {
            "float32": per_element(full, full.peak_state_bytes),
            "gradient": per_element(gradient_dtype, gradient_dtype.peak_state_bytes),
        },
        "bytes_gradient_error_feedback": per_element(gradient_dtype, gradient_dtype.bytes),
        "floors_gradient_error_feedback": matrix_byte_floors(GRADIENT_BYTES, GRADIENT_BYTES),
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m edgc_bench.engine_cost", description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="xl")
    parser.add_argument("--rank", type=int, default=32)
    parser.add_argument("--out", type=Path, help="write the figures as JSON here")
    args = parser.parse_args(argv)
    emit(measure(args.model, args.rank), args.out)
    return 0


def emit(result: dict, out: Path | None) -> None:
    """Print the figures as JSON, and write them to ``out`` if given."""
    text = json.dumps(result, indent=1)
    if out:
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(text + "\n")
    print(text)


if __name__ == "__main__":
    raise SystemExit(main())
