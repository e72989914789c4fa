"""Shapes, seeds and orthonormalisation of low-rank factors.

What the PowerSGD engine (`edgc.lowrank`), its rank-change policy (`edgc.rank_change`) and the
inter-stage compressor (`edgc.interstage`) share: how a gradient is viewed as a matrix, at which
rank a matrix of that shape is worth compressing, seeds that agree across processes, and the
in-place orthonormalisation of a batch of factors.
"""
from __future__ import annotations

import zlib

import torch


def stable_seed(*parts: object) -> int:
    """A seed from names and numbers that is the same in every process (unlike ``hash``)."""
    return zlib.crc32(repr(parts).encode()) & 0x7FFF_FFFF


def orthogonalize_(matrices: torch.Tensor, epsilon: float = 1e-8) -> torch.Tensor:
    """Orthonormalise the columns of each matrix in a (batch, k, r) tensor, in place.

    QR for r > 2; Gram–Schmidt otherwise (cheaper for 1–2 columns). Both keep all-zero
    columns finite (the epsilon guards the Gram–Schmidt division).
    """
    rank = matrices.shape[-1]
    if rank > 2:
        matrices.copy_(torch.linalg.qr(matrices).Q)
        return matrices
    for i in range(rank):
        column = matrices[..., i : i + 1]
        column.div_(column.norm(dim=-2, keepdim=True) + epsilon)
        if i + 1 < rank:
            rest = matrices[..., i + 1 :]
            rest.sub_(column * (column * rest).sum(dim=-2, keepdim=True))
    return matrices


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
