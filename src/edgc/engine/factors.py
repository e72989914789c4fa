"""Shapes and orthonormalisation of low-rank factors.

What the PowerSGD engine (`edgc.engine.lowrank`), its rank-change policy (`edgc.engine.rank_change`) and the
inter-stage compressor (`edgc.parallel.interstage`) share: how a gradient is viewed as a matrix, at which
rank a matrix of that shape is worth compressing, and the in-place orthonormalisation of a batch of factors.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Protocol

import torch

from ..config import ORTHONORMALIZATION_CHOICES

# The methods `orthonormalize_blocks_` runs (`edgc.engine.orthonormal_choice` picks one per device).
ORTHONORMALIZATIONS = tuple(name for name in ORTHONORMALIZATION_CHOICES if name != "auto")
# dtype and floor of the Cholesky methods. The floor is added to every shift, so that an all-zero
# batch (a layer that got no gradient) still has a positive-definite Gram matrix: far below any value
# that matters in that dtype, far above its smallest normal number.
_CHOLESKY = {"cholesky2-fp64": (torch.float64, 1e-300), "cholesky4-fp32": (torch.float32, 1e-30)}


def orthonormalize_rows_(rows: torch.Tensor, epsilon: float = 1e-12, *, method: str = "cholesky2-fp64") -> torch.Tensor:
    """Orthonormalise the rows of each matrix of a (batch, r, k) tensor in place (r ≤ k).

    Shifted CholeskyQR2 in float64 by default, one batched call for the whole batch (no per-matrix
    library call, no host synchronisation): twice G = X·Xᵀ + s·I = L·Lᵀ, X ← L⁻¹·X. One pass
    leaves XXᵀ off the identity by about u·κ(X)² plus the shift's share, so a factor whose weak
    directions sit 1e3 below its strongest would come out 1e-3 off orthonormal, and those
    directions would shrink step after step; the second pass starts from κ ≈ 1 and restores them.
    `edgc_bench.orthonormalization` measures it against batched Householder QR (its table is in
    docs/concepts/engine.md): as orthonormal as a float64 Householder QR up to float32's condition
    numbers, at a handful of batched kernels instead of a geqrf + orgqr per matrix. The first shift
    s = epsilon·mean(diag G) keeps every Gram matrix positive definite: a rank-deficient batch gets
    no NaN, and an all-zero row stays zero. A factorisation that fails all the same leaves its
    matrix's rows NaN, never finite rows that are not orthonormal (`orthonormalize_blocks_`).
    """
    flat = rows.reshape(-1)
    orthonormalize_blocks_(flat, [_WholeBatch(rows.shape)], epsilon, method=method)
    if flat.data_ptr() != rows.data_ptr() or not rows.is_contiguous():
        rows.copy_(flat.view(rows.shape))
    return rows


class _WholeBatch:
    def __init__(self, shape: torch.Size):
        self.count, self.rank, self.side = shape

    def view(self, flat: torch.Tensor) -> torch.Tensor:
        return flat.view(self.count, self.rank, self.side)


class _Block(Protocol):
    count: int
    rank: int
    side: int

    def view(self, flat: torch.Tensor) -> torch.Tensor: ...


def orthonormalize_blocks_(
    flat: torch.Tensor,
    blocks: Sequence[_Block],
    epsilon: float = 1e-12,
    *,
    method: str = "cholesky2-fp64",
    out: torch.Tensor | None = None,
    passes: int | None = None,
    identity: torch.Tensor | None = None,
) -> torch.Tensor:
    """`orthonormalize_rows_` for several (count, rank, side) blocks of one flat buffer at once: one
    cast, and per pass one Cholesky factorisation for all the Gram matrices of one rank (their
    sides differ, their r × r Gram matrices do not), so the library calls do not grow with the
    number of blocks.

    ``method`` (`ORTHONORMALIZATIONS`, `edgc.engine.orthonormal_choice`):
    - ``householder``: LAPACK's Householder QR per block, in the buffer's dtype (what the engine runs
      on a CPU): rows orthonormal to float32's precision at any condition number; rank-deficient
      rows come out as an orthonormal completion rather than zero rows.
    - ``cholesky2-fp64``: shifted CholeskyQR2 in float64, the first shift relative (epsilon·mean of
      G's diagonal), the second absolute (epsilon: the rows are near unit norm by then).
    - ``cholesky4-fp32``: shifted CholeskyQR in float32, four passes, for accelerators with slow
      float64. A float32 Gram matrix carries rounding of about √side·u (u = 2⁻²³) of its diagonal, so
      the first two passes are shifted by ten times that, which any condition number survives and
      which divides it by about the shift's square root each; the last two, from κ near 1, by u.
      As orthonormal as float32 Householder, for κ up to float32's 1/u and rank-deficient rows.

    A Cholesky factorisation that fails (``cholesky_ex``'s info ≠ 0 in any pass: the partial factor
    is finite, and its rows would be finite and not orthonormal) leaves that matrix's rows NaN, on
    the device: a non-finite factor that the step's non-finite flag catches. ``out``: where the rows
    go (a buffer laid out as ``flat``), ``flat`` itself by default. ``passes``: the Cholesky methods'
    first passes only (their shifts), where rows need to be well conditioned rather than orthonormal
    (the engine's warm start); None: all of them. With ``passes`` a failed factorisation is not
    masked: its rows come out finite and less well conditioned, or not finite where its factor
    has a zero on its diagonal, which a restart catches (`restart_dead_entries_`). ``identity``: a kept
    identity matrix of the method's dtype (`gram_dtype`), at least rank × rank: each Gram matrix is
    then formed with its absolute shift (the floor, in a relative pass) already on its diagonal, one
    ``baddbmm`` per block, and a pass launches no separate shift (a relative one adds s·mean(diag G)
    to the floored G: the same shift but for the floor, far below any value that matters).
    """
    out = flat if out is None else out
    if method == "householder":
        for block in blocks:
            basis, _ = torch.linalg.qr(block.view(flat).transpose(-1, -2))
            block.view(out).copy_(basis.transpose(-1, -2))
        return out
    if method not in _CHOLESKY:
        raise ValueError(f"orthonormalisation method must be one of {ORTHONORMALIZATIONS}, got {method!r}")
    dtype, floor = _CHOLESKY[method]
    by_rank: dict[int, list[_Block]] = {}
    for block in blocks:
        by_rank.setdefault(block.rank, []).append(block)
    x = flat.to(dtype, copy=True)
    solved = torch.empty_like(x)
    failed: dict[int, torch.Tensor] = {}
    masked = passes is None
    shifts = {rank: _shifts(method, epsilon, max(b.side for b in same))[:passes] for rank, same in by_rank.items()}
    passes = len(next(iter(shifts.values()), ()))
    for step in range(passes):
        for rank, same_rank in by_rank.items():
            views = [block.view(x) for block in same_rank]
            gram = torch.empty(sum(v.shape[0] for v in views), rank, rank, dtype=dtype, device=x.device)
            _gram_(views, gram, shifts[rank][step], floor, step == 0, identity)
            lower, info = torch.linalg.cholesky_ex(gram)
            failed[rank] = info if step == 0 else failed[rank] + info
            if masked and step == passes - 1:  # any pass of a matrix failed: its rows NaN
                lower.masked_fill_(failed[rank].view(-1, 1, 1) != 0, float("nan"))
            for block, view, factor in zip(same_rank, views, lower.split([v.shape[0] for v in views])):
                torch.linalg.solve_triangular(factor, view, upper=False, out=block.view(solved))
        x, solved = solved, x
    out.copy_(x)
    return out


def _shifts(method: str, epsilon: float, side: int) -> tuple[float, ...]:
    """The shift of each pass: relative to the mean diagonal in the first, absolute after it (rows
    near unit norm by then). Its share of a row's norm is what the row loses in that pass."""
    if method == "cholesky2-fp64":
        return (epsilon, epsilon)
    u = torch.finfo(torch.float32).eps
    rounding = max(epsilon, 10 * math.sqrt(side) * u)
    return (rounding, rounding, max(epsilon, u), max(epsilon, u))


def _gram_(
    views: list[torch.Tensor],
    gram: torch.Tensor,
    shift: float,
    floor: float,
    relative: bool,
    identity: torch.Tensor | None,
) -> None:
    """G = X·Xᵀ + s·I of every view into ``gram`` (`_shift_`); with ``identity``, the absolute part of the
    shift (the floor in a ``relative`` pass) is added by the products themselves."""
    squares = gram.split([v.shape[0] for v in views])
    if identity is None:
        for view, square in zip(views, squares):
            torch.bmm(view, view.transpose(-1, -2), out=square)
        _shift_(gram, shift, floor, relative=relative)
        return
    rank = gram.shape[-1]
    added = floor if relative else shift + floor
    for view, square in zip(views, squares):
        torch.baddbmm(identity[:rank, :rank], view, view.transpose(-1, -2), beta=added, out=square)
    if relative:
        diagonal = gram.diagonal(dim1=-2, dim2=-1)
        diagonal.add_(diagonal.mean(-1, keepdim=True), alpha=shift)


def gram_dtype(method: str) -> torch.dtype | None:
    """The dtype ``method``'s Gram matrices are formed in (None for Householder, which forms none): that of
    the identity `orthonormalize_blocks_` takes, made once and kept by the caller."""
    return _CHOLESKY[method][0] if method in _CHOLESKY else None


def _shift_(gram: torch.Tensor, shift: float, floor: float, *, relative: bool) -> None:
    """G ← G + s·I in place: s = shift·mean(diag G) (at least the floor) when ``relative``, else
    shift + floor."""
    diagonal = gram.diagonal(dim1=-2, dim2=-1)
    if relative:
        diagonal.add_(diagonal.mean(-1, keepdim=True).clamp_(min=floor / max(shift, floor)), alpha=shift)
    else:
        diagonal.add_(shift + floor)


def orthogonalize_(matrices: torch.Tensor, epsilon: float = 1e-12) -> torch.Tensor:
    """Orthonormalise the columns of each matrix in a (batch, k, r) tensor, in place
    (`orthonormalize_rows_` on the transposed view).

    Args:
        matrices: the (batch, k, r) matrices.
        epsilon: the first shift's scale, s = epsilon·mean(diag G): every Gram matrix stays positive definite.

    Returns:
        ``matrices``, orthonormalised.
    """
    orthonormalize_rows_(matrices.transpose(-1, -2), epsilon)
    return matrices


def restart_dead_entries_(flat: torch.Tensor, replacement: torch.Tensor) -> torch.Tensor:
    """Give every entry of an orthonormalised factor that is zero or not finite the matching entry of
    ``replacement`` (laid out as ``flat``, identical on every process), selected on the device in one
    pass: x/x is 1 exactly where x is finite and not zero (0/0, ∞/∞ and NaN/NaN are NaN).

    Why: a layer without gradient for a step gives Q = Mᵀ·P = 0, and a zero row of Q stays zero for
    ever (P = M·Q and Q = Mᵀ·P keep it zero; the orthonormalisation keeps it zero too); a failed
    factorisation leaves its matrix's rows NaN. The replacement restarts the power iteration in
    those directions. A zero entry of a live row only lies along a direction in which M is zero
    (M's column is zero there), so P = M·Q does not see what it is given."""
    return torch.where(flat / flat == 1, flat, replacement, out=flat)


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
