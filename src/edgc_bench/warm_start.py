"""The warm start's orthonormalisation: how many passes, measured by what the engine sends.

    python -m edgc_bench.warm_start --out DIR        # DIR/warm_start.json, a minute on one core

The engine orthonormalises the warm-start Q before P = M·Q (`edgc.engine.stretches.WARM_START_PASSES`).
In exact arithmetic it changes nothing: M·Q·R⁻¹ spans what M·Q spans for any invertible R, and P is
orthonormalised fully after its average. It only conditions Q, so that P's float32 product keeps its
weak directions. This runs the engine (the accelerator's kernels on the CPU: float64 CholeskyQR2,
or the float32 four-pass method) over a sequence of gradients with a given spread of singular values
(low-rank plus noise, the spectrum's top r decaying by ``spread``), once with one pass and once with
the method's full passes, from the same start, and reports each one's relative error ‖M − Ĝ‖/‖M‖
step by step and the largest relative difference of their Ĝ: what a pass fewer costs in accuracy.
"""

from __future__ import annotations

import argparse
import math
from pathlib import Path

import torch

from .engine_cost import emit

SHAPES = ((512, 1536), (512, 512), (2048, 512), (512, 2048))  # GPT-2's four shapes at width 512


def gradients(steps: int, spread: float, seed: int = 0, rank: int = 32):
    """``steps`` lists of gradients (float32) of `SHAPES`: rank-``rank`` matrices whose singular values fall
    by ``spread`` across the top ``rank``, times per-step noise of 10 %, plus a full-rank floor."""
    generator = torch.Generator().manual_seed(seed)
    bases = []
    for m, n in SHAPES:
        u, _ = torch.linalg.qr(torch.randn(m, rank, generator=generator))
        v, _ = torch.linalg.qr(torch.randn(n, rank, generator=generator))
        bases.append((u, torch.logspace(0, -math.log10(spread), rank), v))
    for _ in range(steps):
        yield [
            (u * (s * (1 + 0.1 * torch.randn(s.shape, generator=generator)))) @ v.T
            + 1e-4 * torch.randn(u.shape[0], v.shape[0], generator=generator)
            for u, s, v in bases
        ]


def run(passes: int | None, spread: float, method: str, steps: int, rank: int) -> tuple[list, list]:
    """(relative error per step, Ĝ per step) of the engine with ``passes`` warm-start passes (None: all)."""
    from edgc import LowRankCompressor, LowRankConfig
    from edgc.engine import stretches
    from edgc_probes.stand_ins import counting_communicator

    kept, stretches.WARM_START_PASSES = stretches.WARM_START_PASSES, passes
    try:
        compressor = LowRankCompressor(LowRankConfig(force_accelerator_kernels=True, orthonormalization=method))
        communicator, names = counting_communicator(1), [f"w{k}" for k in range(len(SHAPES))]
        errors, estimates = [], []
        for grads in gradients(steps, spread, rank=rank):
            stats = compressor.reduce(names, grads, rank, communicator, measure_error=True)
            errors.append(math.sqrt(float(stats.error_sq) / float(stats.norm_sq)))
            estimates.append(grads)
    finally:
        stretches.WARM_START_PASSES = kept
    return errors, estimates


def measure(steps: int = 30, rank: int = 32) -> dict:
    rows = []
    for method in ("cholesky2-fp64", "cholesky4-fp32"):
        for spread in (1e2, 1e4, 1e6):
            one, one_g = run(1, spread, method, steps, rank)
            full, full_g = run(None, spread, method, steps, rank)
            apart = max(
                float((a - b).norm() / b.norm())
                for step_a, step_b in zip(one_g, full_g)
                for a, b in zip(step_a, step_b)
            )
            rows.append(
                {
                    "method": method,
                    "spread": spread,
                    "relative_error_one_pass": round(sum(one) / steps, 6),
                    "relative_error_all_passes": round(sum(full) / steps, 6),
                    "largest_relative_difference_of_g": float(f"{apart:.3g}"),
                }
            )
    return {"steps": steps, "rank": rank, "shapes": [list(s) for s in SHAPES], "torch": torch.__version__, "rows": rows}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m edgc_bench.warm_start", description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--out", type=Path, help="write DIR/warm_start.json")
    args = parser.parse_args(argv)
    emit(measure(args.steps), args.out / "warm_start.json" if args.out else None)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
