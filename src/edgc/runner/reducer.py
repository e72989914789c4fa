"""`GradientReducer`: the one abstraction every gradient-sync method implements, and its DDP hook.

Contract of ``_reduce(names, grads, flat)``: replace each tensor in ``grads`` in place by the
process group's average *as this method communicates it* (exact for plain all-reduce, an
approximation for a compressor). ``flat`` is DDP's bucket buffer that ``grads`` are views
into, or None. It either does so before returning (blocking; it returns its `ReduceStats`, or
None after `_add_stats`), or returns a *job* (`edgc.distributed.comm`): a generator that issues collectives,
yields, and on resumption waits for them and goes on. How jobs run — a fixed order on every rank,
buckets fused into batches, a side stream — is `edgc.runner.jobs`; the DDP hook never blocks backward on
a job.

Everything else lives once, here and in its base: the entry points (the DDP hook, an integration's
buckets, the plain training loop), parameter names and the gradients' kinds here; step counting,
timing and per-step metrics, uncommitted steps and checkpoints in `edgc.runner.step_cycle.StepCycle`,
whose docstring names the hooks a method fills in besides ``_reduce``.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from ..device import streams
from ..distributed.comm import Communicator
from .gradients import HandedGradients, average_raw, average_sparse, check_dense, check_sparse_layout, is_sparse
from .step_cycle import StepCycle


class GradientReducer(StepCycle):
    """Base of every comm-hook state (the module docstring has the ``_reduce`` contract).

    Args:
        process_group: the group it averages over (None: the default one; a 1-D DeviceMesh too).
        model: the module whose parameters it syncs (the DDP model or the module it wraps): it names
            them (`edgc.safeguards.guards`).
    """

    # ------------------------------------------------------------------ what it knows
    @property
    def parameter_shapes(self) -> dict[str, tuple[int, ...]]:
        """name → shape of every parameter of the model (this rank's shard with FSDP), and of each expert's
        matrix of a stacked experts parameter (`edgc.distributed.experts`), to check loaded state."""
        return self._guard.experts.matrix_shapes(self._guard.shapes)

    @parameter_shapes.setter
    def parameter_shapes(self, shapes: dict[str, tuple[int, ...]]) -> None:
        self._guard.shapes = shapes

    @property
    def experts(self):
        """The stacked experts it knows (`edgc.distributed.expert_sync.Experts`): from ``model=``, or an FSDP hook."""
        return self._guard.experts

    def follow_fsdp(self, model: nn.Module, convention: str) -> None:
        """What an FSDP hook (`edgc.parallel.fsdp`) tells it.

        Args:
            model: the model whose forwards count the experts' tokens.
            convention: the gradient scale FSDP's division sets, "mean" or "sum" (`edgc.distributed.scaling`).
        """
        self._guard.scale.use(convention, type(self).__name__)

    def names_for(self, params: Iterable[torch.Tensor]) -> list[str]:
        """The names of parameters, as the model names them.

        Args:
            params: the parameters.

        Returns:
            Their names; one the model does not name is named by first appearance.
        """
        return self._guard.names_for(type(self).__name__, params)

    def agree_on(self, settings: dict[str, Any]) -> None:
        """Add settings every rank must hold alike (an integration's), compared with the state's own at
        its first step; refused once that step has begun.

        Args:
            settings: name → value.
        """
        self._guard.agree_on(type(self).__name__, settings)

    def error_table(self) -> dict[str, torch.Tensor]:
        """This rank's error feedback.

        Returns:
            Parameter name → the state's own tensor (changed in place, the state's), of `error_feedbacks`' first.
        """
        parts = self.error_feedbacks()
        return parts[0].table if parts else {}

    def attach(self, comm: Communicator | None = None, *, defer_commit: bool | None = None) -> None:
        """What drives the state's steps, given before its first step (torchft's manager, a counting stand-in).

        Args:
            comm: the communicator it averages through; None leaves it as it is.
            defer_commit: keep every step pending until `commit_step` or `rollback_step`; None leaves it.
        """
        if comm is not None:
            self.comm = comm
        if defer_commit is not None:
            self.defer_commit = defer_commit

    # ------------------------------------------------------------------ entry points
    def reduce_bucket(self, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
        """DDP path: start averaging one bucket.

        Args:
            bucket: DDP's bucket.

        Returns:
            A Future that completes with the bucket's buffer once it is averaged.
        """
        buffer = bucket.buffer()
        if self._current is None:
            self._begin_step(buffer.device)
        self.comm.poll()
        # A Future of CUDA tensors names their device: DDP's stream waits on its event (no host synchronisation).
        future: torch.futures.Future[torch.Tensor] = torch.futures.Future(
            devices=[buffer.device] if buffer.device.type == "cuda" else None
        )
        if self.device is None:
            self._use_device(buffer.device)
        sparse = is_sparse(buffer)  # a sparse gradient: DDP's bucket of its own, whose buffer is the gradient
        grads = None if sparse else bucket.gradients()
        name, last = type(self).__name__, bucket.is_last()
        names, grads = self._guard.ddp_bucket(name, self.comm, bucket.parameters(), grads, last)
        if sparse:
            check_sparse_layout(name, names[0], buffer)
            self._submit_sparse(names, buffer, future)
        elif grads:
            self._jobs.submit(names, grads, buffer, future, self._reduce, self._fusion_bytes())
        else:
            future.set_result(buffer)
        if last:
            self._jobs.drain(self._reduce)
            self._end_step()
        return future

    def reduce_tensors(
        self, names: list[str], tensors: list[torch.Tensor], *, last: bool, blocking: bool = True
    ) -> None:
        """Integration path (FSDP2 hooks, custom buckets, DiLoCo): average ``tensors`` in place as one bucket.

        ``blocking``: the tensors hold the group's average when this returns (on the caller's stream);
        else their job starts and goes on at later calls (`progress`, the next buckets), and they
        hold it once a blocking call or ``last=True`` returns; nothing may touch them until then.
        Buckets of one optimizer step are passed in the same order on every rank; ``last=True``
        closes the step (its metrics and decisions are settled when the next one begins). ``names``
        key the compressor state (error feedback, Q), the same on every rank and step for a tensor.

        Args:
            names: the tensors' names.
            tensors: the gradients, averaged in place.
            last: this bucket closes the optimizer step.
            blocking: wait until the tensors hold the average.
        """
        check_dense(type(self).__name__, names, tensors)
        if self._current is None:
            self._begin_step(tensors[0].device if tensors else None)
        self._submit(list(names), list(tensors))
        if blocking or last:
            self._jobs.drain(self._reduce)
        else:
            self._jobs.flush(self._reduce)
            for tensor in tensors:
                streams.record_stream(tensor, self._jobs.stream)
        if last:
            self._end_step()

    def progress(self) -> None:
        """Issue what the jobs in flight can issue now (waiting for their earlier collectives): for a
        caller of non-blocking `reduce_tensors` between its buckets (DiLoCo's inner steps)."""
        self.comm.poll()
        self._jobs.resume()

    def synchronize(self, parameters: Iterable[torch.Tensor] | Iterable[tuple[str, torch.Tensor]]) -> None:
        """Plain-loop path: average ``p.grad`` of all parameters over the group, after backward.

        Accepts ``model.parameters()`` or ``model.named_parameters()``. A parameter without a
        gradient counts as a zero gradient, as in DDP, so every rank sends the same tensors.
        Blocking (the Megatron-style sync after backward: nothing left to overlap with), and the
        step is settled (`settle`) before it returns. A DTensor parameter (tensor parallelism) is
        averaged shard by shard: this rank's local shard. Sparse gradients and gradients in another
        layout are averaged exactly (`edgc.runner.gradients`). Called again on the gradients it averaged,
        unchanged since (no backward between), it refuses in one line (`edgc.safeguards.guards`).

        Args:
            parameters: ``model.parameters()`` or ``model.named_parameters()``.
        """
        handed = HandedGradients.of(type(self).__name__, parameters, self.names_for)
        self._guard.fresh_gradients(type(self).__name__, handed.handed)
        self._guard.check_experts(type(self).__name__, self.comm, handed.dense_names)  # before anything is sent
        self._begin_step(handed.grads[0].device if handed.grads else None)
        self._submit(handed.dense_names, handed.dense)
        for name, grad in handed.sparse:
            self._submit_sparse([name], grad, None)
        self._jobs.drain(self._reduce)
        handed.write_back()
        self._end_step()
        self.settle()
        self._guard.synchronized(handed.handed)

    # ------------------------------------------------------------------ a bucket's job
    def _submit(self, names: list[str], grads: list[torch.Tensor]) -> None:
        """The dense tensors an integration or the plain loop hands over, as one bucket's job."""
        if grads:
            if self.device is None:
                self._use_device(grads[0].device)
            names, grads = self._guard.prepare(type(self).__name__, self.comm, names, grads)  # scaled, split
            self._jobs.submit(names, grads, None, None, self._reduce, self._fusion_bytes())

    def _submit_sparse(self, names: list[str], grad: torch.Tensor, future: torch.futures.Future | None) -> None:
        """A sparse gradient's job of its own (`edgc.runner.gradients.average_sparse`), after the buckets
        gathered before it have started, so that every rank issues in bucket order."""
        if self.device is None:
            self._use_device(grad.device)
        self._jobs.flush(self._reduce)
        self._jobs.submit(names, [grad], grad, future, lambda *bucket: average_sparse(self.comm, *bucket), 0)

    def _average_raw(self, names: list[str], grads: list[torch.Tensor], flat: torch.Tensor | None) -> Any:
        """Plain averaged all-reduce, as a job (`edgc.runner.gradients.average_raw`)."""
        return average_raw(self.comm, names, grads, flat)


class AllReduceState(GradientReducer):
    """Plain averaged all-reduce through the same non-blocking machinery, with EDGC's metrics
    (``process_group``, ``model``: as `GradientReducer`'s, which its base `edgc.runner.step_cycle.StepCycle` takes)."""

    def _reduce(self, names: list[str], grads: list[torch.Tensor], flat: torch.Tensor | None):
        return self._average_raw(names, grads, flat)


def edgc_hook(state: GradientReducer, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """DDP communication hook for any `GradientReducer` (EDGCState, AllReduceState, …).

    Usage: ``ddp_model.register_comm_hook(state, edgc_hook)``. Backward goes on while the bucket is
    averaged (see the module docstring for the order).

    Args:
        state: the hook's state.
        bucket: DDP's bucket.

    Returns:
        At once, a Future that completes with the averaged bucket.
    """
    return state.reduce_bucket(bucket)


# DDP's register_comm_hook compares the annotations with the classes themselves, and this
# module's annotations are strings (postponed evaluation): give the hook the evaluated ones.
edgc_hook.__annotations__ = {
    "state": GradientReducer,
    "bucket": dist.GradBucket,
    "return": torch.futures.Future[torch.Tensor],
}
