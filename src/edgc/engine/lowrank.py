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
gradients is made (bytes and memory: `edgc_probes.dispatch_count`). A call issues three
all-reduces (raw + a non-finite flag, P, Q). A call's layout and every buffer its work reads and
writes are kept from step to step (`edgc.engine.call_buffers.CallBuffers`: the error-feedback arena, P,
two Q buffers used in turn), so a steady step copies no Q and allocates nothing that outlives a
stretch. A call is a job of three stretches between its two yields (`edgc.engine.stretches`): form M
and P and send them (`send_p`), take the raw average, orthonormalise P and send Q (`send_q`), then
decompress and keep (`finish`), each a graph region that ``EDGCConfig.engine.cuda_graphs`` captures on CUDA;
with ``power_iterations = 2`` the compressed matrices go through a second call.

The compressor holds its state (``compressor.state``, an `edgc.engine.engine_memory.EngineMemory`): Q and error
feedback per parameter name (``q``, ``error``, read here too), `snapshot`/`restore` of the shared
part (Q), `commit`/`rollback` of an uncommitted step (``begin_step(uncommitted=True)``: the residual
goes to a spare arena so that M survives; rollback makes M the error feedback again, so the step's
gradient is sent next time), `end_step` after a non-finite step, `drop_error`, and `state_dict`.

