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
QR per block on a CPU (`edgc.engine.layout.CallLayout`, `edgc.engine.factors.orthonormalize_blocks_`,
`LowRankCompressor.orthonormalization`). What touches the gradients goes matrix by matrix, where they
lie: M = G + e reads each gradient once, Ĝ is written straight into it, and no copy of the
gradients is made (bytes and memory: `edgc_bench.dispatch_count`). A call issues three
all-reduces (raw + a non-finite flag, P, Q). A call's layout, its error-feedback arena and its Q
buffer are kept from step to step (`edgc.engine.engine_state.CallState`), so a steady step copies no Q and
allocates no error feedback. A call is a job of three stretches between its two yields: form M and
P and send P (`_send_p`), take the raw average and send Q (`_send_q`), then decompress and keep
(`_finish`); with ``power_iterations = 2`` the compressed matrices go through a second call.

The compressor holds its state (``compressor.state``, an `edgc.engine.engine_state.EngineState`): Q and error
feedback per parameter name (``q``, ``error``, read here too), `snapshot`/`restore` of the shared
part (Q), `commit`/`rollback` of an uncommitted step (``begin_step(uncommitted=True)``: the residual
goes to a spare arena so that M survives; rollback makes M the error feedback again, so the step's
gradient is sent next time), `end_step` after a non-finite step, `drop_error`, and `state_dict`.

Factors and error feedback are fp32 for fp32/bf16/fp16 gradients (fp64 ones stay fp64); error
feedback in the gradient's dtype with ``error_feedback_dtype='gradient'``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch

from ..config import EDGCConfig, LowRankConfig
from ..device.finite import nan_unless_finite
from ..distributed.comm import FINISHES, ISSUES_MORE, Communicator, Job, Pending, run_job
from . import rank_change
from .engine_state import CallState, EngineState, subtracts_estimate
from .factors import compressed_rank, orthonormalize_blocks_
from .layout import CallLayout
from .orthonormal_choice import agreed, orthonormalization_for

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
    error_sq: float | torch.Tensor = 0.0  # ‖M − Ĝ‖² over compressed matrices (when measured; `ERROR_SAMPLE`)
    norm_sq: float | torch.Tensor = 0.0  # ‖M‖² over compressed matrices (when measured; `ERROR_SAMPLE`)
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


# A measured call reads every s-th row of its matrices' M and e, s chosen so that it reads about this
# many elements (s = 1, every row, for a call this small or smaller): ‖M − Ĝ‖/‖M‖ from the residual
# as written, at a cost that does not grow with the model (a whole pass over M is 4 bytes per element).
ERROR_SAMPLE = 1 << 16


