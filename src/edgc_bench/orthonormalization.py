"""The engine's orthonormalisation against batched Householder QR, at equal inputs.

    python -m edgc_bench.orthonormalization [--device cuda] [--out FILE]

PowerSGD orthonormalises P (or Q) before it goes on: an error there is an error in every
gradient. Ways to orthonormalise the rows of a (count, r, k) batch, each one batched call
per batch (no per-matrix library call):

- ``cholesky2-fp64``: what the engine runs on an accelerator with fast float64
  (`edgc.engine.factors.orthonormalize_rows_`): shifted CholeskyQR2, two passes in float64;
- ``cholesky4-fp32``: what it runs on other accelerators: shifted CholeskyQR in float32, four passes;
- ``cholesky-fp64``: one such pass (what the engine ran before; its weak directions shrink);
- ``cholesky2-fp32``: CholeskyQR2, two unshifted passes in float32 (the textbook batched choice);
- ``householder-fp32`` / ``householder-fp64``: ``torch.linalg.qr`` on the batch (geqrf + orgqr);
  float32 is what the engine runs on a CPU.

The inputs are seeded float32 batches X = U·diag(s)·Vᵀ with singular values log-spaced from 1 to
1/κ, for several condition numbers κ, plus a rank-deficient batch (a zero row and a repeated one,
as a layer without gradient or a collapsed power iteration gives). Per method and input:

- ``orthogonality``: max over the batch of ‖YYᵀ − I‖_F over the rows that carry energy;
- ``residual``: max over the batch of ‖X − XYᵀY‖_F / ‖X‖_F, how much of X the rows miss (what a
  PowerSGD approximation loses; 0 for an exact basis);
- ``finite``: whether every output is finite (a NaN here poisons the step);
- ``seconds``: median per call over the repeats (device events on a GPU) and ``seconds_range``,
  their min and max; ``dispatches`` per call (the
  kernel-launching ATen dispatches of `edgc_probes.dispatch_count`; a ``linalg_*`` dispatch is
  several kernels on a GPU).
"""

from __future__ import annotations

import argparse
import json
import math
from collections.abc import Callable
from pathlib import Path

import torch

from edgc.engine.factors import orthonormalize_rows_
from edgc_probes.dispatch_count import DispatchCounter

from .gpu_support import DeviceTimer, median

CONDITIONS = (1e1, 1e3, 1e5, 1e7)
# Rank-32 blocks on GPT-2 XL's width, 1600 (the side of most of its P blocks), of 48 and 96 matrices.
SHAPES = ((48, 32, 1600), (96, 32, 1600))
# Energy below this share of the largest row's marks a row as empty (the rank-deficient input).
EMPTY_ROW = 1e-6


def _cholesky_pass(x: torch.Tensor, shift: float = 0.0) -> torch.Tensor:
    gram = x @ x.transpose(-1, -2)
    diagonal = gram.diagonal(dim1=-2, dim2=-1)
    diagonal.add_(diagonal.mean(-1, keepdim=True), alpha=shift)
    lower, _ = torch.linalg.cholesky_ex(gram)
    return torch.linalg.solve_triangular(lower, x, upper=False)


def cholesky2_fp64(rows: torch.Tensor) -> torch.Tensor:
    return orthonormalize_rows_(rows.clone(), method="cholesky2-fp64")


def cholesky4_fp32(rows: torch.Tensor) -> torch.Tensor:
    return orthonormalize_rows_(rows.clone(), method="cholesky4-fp32")


def cholesky_fp64(rows: torch.Tensor) -> torch.Tensor:
    return _cholesky_pass(rows.double(), shift=1e-8).to(rows.dtype)


def cholesky2_fp32(rows: torch.Tensor) -> torch.Tensor:
    return _cholesky_pass(_cholesky_pass(rows.float()))


def householder(dtype: torch.dtype) -> Callable[[torch.Tensor], torch.Tensor]:
    def orthonormalize(rows: torch.Tensor) -> torch.Tensor:
        q, _ = torch.linalg.qr(rows.to(dtype).transpose(-1, -2))
        return q.transpose(-1, -2).to(rows.dtype)

    return orthonormalize


METHODS: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "cholesky2-fp64": cholesky2_fp64,
    "cholesky4-fp32": cholesky4_fp32,
    "cholesky-fp64": cholesky_fp64,
    "cholesky2-fp32": cholesky2_fp32,
    "householder-fp32": householder(torch.float32),
    "householder-fp64": householder(torch.float64),
}


