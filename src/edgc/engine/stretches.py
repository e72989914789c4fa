"""The device work of one engine call, stretch by stretch: each a function over the call's fixed buffers.

A call (`edgc.engine.lowrank.LowRankCompressor.reduce_steps`) issues three collectives and does its
work in three stretches between them (`send_p`, `send_q`, `finish`). Each reads and writes the
gradients and the buffers its layout keeps (`edgc.engine.call_buffers.CallBuffers`); what else it
allocates is scratch, dead when it returns; it reads nothing to the host and runs the same operators
on the same shapes at every steady step. So each can run as a graph region
(`edgc.device.graphs.GraphRegion`): eagerly, or captured once and replayed (`run_stretch`).

Per-matrix work is what touches the gradients where DDP's buckets hold them: M = G + e (one
``_foreach_add_``) and Ĝ = P·Qᵀ written into each gradient (one ``mm`` each). Everything else is a
batched product per shape group, one orthonormalisation per factor, and a fixed number of small ops.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import torch

from ..device.finite import finite_flag, flag_into
from ..device.graphs import GraphRegion
from .call_buffers import CallBuffers
from .factors import orthonormalize_blocks_, restart_dead_entries_

# The passes of the warm start's orthonormalisation. It only conditions Q: P = M·Q and M·Q·R⁻¹ span the
# same columns for any invertible R, and P is orthonormalised fully after its average, so the
# warm start needs Q well conditioned (P's weak directions survive its float32 product), not
# orthonormal to the last digit (docs/concepts/engine.md, "Orthonormalisation").
WARM_START_PASSES = 1


@dataclass
class JobRun:
    """What one call carries from one stretch of its job to the next (host side: the buffers are the
    call's, `CallBuffers`)."""

    kept: CallBuffers
    grads: list[torch.Tensor]
    ordered: list[torch.Tensor]  # the compressed gradients as (m, n) matrices, layout order
    raw_grads: list[torch.Tensor]  # the raw ones, flat
    arena: torch.Tensor  # where M is formed (the error feedback's arena, or scratch without error feedback)
    compute: torch.dtype  # of M, P and Q: float64 for float64 gradients, else float32
    wire: torch.dtype  # of P and Q on the wire
    half_wire: bool  # an fp16 wire between ranks: factors scaled by a power of two (`half_wire_shift`)
    measure_error: bool
    stride: int  # the error measurement reads every stride-th chunk of M and of the residual
    method: str  # the orthonormalisation's (`edgc.engine.factors`)
    epsilon: float
    error_feedback: bool
    subtracts: bool  # e = M − Ĝ from the Ĝ just written (`edgc.engine.engine_memory.subtracts_estimate`)
    stats: object  # its `edgc.runner.stats.ReduceStats`
    rank: int = 0  # this process's in the group (its rank 0 says what the graph regions capture)
    residual: torch.Tensor | None = None  # where e = M − P·Qᵀ goes (the arena, or an uncommitted step's spare)
    select_q: bool = False  # outside a tracked step: the stored Q kept on the device after a non-finite step

    @property
    def layout(self):
        return self.kept.layout

    @property
    def new_turn(self) -> int:
        return 1 - self.kept.turn


def half_wire_shift(size: int) -> float:
    """A power of two ≈ 1/√size: scales a factor so that its entries stay within the gradient's
    range on an fp16 wire. Powers of two scale exactly, so scaling back loses nothing."""
    return 2.0 ** -math.ceil(math.log2(max(1.0, math.sqrt(size))))


def _bmm_into(out: torch.Tensor, a: torch.Tensor, b: torch.Tensor) -> None:
    """out = a·b (batched), computed in the dtype of the bigger operand: a half-precision gradient
    or error buffer is never copied whole, only small factors are cast."""
    big = max((out, a, b), key=torch.Tensor.numel).dtype
    a, b = a.to(big), b.to(big)
    if out.dtype == big:
        torch.bmm(a, b, out=out)
    else:
        out.copy_(torch.bmm(a, b))  # a small factor


def run_stretch(run: JobRun, name: str, work: Callable[[JobRun], None], graphs: bool, rank: int = 0) -> None:
    """``work(run)`` as one of the call's graph regions (`edgc.device.graphs`): one per set of buffers the
    stretch touches (Q is used in turn, and an uncommitted step's arenas), so that each region's every
    call is on the same buffers, as a replay needs; with ``graphs``, each is captured once it has run
    eagerly on them (a few steps at the same rank), else always eager (what a checker and the dispatch
    counter observe). ``rank``: the process's in its group (its rank 0 says the captures)."""
    call = run.kept
    buffers = (call.factors, run.arena, run.residual, call.replacement, call.identity, *call.step_tensors())
    buffers = (*buffers, *run.grads)
    buffers = tuple(t for t in buffers if t is not None)
    key = (name, call.turn, id(run.arena), id(run.residual), run.select_q, run.measure_error)
    region = call.regions.get(key)
    if region is None:
        if len(call.regions) >= 12:  # buffers that change every step (a caller's new tensors): no graph pays
            call.regions.clear()
        region = call.regions[key] = GraphRegion(f"{name} [{call.layout.describe()}]", graphs=graphs, rank=rank)
        region.recapture(call.reason)
    region(lambda: work(run), *buffers)


# ---------------------------------------------------------------------------- the three stretches
def send_p(run: JobRun) -> None:
    """M = G + e in the arena, the warm-started Q, Pᵀ = Qᵀ·Mᵀ per shape group, the raw tensors gathered
    and the non-finite flag: everything the first two collectives send."""
    call, layout, step = run.kept, run.layout, run.kept.step
    if run.ordered:
        if run.error_feedback:
            torch._foreach_add_(call.error_views, run.ordered)
        else:  # a scratch M of the compute dtype: one multi-tensor kernel that casts
            torch._foreach_copy_(call.views(run.arena), run.ordered)
    if layout.groups:
        q_in = orthonormalize_blocks_(
            call.q(call.turn),
            layout.q_blocks,
            run.epsilon,
            method=run.method,
            out=torch.empty_like(call.q(call.turn)),
            passes=WARM_START_PASSES,
            identity=call.identity,
        )
        restart_dead_entries_(q_in, call.replacement)
        for group in layout.groups:
            _bmm_into(group.p_view(call.p), group.q_view(q_in), group.error_view(run.arena).transpose(1, 2))
            if run.half_wire:  # P is orthonormalised after the sum: its scale is free
                group.p_view(call.p).mul_(half_wire_shift(group.n))
    raw = step.raw[:-1]
    if run.raw_grads:
        torch.cat(run.raw_grads, out=raw)
    # One flag element, 0 or NaN: NaN when anything is non-finite here (`edgc.device.finite`). It stays
    # NaN through the average, so every rank learns of a NaN/Inf anywhere in the group. A NaN/Inf
    # anywhere in M makes its P non-finite, so P stands for the compressed part.
    flag_into(step.raw[-1:], *([call.p] if layout.groups else []), *([raw] if run.raw_grads else []))


def send_q(run: JobRun) -> None:
    """The raw tensors' average back into their gradients and the group's flag; then orth(P) and
    Qᵀ = Pᵀ·M into the other Q buffer (and ‖M‖² where the error is measured). A factorisation that
    fails leaves its rows NaN, and so its Q: the flag catches it, and the step is non-finite rather
    than wrong."""
    call, layout, step = run.kept, run.layout, run.kept.step
    if run.raw_grads:
        torch._foreach_copy_(run.raw_grads, list(step.raw[:-1].split([t.numel() for t in run.raw_grads])))
    if not layout.groups:
        step.poison.copy_(step.raw[-1:])  # identical on every rank: it is an average
        torch.ne(step.poison.view(()), step.poison.view(()), out=step.bad)  # NaN: the only value ≠ itself
        return
    orthonormalize_blocks_(call.p, layout.p_blocks, run.epsilon, method=run.method, identity=call.identity)
    q_new = call.q(run.new_turn)
    for group in layout.groups:
        _bmm_into(group.q_view(q_new), group.p_view(call.p), group.error_view(run.arena))
    if run.measure_error:
        if not run.error_feedback:  # no residual to read after: ‖M − Ĝ‖² from ‖M‖² and Q
            step.local_q.copy_(q_new)
        measure(run.arena, run, 0)
    if run.half_wire:
        for group in layout.groups:
            group.q_view(q_new).mul_(half_wire_shift(group.m))


def finish(run: JobRun) -> None:
    """The group's verdict on finiteness (an fp16 wire can overflow; the averages are identical on every
    rank, so is the verdict), Ĝ into the gradients and e = M − P·Qᵀ, and ‖M − Ĝ‖² where measured."""
    call, layout, step = run.kept, run.layout, run.kept.step
    q_new = call.q(run.new_turn)
    if run.half_wire:
        for group in layout.groups:
            group.q_view(q_new).div_(half_wire_shift(group.m))
    # The raw average's flag (identical on every rank) and Q's: 0·NaN and 0·Inf are NaN.
    torch.add(step.raw[-1:], finite_flag(q_new), alpha=0, out=step.poison)
    torch.ne(step.poison.view(()), step.poison.view(()), out=step.bad)
    factors = decompress(run)
    if factors is not None:
        keep_residual(run, factors)
    if run.select_q:
        torch.where(step.bad, call.q(call.turn), q_new, out=q_new)
    if run.measure_error and run.error_feedback:
        measure(run.residual, run, 1)  # ‖e‖² = ‖M − Ĝ‖², on the rows ‖M‖² was read from
    elif run.measure_error:
        # ‖M − P·Qᵀ‖² = ‖M‖² − 2⟨Mᵀ·P, Q⟩ + ‖Q‖² for orthonormal P: no pass over M.
        cross, square = torch.dot(step.local_q, q_new), torch.dot(q_new, q_new)
        torch.clamp(step.sums[0] - 2 * cross + square, min=0, out=step.sums[1])


# ---------------------------------------------------------------------------- their parts
def measured_chunks(matrices: torch.Tensor, stride: int) -> torch.Tensor:
    """What the error measurement reads of a call's arena (or scratch M): every ``stride``-th chunk of
    `MEASURED_CHUNK` elements (all of it at stride 1), one strided view. Each element is read with the
    same odds, so ‖read‖² times `measured_scale` estimates ‖·‖²: exact at stride 1."""
    if stride == 1:
        return matrices
    rows = matrices.numel() // (stride * MEASURED_CHUNK)
    return matrices[: rows * stride * MEASURED_CHUNK].view(rows, stride * MEASURED_CHUNK)[:, :MEASURED_CHUNK]


def measured_scale(numel: int, stride: int) -> float:
    """Elements of the arena per element `measured_chunks` reads."""
    return 1.0 if stride == 1 else numel / ((numel // (stride * MEASURED_CHUNK)) * MEASURED_CHUNK)


MEASURED_CHUNK = 64  # elements per chunk the error measurement reads: 256 B of float32, whole memory sectors


def measure(matrices: torch.Tensor, run: JobRun, which: int) -> None:
    """‖·‖² of the chunks of ``matrices`` the error measurement reads (`measured_chunks`; the caller
    scales it): M's (``which`` 0) or the residual's (1), into ``step.sums``. A half-precision arena's
    norm accumulates in float32 without a copy."""
    half = matrices.dtype in (torch.float16, torch.bfloat16)
    norm = torch.linalg.vector_norm(measured_chunks(matrices, run.stride), dtype=torch.float32 if half else None)
    torch.mul(norm, norm, out=run.kept.step.sums[which])


def decompress(run: JobRun) -> list | None:
    """Ĝ = P·Qᵀ written straight into each gradient (one product per matrix: the gradients lie in DDP's
    buckets, not at one stride); returns, with error feedback, the factors Ĝ was formed from (a
    half-precision gradient's: rounded to its dtype) in the arena's dtype, per shape group, for
    e = M − P·Qᵀ (`keep_residual`), so that Ĝ + e = M but for the rounding of Ĝ's own values; where
    the residual subtracts Ĝ (`edgc.engine.engine_memory.subtracts_estimate`), Ĝ's matrices themselves.
    The step's poison (0 or NaN) goes into both factors, cast with them in one pass: on a
    non-finite step Ĝ is NaN everywhere, so every rank's optimizer (or GradScaler) skips it; the
    residual of such a step is cleared by `EngineMemory.end_step`."""
    call, layout, step = run.kept, run.layout, run.kept.step
    grad_dtype = run.grads[0].dtype
    where, p_at, q_at = call.pair(run.new_turn)
    pair = call.factors[where]
    if grad_dtype == torch.float16:
        factors = _half_factors(run, pair, p_at, q_at)
    else:
        pair = torch.add(pair, step.poison, out=torch.empty_like(pair, dtype=grad_dtype))
        factors = [(group.p_view(pair[p_at:]), group.q_view(pair[q_at:])) for group in layout.groups]
    for group, (p_t, q_t) in zip(layout.groups, factors):
        for a, b, i in zip(p_t.transpose(1, 2).unbind(0), q_t.unbind(0), group.indices):
            torch.mm(a, b, out=run.grads[i].view(group.m, group.n))
    if not run.error_feedback:
        return None
    if run.subtracts:
        return [[run.grads[i].view(group.m, group.n) for i in group.indices] for group in layout.groups]
    arena_dtype = run.arena.dtype
    if grad_dtype != torch.float16 and pair.dtype != arena_dtype:  # one cast of both factors
        pair = pair.to(arena_dtype)
        factors = [(group.p_view(pair[p_at:]), group.q_view(pair[q_at:])) for group in layout.groups]
    return [(p.to(arena_dtype), q.to(arena_dtype)) for p, q in factors]


def _half_factors(run: JobRun, pair: torch.Tensor, p_at: int, q_at: int) -> list:
    """fp16 gradients: the factors moved to the same scale by a power of two (exact) before the cast,
    since Q's entries can exceed fp16 although Ĝ's do not; the poison goes into P."""
    factors = []
    for group in run.layout.groups:
        shift = half_wire_shift(group.m)
        p_t = (group.p_view(pair[p_at:]) + run.kept.step.poison) / shift
        factors.append((p_t.to(torch.float16), (group.q_view(pair[q_at:]) * shift).to(torch.float16)))
    return factors


def keep_residual(run: JobRun, factors: list) -> None:
    """e = M − P·Qᵀ for the whole call into ``run.residual`` (the arena itself, or an uncommitted step's
    spare, M left intact for a rollback): one batched product per shape group that reads M and writes
    e (``baddbmm``, β = 1, α = −1), Ĝ never read back; or, from Ĝ's matrices (a CPU's choice),
    e = M − Ĝ, one element-wise pass each."""
    for group, factor in zip(run.layout.groups, factors):
        if isinstance(factor, list):
            for m, estimate, e in zip(group.error_view(run.arena), factor, group.error_view(run.residual)):
                torch.sub(m, estimate, out=e)
        else:
            p_t, q_t = factor
            torch.baddbmm(
                group.error_view(run.arena), p_t.transpose(1, 2), q_t, alpha=-1, out=group.error_view(run.residual)
            )
