"""The PowerSGD engine: rank-r compression with error feedback and warm-started Q.

For every gradient with ≥ 2 dimensions, viewed as M (m × n) = (shape[0], rest):

    M ← G + e                      error feedback (e = what earlier steps failed to send)
    P ← M · orth(Q)                Q warm-started from the previous step
    all-reduce-mean(P); P ← orth(P)
    Q ← Mᵀ · P
    all-reduce-mean(Q)
    Ĝ ← P · Qᵀ                     the averaged, decompressed gradient (identical on all ranks)
    e ← M − Ĝ                      the local residual, kept for the next step

so that Ĝ + mean(e) = mean(M) exactly: nothing is lost, only delayed. Matrices where
(m + n)·r·min_compression_rate ≥ m·n (biases, LayerNorm, tiny matrices) gain nothing and are
sent raw in one buffer. Same-shape matrices are batched (bmm), and all P's (and all Q's) of a
call live in one contiguous buffer, so a call issues exactly three all-reduces: raw, P, Q.

Rank changes keep error feedback (the residual is still what was not sent) and, by default, the
warm start of the power iteration: `edgc.rank_change`.

Factors and error feedback are fp32 for fp32/bf16/fp16 gradients (fp64 ones stay fp64).

Uncommitted steps (``keep_uncommitted``, used by fault-tolerant training): the residual is written
into a second buffer instead of over M, so that M survives the step; `commit` keeps the residual,
`rollback` makes M itself the error feedback again (the step's gradient is sent next time).
"""
from __future__ import annotations

import math
from collections import defaultdict
from dataclasses import dataclass, field

import torch

from . import rank_change
from .comm import FINISHES, ISSUES_MORE, Communicator, Job, run_job
from .config import EDGCConfig
from .factors import compressed_rank, matrix_shape, orthogonalize_, stable_seed
from .finite import all_finite
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
    # For the end of a non-finite step: error-feedback tensors this call updated (to clean of
    # NaN/Inf) and the Q factors it resized for a new rank (to put back as they were).
    touched_error: list[torch.Tensor] = field(default_factory=list)
    resized_q: dict[str, torch.Tensor] = field(default_factory=dict)


def _mm_into(out: torch.Tensor, a: torch.Tensor, b: torch.Tensor) -> None:
    """out = a·b, computed in the dtype of the bigger operand (a half-precision gradient or error
    buffer is never copied whole; only small factors are cast)."""
    big = max((out, a, b), key=torch.Tensor.numel).dtype
    a, b = a.to(big), b.to(big)
    if out.dtype == big:
        torch.mm(a, b, out=out)
    else:
        out.copy_(torch.mm(a, b))  # a small factor


def _half_wire_shift(size: int) -> float:
    """A power of two ≈ 1/√size: scales a factor so that its entries stay within the gradient's
    range on an fp16 wire. Powers of two scale exactly, so scaling back loses nothing."""
    return 2.0 ** -math.ceil(math.log2(max(1.0, math.sqrt(size))))


