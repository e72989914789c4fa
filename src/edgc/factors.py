"""Shapes, seeds and orthonormalisation of low-rank factors.

What the PowerSGD engine (`edgc.lowrank`), its rank-change policy (`edgc.rank_change`) and the
inter-stage compressor (`edgc.interstage`) share: how a gradient is viewed as a matrix, at which
rank a matrix of that shape is worth compressing, seeds that agree across processes, and the
in-place orthonormalisation of a batch of factors.
"""
from __future__ import annotations

import zlib
from typing import Protocol, Sequence

import torch

# Added to every shift so that an all-zero batch (a layer that got no gradient) still has a
# positive-definite Gram matrix; far below any float32 value that matters.
_SHIFT_FLOOR = 1e-300


def stable_seed(*parts: object) -> int:
    """A seed from names and numbers that is the same in every process (unlike ``hash``)."""
    return zlib.crc32(repr(parts).encode()) & 0x7FFF_FFFF


def orthonormalize_rows_(rows: torch.Tensor, epsilon: float = 1e-12) -> torch.Tensor:
    """Orthonormalise the rows of each matrix of a (batch, r, k) tensor in place (r ≤ k).

    Shifted CholeskyQR2 in float64, one batched call per step for the whole batch (no per-matrix
    library call, no host synchronisation): twice G = X·Xᵀ + s·I = L·Lᵀ, X ← L⁻¹·X. One pass
    leaves XXᵀ off the identity by about u·κ(X)² plus the shift's share, so a factor whose weak
    directions sit 1e3 below its strongest would come out 1e-3 off orthonormal, and those
    directions would shrink step after step; the second pass starts from κ ≈ 1 and restores them.
    `edgc_bench.orthonormalization` measures it against batched Householder QR (its table is in
    docs/concepts/engine.md): as orthonormal as a float64 Householder QR up to float32's condition
    numbers, at a handful of batched kernels instead of a geqrf + orgqr per matrix. The shift s = epsilon·mean(diag G)
    keeps every Gram matrix positive definite: a rank-deficient batch gets no NaN, and an all-zero
    row stays zero (`restart_zero_rows` restarts those where it matters).
    """
    x = rows.to(torch.float64)
    for _ in range(2):
        lower = _shifted_cholesky(x @ x.transpose(-1, -2), epsilon)
        x = torch.linalg.solve_triangular(lower, x, upper=False)
    rows.copy_(x)
    return rows


class _Block(Protocol):
    rank: int

    def view(self, flat: torch.Tensor) -> torch.Tensor: ...


def orthonormalize_blocks_(flat: torch.Tensor, blocks: Sequence[_Block], epsilon: float = 1e-12, *,
                           householder: bool = False) -> torch.Tensor:
    """`orthonormalize_rows_` for several (count, rank, side) blocks of one flat buffer at once: one
    cast, and per pass one Cholesky factorisation for all the Gram matrices of one rank (their
    sides differ, their r × r Gram matrices do not), so the library calls do not grow with the
    number of blocks.

    ``householder``: LAPACK's Householder QR per block, in the buffer's dtype, instead (what the
    engine runs on a CPU). There a library call costs no launch, and float32 Householder is faster
    than the two float64 Cholesky passes (`edgc_bench.orthonormalization` times both), rows
    orthonormal to float32's precision at any condition number; rank-deficient rows come out as an
    orthonormal completion rather than zero rows.
    """
    if householder:
        for block in blocks:
            rows = block.view(flat)
            basis, _ = torch.linalg.qr(rows.transpose(-1, -2))
            rows.copy_(basis.transpose(-1, -2))
        return flat
    by_rank: dict[int, list[_Block]] = {}
    for block in blocks:
        by_rank.setdefault(block.rank, []).append(block)
    x = flat.to(torch.float64)
    solved = torch.empty_like(x)
    for _ in range(2):
        for same_rank in by_rank.values():
            views = [block.view(x) for block in same_rank]
            grams = [v @ v.transpose(-1, -2) for v in views]
            lower = _shifted_cholesky(torch.cat(grams) if len(grams) > 1 else grams[0], epsilon)
            for block, view, factor in zip(same_rank, views, lower.split([v.shape[0] for v in views])):
                torch.linalg.solve_triangular(factor, view, upper=False, out=block.view(solved))
        x, solved = solved, x
    flat.copy_(x)
    return flat


def _shifted_cholesky(gram: torch.Tensor, epsilon: float) -> torch.Tensor:
    """L with L·Lᵀ = G + s·I, s = epsilon·mean(diag G), at least a floor so that an all-zero G
    (a layer without gradient) still factorises."""
    diagonal = gram.diagonal(dim1=-2, dim2=-1)
    diagonal.add_(diagonal.mean(-1, keepdim=True).clamp_(min=_SHIFT_FLOOR / max(epsilon, _SHIFT_FLOOR)), alpha=epsilon)
    lower, _ = torch.linalg.cholesky_ex(gram)
    return lower


def orthogonalize_(matrices: torch.Tensor, epsilon: float = 1e-12) -> torch.Tensor:
    """Orthonormalise the columns of each matrix in a (batch, k, r) tensor, in place
    (`orthonormalize_rows_` on the transposed view)."""
    orthonormalize_rows_(matrices.transpose(-1, -2), epsilon)
    return matrices


def restart_zero_rows(rows: torch.Tensor, replacement: torch.Tensor, *, out: torch.Tensor) -> torch.Tensor:
    """``out`` = ``rows`` (batch, r, k) with every all-zero row replaced by the matching row of
    ``replacement`` (identical on every process), selected on the device.

    Why: a layer without gradient for a step gives Q = Mᵀ·P = 0, and a zero row of Q stays zero for
    ever (P = M·Q and Q = Mᵀ·P keep it zero; the orthonormalisation keeps it zero too). The
    replacement restarts the power iteration in that direction.
    """
    zero = torch.linalg.vector_norm(rows, dim=-1, keepdim=True) == 0
    return torch.where(zero, replacement, rows, out=out)


def matrix_shape(tensor: torch.Tensor) -> tuple[int, int] | None:
    if tensor.dim() < 2 or tensor.numel() == 0:
        return None
    return tensor.shape[0], tensor.numel() // tensor.shape[0]


def compressed_rank(shape: tuple[int, int] | None, rank: int, min_compression_rate: float) -> int:
    """Rank a matrix of this (m, n) shape is sent at, or 0 when sending it raw is cheaper."""
    if shape is None:
        return 0
    m, n = shape
    r = min(rank, m, n)
    return r if (m + n) * r * min_compression_rate < m * n else 0