def conditioned(
    count: int, rank: int, side: int, condition: float, device: torch.device, seed: int = 0
) -> torch.Tensor:
    """A float32 (count, rank, side) batch whose matrices have condition number ``condition``."""
    generator = torch.Generator().manual_seed(seed)
    u, _ = torch.linalg.qr(torch.randn(count, rank, rank, generator=generator, dtype=torch.float64))
    v, _ = torch.linalg.qr(torch.randn(count, side, rank, generator=generator, dtype=torch.float64))
    singular = torch.logspace(0, -math.log10(condition), rank, dtype=torch.float64)
    return ((u * singular) @ v.transpose(-1, -2)).float().to(device)


def rank_deficient(count: int, rank: int, side: int, device: torch.device, seed: int = 0) -> torch.Tensor:
    """Well-conditioned rows, except a zero row and a row repeated, in every matrix."""
    rows = conditioned(count, rank, side, 10.0, device, seed)
    rows[:, -1] = 0
    rows[:, -2] = rows[:, 0]
    return rows


def quality(original: torch.Tensor, result: torch.Tensor) -> dict:
    """Orthogonality of the rows that carry energy, and how much of ``original`` they miss."""
    x, y = original.double(), result.double()
    if not torch.isfinite(y).all():
        return {"finite": False, "orthogonality": None, "residual": None}
    energy = y.pow(2).sum(-1)
    kept = energy > EMPTY_ROW * energy.amax(-1, keepdim=True)
    gram = y @ y.transpose(-1, -2)
    mask = (kept.unsqueeze(-1) & kept.unsqueeze(-2)).double()
    eye = torch.eye(y.shape[-2], dtype=torch.float64, device=y.device)
    orthogonality = ((gram - eye) * mask).flatten(1).norm(dim=1).max()
    residual = (x - (x @ y.transpose(-1, -2)) @ y).flatten(1).norm(dim=1) / x.flatten(1).norm(dim=1)
    return {"finite": True, "orthogonality": orthogonality.item(), "residual": residual.max().item()}


def cost(method: Callable[[torch.Tensor], torch.Tensor], rows: torch.Tensor, repeats: int) -> dict:
    timer = DeviceTimer(rows.device)
    method(rows)  # warm-up: workspace allocation, library handles
    seconds = []
    for _ in range(repeats):
        start = timer.mark()
        method(rows)
        seconds.append(timer.seconds(start, timer.mark()))
    with DispatchCounter() as counter:
        method(rows)
    return {"seconds": median(seconds), "seconds_range": [min(seconds), max(seconds)], "dispatches": counter.total}


def compare(device: torch.device, shapes=SHAPES, conditions=CONDITIONS, repeats: int = 5) -> list[dict]:
    """One row per (shape, input, method): quality on that input, cost on the κ = 10 input."""
    rows = []
    for count, rank, side in shapes:
        inputs = {f"kappa={condition:g}": conditioned(count, rank, side, condition, device) for condition in conditions}
        inputs["rank-deficient"] = rank_deficient(count, rank, side, device)
        for name, method in METHODS.items():
            measured = cost(method, inputs[f"kappa={conditions[0]:g}"], repeats)
            for label, batch in inputs.items():
                rows.append(
                    {
                        "shape": [count, rank, side],
                        "input": label,
                        "method": name,
                        **quality(batch, method(batch)),
                        **measured,
                    }
                )
    return rows


def table(rows: list[dict]) -> str:
    """A Markdown table: one line per (shape, method), orthogonality and residual per input."""
    inputs = list(dict.fromkeys(row["input"] for row in rows))
    head = (
        "| shape | method | ms per call, median (min–max) | dispatches | "
        + " | ".join(f"{i}: ‖YYᵀ−I‖ / miss" for i in inputs)
        + " |"
    )
    lines = [head, "|" + "---|" * (4 + len(inputs))]
    keys = dict.fromkeys((tuple(row["shape"]), row["method"]) for row in rows)
    for shape, method in keys:
        mine = {row["input"]: row for row in rows if tuple(row["shape"]) == shape and row["method"] == method}
        first = next(iter(mine.values()))
        low, high = first["seconds_range"]
        cells = [
            f"{r['orthogonality']:.1e} / {r['residual']:.1e}" if r["finite"] else "NaN"
            for r in (mine[i] for i in inputs)
        ]
        lines.append(
            f"| {'×'.join(map(str, shape))} | {method} | {first['seconds'] * 1e3:.1f} "
            f"({low * 1e3:.1f}–{high * 1e3:.1f}) | "
            f"{first['dispatches']} | " + " | ".join(cells) + " |"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m edgc_bench.orthonormalization", description=__doc__.splitlines()[0]
    )
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument(
        "--threads", type=int, help="CPU threads (default: torch's); 1 times a busy machine more steadily"
    )
    parser.add_argument("--out", type=Path, help="write the rows as JSON here")
    args = parser.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    rows = compare(device, repeats=args.repeats)
    result = {
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        "torch": torch.__version__,
        "threads": torch.get_num_threads(),
        "rows": rows,
    }
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(result, indent=1))
    print(table(rows))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
