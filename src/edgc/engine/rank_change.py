"""How the warm-start Q of every matrix follows a rank change (`EDGCConfig.engine.rank_change`).

Rank changes keep error feedback (the residual is still what was not sent) and, with
``rank_change='warm'`` (`change_rank`, called before the first step at the new rank), keep the
warm start of the power iteration: a falling rank keeps the directions of Q that carry the most
energy (Q rotated to the eigenvectors of QᵀQ; since P is orthonormal, P·Qᵀ = (P·V)(Q·V)ᵀ and
Q·V's column norms are the singular values of the last step's approximation; one batched
eigendecomposition for all of them), and a rising rank adds directions where the residuals are
largest (one power iteration eᵀ·e·Ω on the residual e (m × n), Q being on the n side,
averaged over the group by one all-reduce so every replica appends the same
columns), orthogonal to the kept ones. ``'truncate'`` (`edgc.engine.engine_memory.EngineMemory.resized_q`
alone) keeps the first r columns and appends columns drawn from a generator seeded by (seed,
parameter name, old rank, new rank): no communication, but the new directions are random and the
kept ones are whichever came first.

`change_rank` runs before the first step at the new rank, on every rank alike, on the engine's
`edgc.engine.engine_memory.EngineMemory`; ``resized_q`` runs inside a step for each matrix and covers what
`change_rank` left (truncate mode, new matrices).
"""

from __future__ import annotations

import torch

from ..device.timing import host_reads_allowed, to_device
from ..distributed.comm import Communicator
from ..runner.seeds import stable_seed
from .engine_memory import EngineMemory
from .factors import compressed_rank, orthogonalize_


def change_rank(kept: EngineMemory, rank: int, comm: Communicator) -> tuple[int, int]:
    """Give every Q ``kept`` stores the columns of ``rank`` while keeping the warm start (see the module docstring).

    Called on every rank with the same ``rank`` at the same point (before the first step that
    uses it); issues one blocking all-reduce when some Q grows and error feedback is on, none
    otherwise. Returns (elements, bytes) that all-reduce sent ((0, 0) if none). With ``rank_change='truncate'`` it does
    nothing: `resize_q` truncates or appends random columns inside the next step.
    """
    if kept.config.rank_change != "warm":
        return 0, 0
    shrink, grow = [], []
    for name in sorted(kept.q):  # sorted: the same order (and buffer layout) on every rank
        q, shape = kept.q[name], kept.shapes.get(name)
        target = compressed_rank(shape, kept.rank_for(name, rank), kept.config.min_compression_rate)
        if shape is None or target == 0 or q.shape[1] == target:
            continue
        (shrink if target < q.shape[1] else grow).append((name, target))
    if shrink:
        with host_reads_allowed():  # only on a fall (at most once per window): eigh checks its result on the host
            columns = principal_columns([kept.q[name] for name, _ in shrink], [target for _, target in shrink])
        kept.q.update({name: q for (name, _), q in zip(shrink, columns)})
    return grow_along_residual(kept, grow, comm) if grow else (0, 0)


def principal_columns(qs: list[torch.Tensor], ranks: list[int]) -> list[torch.Tensor]:
    """Q·V[:, :rank] for each Q, V the eigenvectors of QᵀQ, largest eigenvalue first: the Gram
    matrices of every Q with the same number of columns in one batched eigendecomposition (one
    library call and one host check per column count, not one per matrix), the products batched per
    Q shape and rank (a few launches per shape, not a few per matrix)."""
    kept: list[torch.Tensor | None] = [None] * len(qs)
    by_columns: dict[int, dict[tuple[int, int], list[int]]] = {}
    for i, q in enumerate(qs):
        by_columns.setdefault(q.shape[1], {}).setdefault((q.shape[0], ranks[i]), []).append(i)
    for by_shape in by_columns.values():
        stacks = [torch.stack([qs[i] for i in indices]) for indices in by_shape.values()]
        grams = torch.cat([torch.bmm(stack.transpose(1, 2), stack) for stack in stacks]).double()
        _, vectors = torch.linalg.eigh(grams)  # ascending
        vectors, offset = vectors.flip(-1), 0
        for ((_, rank), indices), stack in zip(by_shape.items(), stacks):
            v = vectors[offset : offset + len(indices), :, :rank].to(stack.dtype)
            offset += len(indices)
            for i, q in zip(indices, torch.bmm(stack, v).unbind(0)):
                kept[i] = q
    return kept  # type: ignore[return-value]


def grow_along_residual(kept: EngineMemory, grow: list[tuple[str, int]], comm: Communicator) -> tuple[int, int]:
    """Append, to each Q, the group's top residual directions orthogonal to its current columns."""
    blocks = []
    for name, target in grow:
        q, (m, n) = kept.q[name], kept.shapes[name]
        extra = target - q.shape[1]
        generator = torch.Generator().manual_seed(stable_seed(kept.config.seed, name, q.shape[1], target))
        omega = to_device(torch.randn(n, extra, generator=generator), q.device).to(q.dtype)
        residual = kept.error.get(name)
        if residual is not None and residual.numel() == m * n:
            e = residual.reshape(m, n).to(q.dtype)
            omega = e.T @ (e @ omega)  # one power iteration on eᵀe
        blocks.append(omega)
    flat = torch.cat([b.reshape(-1) for b in blocks])
    sent = flat.numel() if kept.config.error_feedback else 0  # counted like every other call (world of 1 too)
    if kept.config.error_feedback:
        comm.mean_async(flat).wait()  # the group's residual directions, identical on every rank
    offset = 0
    for (name, _), block in zip(grow, blocks):
        columns = flat[offset : offset + block.numel()].view_as(block)
        offset += block.numel()
        q = kept.q[name]
        basis = orthogonalize_(q.clone().unsqueeze(0), kept.config.orthogonalization_epsilon)[0]
        columns = columns - basis @ (basis.T @ columns)  # only what Q does not already span
        scale = q.norm(dim=0).min().clamp(min=kept.config.orthogonalization_epsilon)
        columns = columns / (columns.norm(dim=0, keepdim=True) + kept.config.orthogonalization_epsilon) * scale
        kept.q[name] = torch.cat([q, columns], dim=1)
    return sent, sent * flat.element_size()
