"""How one compression call lays out its tensors: raw ones, shape groups and flat factor buffers.

A call (one DDP bucket, or several fused) splits its tensors into those sent raw (vectors, and
matrices too small to gain) and *shape groups*: the matrices of one (m, n, rank). The engine
(`edgc.engine.lowrank`) computes each group as one batch, so its kernel count grows with the number of
shapes in a call, not with the number of matrices.

Orientation. A matrix M (m × n) is worked on as it is, as PowerSGD and torch's hook do: P = M·Q
(m × r) is orthonormalised, Q (n × r) persists between steps (warm start). Working on Mᵀ instead
when M is wide would keep the persistent Q on the shorter side (less state), but the power
iteration then tracks the other singular subspace, and in paired runs that learned measurably worse
(docs/concepts/engine.md, "Orientation").

Buffers. Factors are kept transposed, Pᵀ (r × m) and Qᵀ (r × n). All Pᵀ of a call live in one
flat buffer (one all-reduce), ordered by (r, m) so that every run of groups with the same (r, m)
is one contiguous (B, r, m) block: one orthonormalisation per block. All Qᵀ live in another,
ordered by (r, n): one normalisation per block. The error feedback of the call's
compressed matrices lives in one flat arena, each group a contiguous (b, m, n) block.

Everything here is pure bookkeeping on shapes: testable without tensors or a process group.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from .factors import compressed_rank, matrix_shape


@dataclass
class ShapeGroup:
    """The matrices of one call with the same (m, n) and rank."""

    m: int
    n: int
    rank: int
    indices: list[int]  # positions in the call's tensor list
    names: list[str]
    p_offset: int = 0  # element offsets in the flat Pᵀ / Qᵀ buffers and the error-feedback arena
    q_offset: int = 0
    error_offset: int = 0

    @property
    def count(self) -> int:
        return len(self.indices)

    @property
    def p_numel(self) -> int:
        return self.count * self.rank * self.m

    @property
    def q_numel(self) -> int:
        return self.count * self.rank * self.n

    @property
    def numel(self) -> int:
        return self.count * self.m * self.n

    def p_view(self, p_flat: torch.Tensor) -> torch.Tensor:
        """This group's Pᵀ, (b, r, m)."""
        return p_flat[self.p_offset : self.p_offset + self.p_numel].view(self.count, self.rank, self.m)

    def q_view(self, q_flat: torch.Tensor) -> torch.Tensor:
        """This group's Qᵀ, (b, r, n)."""
        return q_flat[self.q_offset : self.q_offset + self.q_numel].view(self.count, self.rank, self.n)

    def error_view(self, arena: torch.Tensor) -> torch.Tensor:
        """This group's error-feedback block, (b, m, n)."""
        return arena[self.error_offset : self.error_offset + self.numel].view(self.count, self.m, self.n)


@dataclass
class Block:
    """A run of groups whose factors share (rank, side): one (count, rank, side) view of a flat buffer."""

    offset: int
    count: int
    rank: int
    side: int

    def view(self, flat: torch.Tensor) -> torch.Tensor:
        return flat[self.offset : self.offset + self.count * self.rank * self.side].view(
            self.count, self.rank, self.side
        )


@dataclass
class CallLayout:
    """Where every tensor of one call goes (see the module docstring)."""

    names: tuple[str, ...]
    rank: int
    ranks: dict[str, int]  # per tensor; 0 = sent raw
    raw: list[int]  # positions of the tensors sent raw
    groups: list[ShapeGroup]
    p_blocks: list[Block] = field(default_factory=list)
    q_blocks: list[Block] = field(default_factory=list)
    p_numel: int = 0
    q_numel: int = 0
    error_numel: int = 0
    raw_numel: int = 0

    @classmethod
    def plan(
        cls,
        names: list[str],
        tensors: list[torch.Tensor],
        rank: int,
        min_compression_rate: float,
        shares: dict[str, int] | None = None,
    ) -> CallLayout:
        """``rank`` for every matrix but those ``shares`` gives a rank of their own (`edgc.policies.rank_split`)."""
        by_shape: dict[tuple[int, int, int], ShapeGroup] = {}
        raw, ranks = [], {}
        shares = shares or {}
        for i, (name, tensor) in enumerate(zip(names, tensors)):
            shape = matrix_shape(tensor)
            r = compressed_rank(shape, shares.get(name, rank), min_compression_rate)
            ranks[name] = r
            if not r:
                raw.append(i)
                continue
            group = by_shape.setdefault((*shape, r), ShapeGroup(*shape, r, [], []))  # type: ignore[misc]
            group.indices.append(i)
            group.names.append(name)
        layout = cls(tuple(names), rank, ranks, raw, list(by_shape.values()))
        layout.raw_numel = sum(tensors[i].numel() for i in raw)
        layout._place()
        return layout

    def _place(self) -> None:
        offset = 0
        for group in self.groups:
            group.error_offset = offset
            offset += group.numel
        self.error_numel = offset
        self.p_blocks, self.p_numel = _pack(self.groups, "p_offset", lambda g: (g.rank, g.m), lambda g: g.p_numel)
        self.q_blocks, self.q_numel = _pack(self.groups, "q_offset", lambda g: (g.rank, g.n), lambda g: g.q_numel)

    def describe(self) -> str:
        """A short account of the layout, for the logger: its matrices, shape groups and raw tensors."""
        compressed = sum(group.count for group in self.groups)
        return f"{compressed} matrices in {len(self.groups)} shape groups at rank {self.rank}, {len(self.raw)} raw"

    @property
    def compressed_names(self) -> list[str]:
        return [name for group in self.groups for name in group.names]


def _pack(groups: list[ShapeGroup], attribute: str, key, numel) -> tuple[list[Block], int]:
    """Give each group an offset in a flat buffer, runs of equal ``key`` = (rank, side) adjacent;
    returns the runs as blocks and the buffer's size."""
    blocks: list[Block] = []
    offset = 0
    for group in sorted(groups, key=lambda g: (key(g), g.error_offset)):
        setattr(group, attribute, offset)
        rank, side = key(group)
        if blocks and (blocks[-1].rank, blocks[-1].side) == (rank, side):
            blocks[-1].count += group.count
        else:
            blocks.append(Block(offset, group.count, rank, side))
        offset += numel(group)
    return blocks, offset