class LowRankCompressor:
    """PowerSGD state (Q factors, error feedback) keyed by parameter name."""

    def __init__(self, config: EDGCConfig):
        self.config = config
        self.q: dict[str, torch.Tensor] = {}  # name → (n, r) fp32, identical on every rank
        self.error: dict[str, torch.Tensor] = {}  # name → (m, n), this rank's residual
        self.shapes: dict[str, tuple[int, int]] = {}  # name → (m, n) of every matrix seen
        self._reseed: dict[tuple[str, int], torch.Tensor] = {}  # replacement columns for all-zero Q columns
        # Uncommitted steps (see the module docstring): M of this step, error feedback moved into a
        # raw-sent gradient this step, and spare residual buffers (reused, so no allocation per step).
        self.keep_uncommitted = False
        self._step_m: dict[str, torch.Tensor] = {}
        self._step_popped: dict[str, torch.Tensor] = {}
        self._spare: dict[str, torch.Tensor] = {}

    def compressed_rank(self, shape: tuple[int, int] | None, rank: int) -> int:
        """Rank used for a matrix of this shape, or 0 when it is cheaper to send it raw."""
        return compressed_rank(shape, rank, self.config.min_compression_rate)

    def resize_q(self, name: str, n: int, rank: int, device: torch.device) -> torch.Tensor:
        """This parameter's warm-start Q with exactly ``rank`` columns (`edgc.rank_change.resize_q`)."""
        return rank_change.resize_q(self, name, n, rank, device)

    def change_rank(self, rank: int, comm: Communicator) -> tuple[int, int]:
        """Give every stored Q the columns of ``rank``, keeping the warm start (`edgc.rank_change.change_rank`):
        one blocking all-reduce when some Q grows under the 'warm' rule; (elements, bytes) it sent."""
        return rank_change.change_rank(self, rank, comm)

    def _reseed_columns(self, name: str, n: int, rank: int, device: torch.device) -> torch.Tensor:
        """Fixed columns (same on every rank) that replace Q columns that collapsed to zero.

        A layer without gradient for a step has M = 0, so its new Q is 0; Gram–Schmidt keeps a
        zero column zero, and P = M·Q = 0 forever after. Replacing such columns (selected on
        the device, no host read) lets the power iteration start again.
        """
        key = (name, rank)
        columns = self._reseed.get(key)
        if columns is None or columns.shape[0] != n or columns.device != device:
            generator = torch.Generator().manual_seed(stable_seed(self.config.seed, name, "reseed", rank))
            columns = self._reseed[key] = to_device(torch.randn(n, rank, generator=generator), device)
        return columns

    def _error_dtype(self, grad_dtype: torch.dtype, compute_dtype: torch.dtype) -> torch.dtype:
        if self.config.error_feedback_dtype == "gradient":
            return grad_dtype
        return compute_dtype

    def reduce(self, names: list[str], grads: list[torch.Tensor], rank: int, comm: Communicator,
               *, measure_error: bool = True) -> ReduceStats:
        """Blocking form of `reduce_steps`: replace ``grads`` in place with their compressed average."""
        return run_job(self.reduce_steps(names, grads, rank, comm, measure_error=measure_error))

    def reduce_steps(self, names: list[str], grads: list[torch.Tensor], rank: int, comm: Communicator,
                     *, measure_error: bool = False) -> Job:
        """The compressed average of ``grads`` as a job (`edgc.comm`): three collectives, two yields.

        Forms M = G + e inside the error-feedback buffer and Pᵀ = orth(Q)ᵀ·Mᵀ, issues the raw
        tensors (+ a non-finite flag) and P, yields; computes Qᵀ = orth(P)ᵀ·M and issues it,
        yields; writes Ĝ = P·Qᵀ into the gradients and e = M − Ĝ. Factors are kept transposed
        (r × m, r × n): on CPU these products stream M row by row and run 2–4× faster than
        M·Q and Mᵀ·P. Memory beyond the persistent error feedback and Q: the P and Q buffers.
        No host read of a device value: a non-finite step is handled by device-side selects, and
        the caller calls `clear_nonfinite_error` when it learns of one. Returns `ReduceStats`.
        """
        config = self.config
        stats = ReduceStats()
        grad_dtype = grads[0].dtype
        wire_dtype = DTYPES[config.communication_dtype] if config.communication_dtype else grad_dtype
        half_wire = wire_dtype == torch.float16 and comm.world_size > 1
        device = grads[0].device
        compute_dtype = torch.float64 if grad_dtype == torch.float64 else torch.float32
        error_dtype = self._error_dtype(grad_dtype, compute_dtype)

        groups: dict[tuple[int, int, int], list[int]] = defaultdict(list)
        raw: list[int] = []
        for i, (name, grad) in enumerate(zip(names, grads)):
            shape = matrix_shape(grad)
            if shape is not None:
                self.shapes[name] = shape
            r = self.compressed_rank(shape, rank)
            stats.ranks[name] = r
            stats.elements_raw += grad.numel()
            if r:
                groups[(*matrix_shape(grad), r)].append(i)  # type: ignore[misc]
            else:
                raw.append(i)
                pending = self.error.pop(names[i], None)  # was compressed at an earlier rank
                if pending is not None:
                    grad.add_(pending.view_as(grad).to(grad.dtype))
                    if self.keep_uncommitted:
                        self._step_popped[names[i]] = pending
        stats.bytes_raw = stats.elements_raw * grads[0].element_size()

        # ---- M = G + e in place, Pᵀ = orth(Q)ᵀ·Mᵀ; every Pᵀ (and Qᵀ) of the call in one buffer.
        p_sizes = [len(ix) * m * r for (m, n, r), ix in groups.items()]
        q_sizes = [len(ix) * n * r for (m, n, r), ix in groups.items()]
        p_flat = torch.empty(sum(p_sizes), device=device, dtype=compute_dtype)
        q_flat = torch.empty(sum(q_sizes), device=device, dtype=compute_dtype)
        batches = []
        for ((m, n, r), indices), p_view, q_view in zip(groups.items(), p_flat.split(p_sizes), q_flat.split(q_sizes)):
            b = len(indices)
            p_t, q_t = p_view.view(b, r, m), q_view.view(b, r, n)
            old_q = []
            for k, i in enumerate(indices):
                stored = self.q.get(names[i])
                if stored is not None and stored.shape != (n, r):
                    stats.resized_q[names[i]] = stored
                old_q.append(self.resize_q(names[i], n, r, device).to(compute_dtype))
                q_t[k].copy_(old_q[k].T)
            if r <= 2:  # Gram–Schmidt keeps a zero column zero; QR (r > 2) recovers by itself
                reseed = torch.stack([self._reseed_columns(names[i], n, r, device).T for i in indices]).to(compute_dtype)
                q_t.copy_(torch.where(q_t.abs().sum(dim=2, keepdim=True) == 0, reseed, q_t))
            orthogonalize_(q_t.transpose(1, 2), config.orthogonalization_epsilon)
            matrices = [self._error_plus_gradient(names[i], grads[i].view(m, n), error_dtype, stats)
                        for i in indices]
            for k, matrix in enumerate(matrices):
                _mm_into(p_t[k], q_t[k], matrix.T)
            batches.append((indices, p_t, q_t, old_q, matrices, m, n))

        # Raw tensors plus one flag element: is anything non-finite anywhere in the group?
        # A NaN/Inf anywhere in M makes its P non-finite, so checking P's sum is enough.
        local_bad = ~all_finite(p_flat)
        raw_flat = torch.cat([grads[i].reshape(-1) for i in raw] + [local_bad.to(grad_dtype).reshape(1)])
        if raw:
            raw_flat[-1] = (local_bad | ~all_finite(raw_flat)).to(grad_dtype)
        raw_sent = comm.mean_async(raw_flat)
        stats.elements_sent = raw_flat.numel()
        stats.bytes_sent = raw_flat.numel() * raw_flat.element_size()
        if batches:
            if half_wire:
                for _, p_t, _, _, _, m, n in batches:
                    p_t.mul_(_half_wire_shift(n))  # P is orthonormalised after the sum: its scale is free
            p_sent = comm.mean_async(p_flat, wire_dtype)
            self._count_sent(stats, p_flat, wire_dtype)
        yield ISSUES_MORE if batches else FINISHES

        raw_sent.wait()
        offset = 0
        for i in raw:
            grads[i].view(-1).copy_(raw_flat[offset : offset + grads[i].numel()])
            offset += grads[i].numel()
        bad = raw_flat[-1] != 0  # identical on every rank: it is an average
        stats.nonfinite = bad
        if not batches:
            return stats
        p_sent.wait()

        # ---- Qᵀ = orth(P)ᵀ·M.
        for _, p_t, q_t, _, matrices, m, n in batches:
            orthogonalize_(p_t.transpose(1, 2), config.orthogonalization_epsilon)
            for k, matrix in enumerate(matrices):
                _mm_into(q_t[k], p_t[k], matrix)
        if measure_error:
            local_q = q_flat.clone()
            stats.norm_sq = sum(torch.dot(x.reshape(-1), x.reshape(-1)).to(torch.float64)
                                for batch in batches for x in batch[4])
        if half_wire:
            for _, _, q_t, _, _, m, n in batches:
                q_t.mul_(_half_wire_shift(m))
        q_sent = comm.mean_async(q_flat, wire_dtype)
        self._count_sent(stats, q_flat, wire_dtype)
        yield FINISHES

        q_sent.wait()
        if half_wire:
            for _, _, q_t, _, _, m, n in batches:
                q_t.div_(_half_wire_shift(m))
        # An fp16 wire can overflow; the averages are identical on every rank, so is the verdict.
        bad = bad | ~all_finite(p_flat) | ~all_finite(q_flat)
        stats.nonfinite = bad
        # ---- Ĝ = P·Qᵀ into the gradients, e = M − Ĝ. On a non-finite step Ĝ is NaN everywhere, so
        # every rank's optimizer (or GradScaler) skips it; Q keeps its old value.
        p_to_grad = p_flat + torch.where(bad, float("nan"), 0.0).to(compute_dtype)
        offset = 0
        for indices, p_t, q_t, old_q, matrices, m, n in batches:
            p_grad = p_to_grad[offset : offset + p_t.numel()].view_as(p_t)
            offset += p_t.numel()
            # A half-precision Ĝ is computed from factors moved to the same scale by a power of
            # two (exact), since Q's entries can exceed fp16 although Ĝ's do not.
            shift = _half_wire_shift(m) if grad_dtype == torch.float16 else 1.0
            for k, i in enumerate(indices):
                gradient = grads[i].view(m, n)
                if shift == 1.0:
                    _mm_into(gradient, p_grad[k].T, q_t[k])
                else:
                    _mm_into(gradient, p_grad[k].T / shift, q_t[k] * shift)
                if config.error_feedback and self.keep_uncommitted:
                    self._keep_residual(names[i], matrices[k], gradient, stats)
                elif config.error_feedback:
                    matrices[k].sub_(gradient)
                self.q[names[i]] = torch.where(bad, old_q[k], q_t[k].T)
        if measure_error:
            # ‖M − P·Qᵀ‖² = ‖M‖² − 2⟨Mᵀ·P, Q⟩ + ‖Q‖² for orthonormal P: no pass over M.
            cross = torch.dot(local_q, q_flat).to(torch.float64)
            square = torch.dot(q_flat, q_flat).to(torch.float64)
            stats.error_sq = (stats.norm_sq - 2 * cross + square).clamp(min=0)
        return stats

    def _error_plus_gradient(self, name: str, gradient: torch.Tensor, error_dtype: torch.dtype,
                             stats: ReduceStats) -> torch.Tensor:
        """M = G + e, formed inside this parameter's error-feedback buffer (M = G without EF)."""
        if not self.config.error_feedback:
            return gradient if gradient.dtype in (torch.float32, torch.float64) else gradient.to(error_dtype)
        m, n = gradient.shape
        error = self.error.get(name)
        if error is not None and error.numel() == m * n:
            # A loaded checkpoint or a changed error_feedback_dtype: same values, this layout.
            error = error.reshape(m, n).to(error_dtype)
            matrix = error.add_(gradient)
        else:
            matrix = gradient.to(error_dtype, copy=True)
        self.error[name] = matrix
        if self.keep_uncommitted:
            self._step_m[name] = matrix  # the residual goes to a spare buffer (`_keep_residual`)
        else:
            stats.touched_error.append(matrix)
        return matrix

    def _keep_residual(self, name: str, matrix: torch.Tensor, decompressed: torch.Tensor, stats: ReduceStats) -> None:
        """e = M − Ĝ into a spare buffer, M left intact (same arithmetic as ``M.sub_(Ĝ)``)."""
        residual = self._spare.pop(name, None)
        if residual is None or residual.shape != matrix.shape or residual.dtype != matrix.dtype:
            residual = torch.empty_like(matrix)
        torch.sub(matrix, decompressed, out=residual)
        self.error[name] = residual
        stats.touched_error.append(residual)  # a non-finite step clears the residual, never M

    def commit(self) -> None:
        """The step is applied: its residuals stay the error feedback; M's buffers become spares."""
        for name, matrix in self._step_m.items():
            if self.error.get(name) is not matrix:  # (a step cut short left M as the error feedback)
                self._spare[name] = matrix
        self._step_m, self._step_popped = {}, {}

    def rollback(self) -> None:
        """The step is discarded: error feedback becomes M = G + e of the step again (so nothing of
        the step's gradient is lost), error feedback moved into raw-sent gradients comes back.

        An M that holds a NaN/Inf (this replica's gradient was not finite) cannot be kept: it is
        zeroed, as a non-finite step's residual is (see `clear_nonfinite_error`)."""
        for name, matrix in self._step_m.items():
            residual = self.error.get(name)
            if residual is not None and residual is not matrix:
                self._spare[name] = residual
            matrix.masked_fill_(~torch.isfinite(matrix).all(), 0.0)
            self.error[name] = matrix
        self.error.update(self._step_popped)
        self._step_m, self._step_popped = {}, {}

    def clear_nonfinite_error(self, stats: ReduceStats) -> None:
        """After a non-finite step (known on the host at its end): clear the error feedback of the
        step's compressed matrices, and give Q factors resized for a new rank their old shape back.

        Why clear: M = G + e was formed in place before the group knew of the NaN/Inf, so e no
        longer holds the old residual alone; and with a GradScaler such a step halves the loss
        scale, so a kept residual would come back at twice its size. Q is kept as it was."""
        for error in stats.touched_error:
            error.zero_()
        self.q.update(stats.resized_q)

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
            q = orthogonalize_(to_device(torch.randn(1, n, r, generator=generator), grad.device))[0]
            p = orthogonalize_((matrix @ q).unsqueeze(0))[0]
            error = (matrix - p @ (matrix.T @ p).T).square().sum().double()
            norm = matrix.square().sum().double()
            total += torch.stack([torch.where(torch.isfinite(error), error, float("inf")), norm])
        return total

    # ------------------------------------------------------------------ checkpointing
    def state_dict(self) -> dict:
        return {
            "q": {name: q.detach().cpu().clone() for name, q in self.q.items()},
            "error": {name: e.detach().cpu().clone() for name, e in self.error.items()},
            "shapes": {name: list(shape) for name, shape in self.shapes.items()},  # for change_rank after a resume
        }

    def load_state_dict(self, state: dict) -> None:
        self.q = dict(state["q"])
        self.error = dict(state["error"])
        self.shapes = {name: (int(m), int(n)) for name, (m, n) in state.get("shapes", {}).items()}
        self._step_m, self._step_popped, self._spare = {}, {}, {}

    def to(self, device: torch.device) -> None:
        self.q = {name: q.to(device) for name, q in self.q.items()}
        self.error = {name: e.to(device) for name, e in self.error.items()}
        self._spare = {}