def _row_stride(layout: CallLayout, sampled: bool) -> int:
    return max(1, layout.error_numel // ERROR_SAMPLE) if sampled else 1


def _squares(arena: torch.Tensor, layout: CallLayout, stride: int) -> torch.Tensor:
    """The summed squared norms of the call's compressed matrices in ``arena`` (M, or the residual e) as
    a float64 device scalar, from every ``stride``-th row of each (scaled by rows / rows read: exact at
    stride 1). One read of those rows per shape group, accumulated in float32 at least (a
    half-precision sum loses digits; asked of a half-precision tensor, a GPU's norm accumulates in
    float32 without a copy, where a float64 accumulation would first copy the rows)."""
    half = arena.dtype in (torch.float16, torch.bfloat16)
    total = torch.zeros((), dtype=torch.float64, device=arena.device)
    for group in layout.groups:
        rows = group.error_view(arena)[:, ::stride]
        norm = torch.linalg.vector_norm(rows, dtype=torch.float32 if half else None).to(torch.float64)
        total = total.add(norm.square(), alpha=group.m / rows.shape[1])
    return total


def _half_wire_shift(size: int) -> float:
    """A power of two ≈ 1/√size: scales a factor so that its entries stay within the gradient's
    range on an fp16 wire. Powers of two scale exactly, so scaling back loses nothing."""
    return 2.0 ** -math.ceil(math.log2(max(1.0, math.sqrt(size))))


@dataclass
class _Call:
    """What one call carries from one stretch of its job to the next (see `LowRankCompressor.reduce_steps`)."""

    kept: CallState
    grads: list[torch.Tensor]
    compute: torch.dtype  # of M, P and Q: float64 for float64 gradients, else float32
    wire: torch.dtype  # of P and Q on the wire
    half_wire: bool  # an fp16 wire between ranks: factors scaled by a power of two (`_half_wire_shift`)
    measure_error: bool
    stats: ReduceStats
    arena: torch.Tensor | None = None  # M, in the error-feedback arena
    q_stored: torch.Tensor | None = None  # the warm start as stored (kept again after a non-finite step)
    p_flat: torch.Tensor | None = None
    q_flat: torch.Tensor | None = None
    raw_flat: torch.Tensor | None = None  # the raw tensors and the non-finite flag, averaged
    poison: torch.Tensor | None = None  # 0 or NaN: NaN when the group saw a NaN/Inf
    local_q: torch.Tensor | None = None  # Q = Mᵀ·P before the average (the error measurement)

    @property
    def layout(self) -> CallLayout:
        return self.kept.layout


class LowRankCompressor:
    """PowerSGD compression of named gradients with error feedback and warm-started Q; see the module
    docstring.

    ``state``: what it keeps between steps (`edgc.engine.engine_state.EngineState`). ``power_iterations`` and
    ``force_accelerator_kernels`` are its config's (`LowRankConfig`), set when it is built.

    Args:
        config: the engine's `LowRankConfig` (or an `EDGCConfig`, whose ``engine`` it is).

    Raises:
        TypeError: ``config`` is neither.
    """

    def __init__(self, config: LowRankConfig | EDGCConfig):
        if isinstance(config, EDGCConfig):
            config = config.engine
        if not isinstance(config, LowRankConfig):
            raise TypeError(f"LowRankCompressor takes a LowRankConfig (or an EDGCConfig), got {type(config).__name__}")
        self.config = config
        self.state = EngineState(config)

    @property
    def power_iterations(self) -> int:
        """`LowRankConfig.power_iterations`: 1, or 2 for a second power iteration on the compressed matrices."""
        return self.config.power_iterations

    @property
    def force_accelerator_kernels(self) -> bool:
        """`LowRankConfig.force_accelerator_kernels`: a CPU runs a fast-float64 GPU's kernels."""
        return self.config.force_accelerator_kernels

    @property
    def q(self) -> dict[str, torch.Tensor]:
        """name → (n, r) warm-start Q, identical on every rank (`EngineState.q`)."""
        return self.state.q

    @property
    def error(self) -> dict[str, torch.Tensor]:
        """name → (m, n) error feedback of this rank (`EngineState.error`)."""
        return self.state.error

    def compressed_rank(self, shape: tuple[int, int] | None, rank: int) -> int:
        """The rank a matrix is compressed at.

        Args:
            shape: the matrix's (m, n); None: not a matrix.
            rank: the step's rank.

        Returns:
            The rank used, or 0 when it is cheaper to send the matrix raw.
        """
        return compressed_rank(shape, rank, self.config.min_compression_rate)

    def compressed_shapes(self, rank: int) -> tuple[tuple[int, int], ...]:
        """The matrices the engine has seen (its state's record, `EngineState.shapes`) that it compresses.

        Args:
            rank: the step's rank.

        Returns:
            (m, n) of each.
        """
        return tuple(shape for shape in self.state.shapes.values() if self.compressed_rank(shape, rank))

    def orthonormalization(self, device: torch.device) -> str:
        """The method that orthonormalises this engine's factors on ``device`` (`edgc.engine.factors`):
        ``LowRankConfig.orthonormalization`` where it names one, else the one its state keeps (the
        group's, `agree_orthonormalization`, or a checkpoint's), else this process's choice for the
        device (`edgc.engine.orthonormal_choice`; a fast-float64 GPU's with ``force_accelerator_kernels``).

        Args:
            device: the factors' device.

        Returns:
            The method's name.
        """
        if self.config.orthonormalization != "auto":
            return self.config.orthonormalization
        if self.force_accelerator_kernels and device.type == "cpu":
            return "cholesky2-fp64"
        if self.state.orthonormalization is None:
            self.state.orthonormalization = orthonormalization_for(device)
        return self.state.orthonormalization

    def agree_orthonormalization(self, device: torch.device, comm: Communicator) -> None:
        """Where the method is the engine's to choose and no checkpoint chose it: this rank's choice on
        ``device`` made the group's (`edgc.engine.orthonormal_choice.agreed`; on a CPU every rank takes
        Householder by rule, and nothing is sent). Call on every rank at the same point.

        Args:
            device: the factors' device.
            comm: the group's communicator.
        """
        if self.config.orthonormalization != "auto" or self.state.orthonormalization is not None:
            return
        if device.type == "cpu" or self.force_accelerator_kernels:
            self.orthonormalization(device)
            return
        self.state.orthonormalization = agreed(orthonormalization_for(device), comm, device)

    def change_rank(self, rank: int, comm: Communicator) -> tuple[int, int]:
        """Give every stored Q the columns of ``rank``, keeping the warm start (`edgc.engine.rank_change.change_rank`):
        one blocking all-reduce when some Q grows under the 'warm' rule.

        Args:
            rank: the new rank.
            comm: the group's communicator.

        Returns:
            (elements, bytes) it sent.
        """
        before = dict(self.q)
        sent = rank_change.change_rank(self.state, rank, comm)
        self.state.note_resized({name: q for name, q in before.items() if self.q.get(name) is not q})
        return sent

    def state_dict(self, *, include_error: bool = True) -> dict:
        """`EngineState.state_dict`.

        Args:
            include_error: keep this rank's error feedback in it.

        Returns:
            The state, for `load_state_dict`.
        """
        return self.state.state_dict(include_error=include_error)

    def load_state_dict(self, state: dict, *, keep_error: bool = False) -> None:
        """`EngineState.load_state_dict`.

        Args:
            state: what `state_dict` returned.
            keep_error: this rank's error feedback stays, a peer's share loaded.
        """
        self.state.load_state_dict(state, keep_error=keep_error)

    def reduce(
        self, names: list[str], grads: list[torch.Tensor], rank: int, comm: Communicator, *, measure_error: bool = True
    ) -> ReduceStats:
        """Blocking form of `reduce_steps`: replace ``grads`` in place with their compressed average.

        Args:
            names: the gradients' parameter names.
            grads: the gradients, averaged in place.
            rank: the step's rank.
            comm: the group's communicator.
            measure_error: measure the step's compression error.

        Returns:
            The step's `ReduceStats`.
        """
        return run_job(self.reduce_steps(names, grads, rank, comm, measure_error=measure_error))

    def reduce_steps(
        self, names: list[str], grads: list[torch.Tensor], rank: int, comm: Communicator, *, measure_error: bool = False
    ) -> Job:
        """The compressed average of ``grads`` as a job (`edgc.distributed.comm`): three collectives, two yields
        per power iteration.

        Forms M = G + e in the error-feedback arena and Pᵀ = Qᵀ·Mᵀ, issues the raw tensors (+ a
        non-finite flag) and P, yields; orthonormalises P, computes Qᵀ = Pᵀ·M and issues it,
        yields; writes Ĝ = P·Qᵀ into the gradients and e = M − P·Qᵀ. No host read of a device value:
        a non-finite step is handled by device-side selects, and the caller calls
        `EngineState.end_step` when it learns of one. A second power iteration repeats this on the
        compressed matrices, whose M = Ĝ₁ + e₁ is the same M, from the Q just agreed: its P and Q
        cost as many bytes again, and the step's error is its own.

        Args:
            names: the gradients' parameter names.
            grads: the gradients, averaged in place.
            rank: the step's rank.
            comm: the group's communicator.
            measure_error: measure the step's compression error.

        Returns:
            The job, a generator whose value is the step's `ReduceStats`.
        """
        stats = yield from self._power_iteration(names, grads, rank, comm, measure_error)
        for _ in range(self.power_iterations - 1):
            compressed = [i for i, name in enumerate(names) if stats.ranks.get(name)]
            if not compressed:
                break
            again = yield from self._power_iteration(
                [names[i] for i in compressed], [grads[i] for i in compressed], rank, comm, measure_error
            )
            stats.elements_sent += again.elements_sent
            stats.bytes_sent += again.bytes_sent
            stats.error_sq, stats.norm_sq = again.error_sq, again.norm_sq
            stats.nonfinite = stats.nonfinite | again.nonfinite
        return stats

    def _power_iteration(
        self, names: list[str], grads: list[torch.Tensor], rank: int, comm: Communicator, measure_error: bool
    ) -> Job:
        """One call of `reduce_steps`: its three stretches between two yields."""
        run, raw_sent, p_sent = self._send_p(names, grads, rank, comm, measure_error)
        yield ISSUES_MORE if run.layout.groups else FINISHES
        if not self._take_raw(run, raw_sent):
            return run.stats
        q_sent = self._send_q(run, p_sent, comm)
        yield FINISHES
        self._finish(run, q_sent)
        return run.stats

    def _send_p(
        self, names: list[str], grads: list[torch.Tensor], rank: int, comm: Communicator, measure_error: bool
    ) -> tuple[_Call, Pending, Pending | None]:
        """First stretch: the call's buffers, M = G + e and the warm start (`EngineState.open_call`),
        Pᵀ = Qᵀ·Mᵀ (one batched product per shape group); issue the raw tensors with their
        non-finite flag, and P."""
        grad_dtype, device = grads[0].dtype, grads[0].device
        compute = torch.float64 if grad_dtype == torch.float64 else torch.float32
        wire = DTYPES[self.config.communication_dtype] if self.config.communication_dtype else grad_dtype
        kept, arena, q_stored, q_in = self.state.open_call(names, grads, rank, compute, self.orthonormalization(device))
        layout = kept.layout
        stats = ReduceStats(ranks=dict(layout.ranks))
        stats.elements_raw = sum(g.numel() for g in grads)
        stats.bytes_raw = stats.elements_raw * grads[0].element_size()
        run = _Call(
            kept,
            grads,
            compute,
            wire,
            wire == torch.float16 and comm.world_size > 1,
            measure_error,
            stats,
            arena=arena,
            q_stored=q_stored,
        )
        run.p_flat = torch.empty(layout.p_numel, device=device, dtype=compute)
        run.q_flat = torch.empty(layout.q_numel, device=device, dtype=compute)
        for group in layout.groups:
            _bmm_into(group.p_view(run.p_flat), group.q_view(q_in), group.error_view(arena).transpose(1, 2))
            if run.half_wire:  # P is orthonormalised after the sum: its scale is free
                group.p_view(run.p_flat).mul_(_half_wire_shift(group.n))
        # Raw tensors plus one flag element, 0 or NaN: NaN when anything is non-finite here
        # (`edgc.device.finite`: sums that finite half-precision values cannot overflow). It stays NaN
        # through the average, so every rank learns of a NaN/Inf anywhere in the group. A NaN/Inf
        # anywhere in M makes its P non-finite, so P stands for the compressed part.
        run.raw_flat = torch.cat([grads[i].reshape(-1) for i in layout.raw] + [grads[0].new_zeros(1)])
        run.raw_flat[-1:].copy_(nan_unless_finite(run.p_flat, run.raw_flat[:-1]))
        raw_sent = comm.mean_async(run.raw_flat)
        run.stats.elements_sent = run.raw_flat.numel()
        run.stats.bytes_sent = run.raw_flat.numel() * run.raw_flat.element_size()
        if not layout.groups:
            return run, raw_sent, None
        p_sent = comm.mean_async(run.p_flat, run.wire)
        self._count_sent(run.stats, run.p_flat, run.wire)
        return run, raw_sent, p_sent

    def _take_raw(self, run: _Call, raw_sent: Pending) -> bool:
        """Second stretch, first part: the raw tensors' average into their gradients and the group's
        non-finite flag; whether the call compresses anything (else it is done)."""
        raw_sent.wait()
        layout, raw_flat = run.layout, run.raw_flat
        if layout.raw:
            torch._foreach_copy_(
                [run.grads[i].view(-1) for i in layout.raw],
                list(raw_flat[:-1].split([run.grads[i].numel() for i in layout.raw])),
            )
        run.poison = raw_flat[-1:].float()  # identical on every rank: it is an average
        if not layout.groups:
            run.stats.nonfinite = run.poison.isnan().reshape(())
        return bool(layout.groups)

    def _send_q(self, run: _Call, p_sent: Pending, comm: Communicator) -> Pending:
        """Second stretch: orth(P), Qᵀ = Pᵀ·M, issue Q. A factorisation that fails leaves its rows NaN,
        and so its Q: the flag catches it, and the step is non-finite rather than wrong."""
        p_sent.wait()
        layout, p_flat, q_flat = run.layout, run.p_flat, run.q_flat
        orthonormalize_blocks_(
            p_flat,
            layout.p_blocks,
            self.config.orthogonalization_epsilon,
            method=self.orthonormalization(p_flat.device),
        )
        for group in layout.groups:
            _bmm_into(group.q_view(q_flat), group.p_view(p_flat), group.error_view(run.arena))
        if run.measure_error:
            if not self.config.error_feedback:  # no residual to read after: ‖M − Ĝ‖² from ‖M‖² and Q
                run.local_q = q_flat.clone()
            stride = _row_stride(layout, sampled=self.config.error_feedback)
            run.stats.norm_sq = _squares(run.arena, layout, stride)
        if run.half_wire:
            for group in layout.groups:
                group.q_view(q_flat).mul_(_half_wire_shift(group.m))
        q_sent = comm.mean_async(q_flat, run.wire)
        self._count_sent(run.stats, q_flat, run.wire)
        return q_sent

    def _finish(self, run: _Call, q_sent: Pending) -> None:
        """Third stretch: the group's verdict on finiteness (an fp16 wire can overflow; the averages are
        identical on every rank, so is the verdict), Ĝ and e, the new Q (the stored one after a
        non-finite step), and ‖M − Ĝ‖² where measured."""
        q_sent.wait()
        q_flat = run.q_flat
        if run.half_wire:
            for group in run.layout.groups:
                group.q_view(q_flat).div_(_half_wire_shift(group.m))
        poison = run.poison + nan_unless_finite(q_flat)
        bad = poison.isnan().reshape(())
        run.stats.nonfinite = bad
        factors = self._decompress(run.kept, run.grads, run.arena, run.p_flat, q_flat, poison)
        self.state.close_call(run.kept, run.arena, factors, run.q_stored, q_flat, bad)
        if run.measure_error and run.local_q is None:
            # ‖e‖² = ‖M − Ĝ‖² read from the residual just written, on the rows ‖M‖² was read from
            run.stats.error_sq = _squares(run.kept.arena, run.layout, _row_stride(run.layout, sampled=True))
        elif run.measure_error:
            # ‖M − P·Qᵀ‖² = ‖M‖² − 2⟨Mᵀ·P, Q⟩ + ‖Q‖² for orthonormal P: no pass over M.
            cross = torch.dot(run.local_q, q_flat).to(torch.float64)
            square = torch.dot(q_flat, q_flat).to(torch.float64)
            run.stats.error_sq = (run.stats.norm_sq - 2 * cross + square).clamp(min=0)

    def _decompress(
        self,
        call: CallState,
        grads: list[torch.Tensor],
        arena: torch.Tensor,
        p_flat: torch.Tensor,
        q_flat: torch.Tensor,
        poison: torch.Tensor,
    ) -> list[tuple[torch.Tensor, torch.Tensor]] | list[list[torch.Tensor]] | None:
        """Ĝ = P·Qᵀ written straight into each gradient (one product per matrix: the gradients lie in
        DDP's buckets, not at one stride); returns, with error feedback, the factors Ĝ was formed from
        (a half-precision gradient's: rounded to its dtype) in the arena's dtype, for e = M − P·Qᵀ
        (`EngineState.close_call`), so that Ĝ + e = M but for the rounding of Ĝ's own values; on a
        CPU with Ĝ in the arena's dtype, Ĝ's matrices themselves (`edgc.engine.engine_state.subtracts_estimate`). The
        step's ``poison`` (0 or NaN) goes into Ĝ's P: on a non-finite step Ĝ is NaN everywhere, so
        every rank's optimizer (or GradScaler) skips it; the residual of such a step is cleared by
        `EngineState.end_step`."""
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
            return None
        cpu_kernels = arena.device.type == "cpu" and not self.force_accelerator_kernels
        if subtracts_estimate(cpu_kernels, grad_dtype == arena.dtype):
            return [[grads[i].view(group.m, group.n) for i in group.indices] for group in call.layout.groups]
        if not half:  # one cast of each flat buffer to the arena's dtype, not one per group
            p_grad, q_grad = p_grad.to(arena.dtype), q_grad.to(arena.dtype)
            factors = [(group.p_view(p_grad), group.q_view(q_grad)) for group in call.layout.groups]
        return [(p.to(arena.dtype), q.to(arena.dtype)) for p, q in factors]

    @staticmethod
    def _count_sent(stats: ReduceStats, values: torch.Tensor, wire_dtype: torch.dtype) -> None:
        stats.elements_sent += values.numel()
        stats.bytes_sent += values.numel() * torch.empty((), dtype=wire_dtype).element_size()