Factors and error feedback are fp32 for fp32/bf16/fp16 gradients (fp64 ones stay fp64); error
feedback in the gradient's dtype with ``error_feedback_dtype='gradient'``.
"""

from __future__ import annotations

import torch

from ..config import EDGCConfig, LowRankConfig
from ..distributed.comm import FINISHES, ISSUES_MORE, Communicator, Job, run_job
from ..runner.stats import ReduceStats
from . import rank_change, stretches
from .engine_memory import EngineMemory, subtracts_estimate
from .factors import compressed_rank
from .layout import CallLayout
from .orthonormal_choice import agreed, orthonormalization_for
from .stretches import JobRun

DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}


# A measured call reads every s-th chunk of its M and e, s chosen so that it reads about this many
# elements (s = 1, all of it, for a call this small or smaller): ‖M − Ĝ‖/‖M‖ from the residual as
# written, at a cost that does not grow with the model (a whole pass over M is 4 bytes per element).
ERROR_SAMPLE = 1 << 16


def _chunk_stride(layout: CallLayout, sampled: bool) -> int:
    return max(1, layout.error_numel // ERROR_SAMPLE) if sampled else 1


class LowRankCompressor:
    """PowerSGD compression of named gradients with error feedback and warm-started Q; see the module
    docstring.

    ``state``: what it keeps between steps (`edgc.engine.engine_memory.EngineMemory`). ``power_iterations`` and
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
        self.state = EngineMemory(config)

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
        """name → (n, r) warm-start Q, identical on every rank (`EngineMemory.q`)."""
        return self.state.q

    @property
    def error(self) -> dict[str, torch.Tensor]:
        """name → (m, n) error feedback of this rank (`EngineMemory.error`)."""
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
        """The matrices the engine has seen (its state's record, `EngineMemory.shapes`) that it compresses.

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
        """`EngineMemory.state_dict`.

        Args:
            include_error: keep this rank's error feedback in it.

        Returns:
            The state, for `load_state_dict`.
        """
        return self.state.state_dict(include_error=include_error)

    def load_state_dict(self, state: dict, *, keep_error: bool = False) -> None:
        """`EngineMemory.load_state_dict`.

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
        `EngineMemory.end_step` when it learns of one. A second power iteration repeats this on the
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
            stats.error_sq, stats.norm_sq, stats.measured_scale = again.error_sq, again.norm_sq, again.measured_scale
            stats.nonfinite = stats.nonfinite | again.nonfinite
        return stats

    def _power_iteration(
        self, names: list[str], grads: list[torch.Tensor], rank: int, comm: Communicator, measure_error: bool
    ) -> Job:
        """One call of `reduce_steps`: its three stretches (`edgc.engine.stretches`) between two yields."""
        run = self._open(names, grads, rank, comm, measure_error)
        self._stretch(run, "send_p", stretches.send_p)
        raw_sent = comm.mean_async(run.kept.step.raw)
        run.stats.elements_sent = run.kept.step.raw.numel()
        run.stats.bytes_sent = run.stats.elements_sent * run.kept.step.raw.element_size()
        p_sent = None
        if run.layout.groups:
            p_sent = comm.mean_async(run.kept.p, run.wire)
            self._count_sent(run.stats, run.kept.p, run.wire)
        yield ISSUES_MORE if run.layout.groups else FINISHES
        raw_sent.wait()
        if p_sent is not None:
            p_sent.wait()
        self._stretch(run, "send_q", stretches.send_q)
        if not run.layout.groups:
            run.stats.nonfinite = run.kept.step.bad
            return run.stats
        q_new = run.kept.q(run.new_turn)
        q_sent = comm.mean_async(q_new, run.wire)
        self._count_sent(run.stats, q_new, run.wire)
        if not comm.waits_on_device:  # a wait that blocks the host is left for the next hook call
            yield FINISHES
        q_sent.wait()
        self._stretch(run, "finish", stretches.finish)
        self.state.close_call(run.kept, run.arena, run.residual)
        step = run.kept.step
        run.stats.nonfinite = step.bad
        if measure_error:
            run.stats.norm_sq, run.stats.error_sq = step.sums[0], step.sums[1]
            run.stats.measured_scale = stretches.measured_scale(run.arena.numel(), run.stride)
        return run.stats

    def _open(
        self, names: list[str], grads: list[torch.Tensor], rank: int, comm: Communicator, measure_error: bool
    ) -> JobRun:
        """The call's buffers (`EngineMemory.open_call`) and what its stretches carry."""
        grad_dtype, device = grads[0].dtype, grads[0].device
        compute = torch.float64 if grad_dtype == torch.float64 else torch.float32
        wire = DTYPES[self.config.communication_dtype] if self.config.communication_dtype else grad_dtype
        kept, arena = self.state.open_call(names, grads, rank, compute)
        layout = kept.layout
        stride = _chunk_stride(layout, sampled=self.config.error_feedback)
        kept.step_buffers(grad_dtype, compute, device)
        method = self.orthonormalization(device)
        if layout.groups:
            kept.keep_identity(method, device)
        if measure_error and not self.config.error_feedback and kept.step.local_q is None:
            kept.step.local_q = torch.zeros(layout.q_numel, dtype=compute, device=device)
        stats = ReduceStats(ranks=dict(layout.ranks))
        stats.elements_raw = sum(g.numel() for g in grads)
        stats.bytes_raw = stats.elements_raw * grads[0].element_size()
        cpu_kernels = device.type == "cpu" and not self.force_accelerator_kernels
        error_feedback = self.config.error_feedback
        return JobRun(
            kept,
            grads,
            [grads[i].view(group.m, group.n) for group in layout.groups for i in group.indices],
            [grads[i].view(-1) for i in layout.raw],
            arena,
            compute,
            wire,
            wire == torch.float16 and comm.world_size > 1,
            measure_error,
            stride,
            method,
            self.config.orthogonalization_epsilon,
            error_feedback,
            error_feedback and subtracts_estimate(cpu_kernels, grad_dtype == arena.dtype),
            stats,
            rank=comm.rank,
            residual=self.state.residual_target(kept, arena) if error_feedback else None,
            select_q=not self.state.tracking,
        )

    def _stretch(self, run: JobRun, name: str, work) -> None:
        stretches.run_stretch(run, name, work, self.config.cuda_graphs, run.rank)

    @staticmethod
    def _count_sent(stats: ReduceStats, values: torch.Tensor, wire_dtype: torch.dtype) -> None:
        stats.elements_sent += values.numel()
        stats.bytes_sent += values.numel() * torch.empty((), dtype=wire_dtype).element_size()
