"""The buffers one call layout keeps from step to step: what every stretch of its job reads and writes.

A call of the engine (`edgc.engine.lowrank`) is a job of three stretches between its collectives
(`edgc.engine.stretches`). Each stretch reads and writes only buffers kept here, made once per layout
(and again when the layout changes: a rank change, DDP's bucket rebuild, a checkpoint), so that a
steady step allocates nothing that outlives a stretch, reads nothing to the host, and every size is
the layout's: a stretch is the same device work over the same memory at every step, which a CUDA
graph can hold (`edgc.device.graphs`). What a stretch allocates besides is scratch, dead when it
returns.

- ``arena``: the error feedback of the call's compressed matrices (M = G + e during a step), and
  ``spare``, the arena an uncommitted step's residual goes to.
- ``factors``: one buffer holding Pᵀ and two Qᵀ buffers, laid out [Q₁ | P | Q₀]. Q is used in turn:
  a step warm-starts from ``q(turn)`` and writes the group's new Q into the other one, so the Q a
  step started from is still there when it ends: a non-finite step, a rollback or a snapshot's
  restore goes back to it by turning back, without a copy (`EngineMemory.snapshot` states how long
  that holds: one step). P sits between them, so P and either Q are one contiguous slice: the
  decompression casts both factors in one pass (`pair`).
- ``raw``: the raw tensors of the call and its non-finite flag, as sent; ``poison`` and ``bad``: the
  group's verdict (0 or NaN, and whether it is NaN); ``sums``: the error measurement's ‖M‖² and
  ‖M − Ĝ‖² of the chunks it reads.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from .layout import CallLayout


@dataclass
class StepBuffers:
    """What a call's stretches hand each other besides M and the factors (see the module docstring)."""

    raw: torch.Tensor  # the raw tensors, then the flag element (the gradients' dtype)
    poison: torch.Tensor  # (1,) float32: 0, or NaN once the group saw a NaN/Inf
    bad: torch.Tensor  # 0-dim bool: poison is NaN
    sums: torch.Tensor  # (2,): ‖M‖² and ‖M − Ĝ‖² of the chunks of the arena the error measurement reads
    local_q: torch.Tensor | None = None  # without error feedback: Q before its average (the error measurement)


@dataclass
class CallBuffers:
    """The buffers kept for one call layout (see the module docstring)."""

    layout: CallLayout
    shapes: tuple  # the tensor shapes the layout was planned for
    arena: torch.Tensor | None = None  # error feedback of the compressed matrices (M during a step)
    error_views: list[torch.Tensor] = field(default_factory=list)  # (m, n) views of arena, layout order
    spare: torch.Tensor | None = None  # uncommitted steps: the arena the residual goes to
    factors: torch.Tensor | None = None  # [Q₁ | P | Q₀], the compute dtype
    turn: int = 0  # which Q holds the current one
    q_views: tuple[list[torch.Tensor], list[torch.Tensor]] = ([], [])  # (n, r) views of each Q, layout order
    replacement: torch.Tensor | None = None  # rows that restart zero rows of Q: (r, n) per Q block
    identity: torch.Tensor | None = None  # r × r, the orthonormalisation's Gram dtype (`factors.gram_dtype`)
    step: StepBuffers | None = None
    scratch: torch.Tensor | None = None  # M without error feedback (no arena to form it in)
    regions: dict = field(default_factory=dict)  # the stretches' graph regions (`edgc.engine.stretches`)
    reason: str = "a new layout"  # why its regions capture: said on the logger with their first capture

    def views(self, arena: torch.Tensor) -> list[torch.Tensor]:
        return [block for group in self.layout.groups for block in group.error_view(arena).unbind(0)]

    # ------------------------------------------------------------------ the factors
    @property
    def p(self) -> torch.Tensor:
        q, p = self.layout.q_numel, self.layout.p_numel
        return self.factors[q : q + p]

    def q(self, turn: int) -> torch.Tensor:
        """Q buffer ``turn`` (0 or 1)."""
        q, p = self.layout.q_numel, self.layout.p_numel
        return self.factors[q + p :] if turn == 0 else self.factors[:q]

    def pair(self, turn: int) -> tuple[slice, int, int]:
        """P and Q buffer ``turn`` as one slice of ``factors``, and their offsets in it."""
        q, p = self.layout.q_numel, self.layout.p_numel
        return (slice(q, q + p + q), 0, p) if turn == 0 else (slice(0, q + p), q, 0)

    def make_factors(self, dtype: torch.dtype, device: torch.device) -> None:
        """A new factors buffer (its Q values are the caller's to write), with its Q views."""
        size = 2 * self.layout.q_numel + self.layout.p_numel
        self.factors = torch.zeros(size, dtype=dtype, device=device)
        self.q_views = tuple(
            [q.T for group in self.layout.groups for q in group.q_view(self.q(turn)).unbind(0)] for turn in (0, 1)
        )

    def keep_identity(self, method: str, device: torch.device) -> None:
        """The identity the orthonormalisation's Gram products add their shift with, made where it is not."""
        from .factors import gram_dtype

        rank, dtype, kept = max((g.rank for g in self.layout.groups), default=0), gram_dtype(method), self.identity
        if dtype is None:
            self.identity = None
        elif kept is None or (kept.shape[0], kept.dtype, kept.device) != (rank, dtype, device):
            self.identity = torch.eye(rank, dtype=dtype, device=device)

    def step_tensors(self) -> tuple[torch.Tensor, ...]:
        """The step buffers' tensors (none before the first step)."""
        step = self.step
        if step is None:
            return ()
        return tuple(t for t in (step.raw, step.poison, step.bad, step.sums, step.local_q) if t is not None)

    # ------------------------------------------------------------------ the step's own buffers
    def step_buffers(self, grad_dtype: torch.dtype, measure_dtype: torch.dtype, device: torch.device) -> StepBuffers:
        """The step buffers for gradients of ``grad_dtype``, the error measured in ``measure_dtype``, made
        where they are not yet."""
        kept = self.step
        if kept is None or (kept.raw.dtype, kept.sums.dtype, kept.raw.device) != (grad_dtype, measure_dtype, device):
            kept = self.step = StepBuffers(
                raw=torch.zeros(self.layout.raw_numel + 1, dtype=grad_dtype, device=device),
                poison=torch.zeros(1, dtype=torch.float32, device=device),
                bad=torch.zeros((), dtype=torch.bool, device=device),
                sums=torch.zeros(2, dtype=measure_dtype, device=device),
            )
        return kept
