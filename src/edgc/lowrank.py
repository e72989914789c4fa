"""The PowerSGD engine: rank-r compression with error feedback and warm-started Q, batched by shape.

For every gradient with ≥ 2 dimensions, viewed as M (m × n) = (shape[0], rest)
as torch's hook views it:

    M ← G + e                      error feedback (e = what earlier steps failed to send)
    P ← M · Q                      Q warm-started from the previous step, rows at unit norm
    all-reduce-mean(P); P ← orth(P)
    Q ← Mᵀ · P
    all-reduce-mean(Q)
    Ĝ ← P · Qᵀ                     the averaged, decompressed gradient (identical on all ranks)
    e ← M − P · Qᵀ                 the local residual, kept for the next step

so that Ĝ + mean(e) = mean(M) exactly: nothing is lost, only delayed (Ĝ as the product gives it,
before a half-precision gradient rounds it, as an uncompressed half-precision all-reduce rounds
its sum). Matrices where
(m + n)·r·min_compression_rate ≥ m·n (biases, LayerNorm, tiny matrices) gain nothing and are
sent raw in one buffer.

Batched by shape. A call's matrices of one (m, n, rank) are one batch in the products that read
M (P, Q and the residual, on the error-feedback arena), its P's (and Q's) share one flat buffer,
and the orthonormalisation is one batched Cholesky QR per rank on an accelerator, a Householder
QR per block on a CPU (`edgc.layout.CallLayout`, `edgc.factors.orthonormalize_blocks_`,
`EngineState.orthonormalization`). What touches the gradients goes matrix by matrix, where they
lie: M = G + e reads each gradient once, Ĝ is written straight into it, and no copy of the
gradients is made (bytes and memory: `edgc_bench.dispatch_count`). A call issues three
all-reduces (raw + a non-finite flag, P, Q). A call's layout, its error-feedback arena and its Q
buffer are kept from step to step (`_CallState`), so a steady step copies no Q and allocates no
error feedback.

The engine owns its state: Q and error feedback per parameter name (``q``, ``error``; read them,
change them through the methods), `snapshot`/`restore` of the shared part (Q), `commit`/`rollback`
of an uncommitted step (``begin_step(uncommitted=True)``: the residual goes to a spare arena so that
M survives; rollback makes M the error feedback again, so the step's gradient is sent next time),
`end_step` after a non-finite step, `change_rank`, `drop_error`, and `state_dict`.

Factors and error feedback are fp32 for fp32/bf16/fp16 gradients (fp64 ones stay fp64); error
feedback in the gradient's dtype with ``error_feedback_dtype='gradient'``.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch

from . import rank_change
from .comm import FINISHES, ISSUES_MORE, Communicator, Job, run_job
from .config import EDGCConfig, LowRankConfig
from .engine_state import CallState, EngineState
from .finite import nan_unless_finite
from .factors import compressed_rank, matrix_shape, orthonormalize_blocks_, orthonormalize_rows_, stable_seed
from .layout import CallLayout
from .timing import to_device

DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}


@dataclass
class ReduceStats:
    """What one call sent and how well it compressed (local view).

    ``error_sq``, ``norm_sq`` and ``nonfinite`` may be 0-dim device tensors: they are read once,
    at the end of the optimizer step, never per bucket.
    """

    elements_raw: int = 0  # elements an uncompressed all-reduce would have sent
    elements_sent: int = 0
    bytes_raw: int = 0
    bytes_sent: int = 0
    error_sq: float | torch.Tensor = 0.0  # ‖M − Ĝ‖² over compressed matrices (when measured)
    norm_sq: float | torch.Tensor = 0.0  # ‖M‖² over compressed matrices (when measured)
    nonfinite: bool | torch.Tensor = False  # the group saw a NaN/Inf: the averaged gradients are NaN
    ranks: dict[str, int] = field(default_factory=dict)  # per parameter; 0 = sent raw


def _bmm_into(out: torch.Tensor, a: torch.Tensor, b: torch.Tensor) -> None:
    """out = a·b (batched), computed in the dtype of the bigger operand: a half-precision gradient
    or error buffer is never copied whole, only small factors are cast."""
    big = max((out, a, b), key=torch.Tensor.numel).dtype
    a, b = a.to(big), b.to(big)
    if out.dtype == big:
        torch.bmm(a, b, out=out)
    else:
        out.copy_(torch.bmm(a, b))  # a small factor


def _squared_norm(arena: torch.Tensor, layout: CallLayout) -> torch.Tensor:
    """‖M‖² over the arena as a float64 device scalar; a half-precision arena group by group in
    float32 (a half-precision dot loses the digits the error formula subtracts)."""
    if arena.dtype in (torch.float32, torch.float64):
        return torch.dot(arena, arena).to(torch.float64)
    blocks = [group.error_view(arena).reshape(-1).float() for group in layout.groups]
    return torch.stack([torch.dot(b, b) for b in blocks]).sum().to(torch.float64)


def _half_wire_shift(size: int) -> float:
    """A power of two ≈ 1/√size: scales a factor so that its entries stay within the gradient's
    range on an fp16 wire. Powers of two scale exactly, so scaling back loses nothing."""
    return 2.0 ** -math.ceil(math.log2(max(1.0, math.sqrt(size))))


class LowRankCompressor(EngineState):
    """PowerSGD state (Q factors, error feedback) keyed by parameter name; see the module docstring."""

    def __init__(self, config: LowRankConfig | EDGCConfig):
        """``config``: the engine's own settings, or an `EDGCConfig` whose `EDGCConfig.engine` they are."""
        if isinstance(config, EDGCConfig):
            config = config.engine
        if not isinstance(config, LowRankConfig):
            raise TypeError(f"LowRankCompressor takes a LowRankConfig (or an EDGCConfig), got {type(config).__name__}")
        super().__init__(config)

    def compressed_rank(self, shape: tuple[int, int] | None, rank: int) -> int:
        """Rank used for a matrix of this shape, or 0 when it is cheaper to send it raw."""
        return compressed_rank(shape, rank, self.config.min_compression_rate)

    def resize_q(self, name: str, n: int, rank: int, device: torch.device) -> torch.Tensor:
        """This parameter's warm-start Q with exactly ``rank`` columns (`edgc.rank_change.resize_q`)."""
        return rank_change.resize_q(self, name, n, rank, device)

    def change_rank(self, rank: int, comm: Communicator) -> tuple[int, int]:
        """Give every stored Q the columns of ``rank``, keeping the warm start (`edgc.rank_change.change_rank`):
        one blocking all-reduce when some Q grows under the 'warm' rule; (elements, bytes) it sent."""
        before = dict(self.q)
        sent = rank_change.change_rank(self, rank, comm)
        self._note_resized({name: q for name, q in before.items() if self.q.get(name) is not q})
        return sent

    def reduce(self, names: list[str], grads: list[torch.Tensor], rank: int, comm: Communicator,
               *, measure_error: bool = True) -> ReduceStats:
        """Blocking form of `reduce_steps`: replace ``grads`` in place with their compressed average."""
        return run_job(self.reduce_steps(names, grads, rank, comm, measure_error=measure_error))

    def reduce_steps(self, names: list[str], grads: list[torch.Tensor], rank: int, comm: Communicator,
                     *, measure_error: bool = False) -> Job:
        """The compressed average of ``grads`` as a job (`edgc.comm`): three collectives, two yields.

        Forms M = G + e in the error-feedback arena and Pᵀ = Qᵀ·Mᵀ, issues the raw tensors (+ a
        non-finite flag) and P, yields; orthonormalises P, computes Qᵀ = Pᵀ·M and issues it,
        yields; writes Ĝ = P·Qᵀ into the gradients and e = M − P·Qᵀ. No host read of a device value:
        a non-finite step is handled by device-side selects, and the caller calls `end_step` when
        it learns of one. Returns `ReduceStats`.
        """
        config = self.config
        call = self._call_state(names, grads, rank)
        layout = call.layout
        grad_dtype, device = grads[0].dtype, grads[0].device
        compute = torch.float64 if grad_dtype == torch.float64 else torch.float32
        wire = DTYPES[config.communication_dtype] if config.communication_dtype else grad_dtype
        half_wire = wire == torch.float16 and comm.world_size > 1
        stats = ReduceStats(ranks=dict(layout.ranks))
        stats.elements_raw = sum(g.numel() for g in grads)
        stats.bytes_raw = stats.elements_raw * grads[0].element_size()
        self._flush_into_raw(layout, grads)

        # ---- M = G + e in the arena, Pᵀ = Qᵀ·Mᵀ (one batched product per shape group).
        arena = self._form_m(call, grads, compute)
        q_stored, q_in = self._warm_start(call, device, compute) if layout.groups else (None, None)
        p_flat = torch.empty(layout.p_numel, device=device, dtype=compute)
        q_flat = torch.empty(layout.q_numel, device=device, dtype=compute)
        for group in layout.groups:
            _bmm_into(group.p_view(p_flat), group.q_view(q_in), group.error_view(arena).transpose(1, 2))
            if half_wire:  # P is orthonormalised after the sum: its scale is free
                group.p_view(p_flat).mul_(_half_wire_shift(group.n))

        # Raw tensors plus one flag element, 0 or NaN: NaN when anything is non-finite here
        # (`edgc.finite`: sums that finite half-precision values cannot overflow). It stays NaN
        # through the average, so every rank learns of a NaN/Inf anywhere in the group. A NaN/Inf
        # anywhere in M makes its P non-finite, so P stands for the compressed part.
        raw_flat = torch.cat([grads[i].reshape(-1) for i in layout.raw] + [grads[0].new_zeros(1)])
        raw_flat[-1:].copy_(nan_unless_finite(p_flat, raw_flat[:-1]))
        raw_sent = comm.mean_async(raw_flat)
        stats.elements_sent = raw_flat.numel()
        stats.bytes_sent = raw_flat.numel() * raw_flat.element_size()
        if layout.groups:
            p_sent = comm.mean_async(p_flat, wire)
            self._count_sent(stats, p_flat, wire)
        yield ISSUES_MORE if layout.groups else FINISHES

        raw_sent.wait()
        if layout.raw:
            torch._foreach_copy_([grads[i].view(-1) for i in layout.raw],
                                 list(raw_flat[:-1].split([grads[i].numel() for i in layout.raw])))
        poison = raw_flat[-1:].float()  # identical on every rank: it is an average
        if not layout.groups:
            stats.nonfinite = poison.isnan().reshape(())
            return stats
        p_sent.wait()

        # ---- orth(P), Qᵀ = Pᵀ·M. A factorisation that fails leaves its rows NaN, and so its Q: the
        # flag below catches it, and the step is non-finite rather than wrong.
        orthonormalize_blocks_(p_flat, layout.p_blocks, config.orthogonalization_epsilon,
                               method=self.orthonormalization(device))
        for group in layout.groups:
            _bmm_into(group.q_view(q_flat), group.p_view(p_flat), group.error_view(arena))
        if measure_error:
            local_q = q_flat.clone()
            stats.norm_sq = _squared_norm(arena, layout)
        if half_wire:
            for group in layout.groups:
                group.q_view(q_flat).mul_(_half_wire_shift(group.m))
        q_sent = comm.mean_async(q_flat, wire)
        self._count_sent(stats, q_flat, wire)
        yield FINISHES

        q_sent.wait()
        if half_wire:
            for group in layout.groups:
                group.q_view(q_flat).div_(_half_wire_shift(group.m))
        # An fp16 wire can overflow; the averages are identical on every rank, so is the verdict.
        poison = poison + nan_unless_finite(q_flat)
        bad = poison.isnan().reshape(())
        stats.nonfinite = bad
        self._decompress(call, grads, arena, p_flat, q_flat, poison)
        self._keep_q(call, torch.where(bad, q_stored, q_flat))
        if measure_error:
            # ‖M − P·Qᵀ‖² = ‖M‖² − 2⟨Mᵀ·P, Q⟩ + ‖Q‖² for orthonormal P: no pass over M.
            cross = torch.dot(local_q, q_flat).to(torch.float64)
            square = torch.dot(q_flat, q_flat).to(torch.float64)
            stats.error_sq = (stats.norm_sq - 2 * cross + square).clamp(min=0)
        return stats

    def _decompress(self, call: CallState, grads: list[torch.Tensor], arena: torch.Tensor, p_flat: torch.Tensor,
                    q_flat: torch.Tensor, poison: torch.Tensor) -> None:
        """Ĝ = P·Qᵀ written straight into each gradient (one product per matrix: the gradients lie in
        DDP's buckets, not at one stride), and e = M − P·Qᵀ from the factors Ĝ was formed from (a
        half-precision gradient's: rounded to its dtype), so that Ĝ + e = M but for the rounding of
        Ĝ's own values. The step's ``poison`` (0 or NaN) goes into Ĝ's P: on a non-finite step Ĝ is
        NaN everywhere, so every rank's optimizer (or GradScaler) skips it; the residual of such a
        step is cleared by `end_step`."""
        grad_dtype = grads[0].dtype
        half = grad_dtype == torch.float16
        # P + poison, cast to the gradient's dtype in the same pass (fp16: after the shift below)
        p_grad = torch.add(p_flat, poison, out=torch.empty_like(p_flat, dtype=p_flat.dtype if half else grad_dtype))
        q_grad = q_flat if half else q_flat.to(grad_dtype)
        factors = []
        for group in call.layout.groups:
            p_t, q_t = group.p_view(p_grad), group.q_view(q_grad)
            if half:
                # Factors moved to the same scale by a power of two (exact) before the cast: Q's
                # entries can exceed fp16 although Ĝ's do not.
                shift = _half_wire_shift(group.m)
                p_t, q_t = (p_t / shift).to(grad_dtype), (q_t * shift).to(grad_dtype)
            for a, b, i in zip(p_t.transpose(1, 2).unbind(0), q_t.unbind(0), group.indices):
                torch.mm(a, b, out=grads[i].view(group.m, group.n))
            factors.append((p_t, q_t))
        if not self.config.error_feedback:
            return
        if not half:  # one cast of each flat buffer to the arena's dtype, not one per group
            p_grad, q_grad = p_grad.to(arena.dtype), q_grad.to(arena.dtype)
            factors = [(group.p_view(p_grad), group.q_view(q_grad)) for group in call.layout.groups]
        self._keep_residual(call, arena, [(p.to(arena.dtype), q.to(arena.dtype)) for p, q in factors])

    @staticmethod
    def _count_sent(stats: ReduceStats, values: torch.Tensor, wire_dtype: torch.dtype) -> None:
        stats.elements_sent += values.numel()
        stats.bytes_sent += values.numel() * torch.empty((), dtype=wire_dtype).element_size()

    def probe_error(self, names: list[str], grads: list[torch.Tensor], rank: int) -> torch.Tensor:
        """(‖M − M̂_rank‖², ‖M‖²) of one seeded randomised power iteration, summed over local matrices.

        Used by the warm-up test; local only (no communication), seeded per parameter so the same
        gradient always gives the same value, and returned as a float64 device tensor (read at
        the end of the step). A non-finite gradient gives an infinite error.
        """
        device = grads[0].device if grads else torch.device("cpu")
        total = torch.zeros(2, dtype=torch.float64, device=device)
        for name, grad in zip(names, grads):
            shape = matrix_shape(grad)
            if shape is None:
                continue
            m, n = shape
            r = min(rank, m, n)
            matrix = grad.detach().view(m, n).float()
            generator = torch.Generator().manual_seed(stable_seed(self.config.seed, name, "probe"))
            q = to_device(torch.randn(1, n, r, generator=generator), grad.device).transpose(1, 2)
            p = orthonormalize_rows_(torch.bmm(q, matrix.T.unsqueeze(0)))[0]  # Pᵀ (r × m) of P = orth(M·Q)
            error = (matrix - p.T @ (p @ matrix)).square().sum().double()
            norm = matrix.square().sum().double()
            total += torch.stack([torch.where(torch.isfinite(error), error, float("inf")), norm])
        return total
