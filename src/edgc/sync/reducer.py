"""`GradientReducer`: the one abstraction every gradient-sync method implements.

Contract of ``_reduce(names, grads, flat)``: replace each tensor in ``grads`` in place by the
process group's average *as this method communicates it* (exact for plain all-reduce, an
approximation for a compressor). ``flat`` is DDP's bucket buffer that ``grads`` are views
into, or None. It either does so before returning (blocking; it returns its `ReduceStats`, or
None after `_add_stats`), or returns a *job* (`edgc.distributed.comm`): a generator that issues collectives,
yields, and on resumption waits for them and goes on. How jobs run — a fixed order on every rank,
buckets fused into batches, a side stream — is `edgc.runner.jobs`; the DDP hook never blocks backward on
a job.

Everything else — step counting, parameter names, the plain training-loop path, timing and
per-step metrics, uncommitted steps — lives here once. A step is one optimizer step: DDP calls
the hook once per bucket and ``bucket.is_last()`` closes the step, so ``no_sync`` gradient
accumulation does not advance the counter. Each step is one `StepRecord`, from its first bucket
until it is settled: a closed step's device values (non-finite flags, errors: its `StepTotals`, by
name) reach the host as one tensor behind an event and are read when the step is *settled*
(`settle`): when its metrics are read, or when the next step begins (`edgc.device.timing`).

A method says what it does with a step through these hooks, each called once per step in this
order, each handed the step's record: `_plan_step` (the step begins), `_reduce` per bucket (with
`_fusion_bytes`), `_close_step` (its last bucket is averaged: its own values for the host, added
by name), `_settle_step` (the values are on the host: the method's metrics), `_settle_group` (what
the group settles together, with collectives); and `_snapshot` / `_restore` / `_commit` for
uncommitted steps, `_on_device` and `_agree_on_device` at the first step.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from ..device import streams
from ..device.timing import DEVICE_TIMING_EVERY, Clock, host_reads_allowed
from ..device.totals import StepTotals
from ..distributed.comm import Communicator
from ..runner import events
from ..runner.jobs import JobQueue
from ..runner.stats import ReduceStats
from ..safeguards.guards import UsageGuard
from .gradients import HandedGradients, average_raw, average_sparse, check_dense, check_sparse_layout, is_sparse
from .steps import StepRecord, step_metrics


class GradientReducer:
    """Base of every comm-hook state (the module docstring has the ``_reduce`` contract).

    Args:
        process_group: the group it averages over (None: the default one; a 1-D DeviceMesh too).
        model: the module whose parameters it syncs (the DDP model or the module it wraps): it names
            them (`edgc.safeguards.guards`).
    """

    rollback_keeps_input = False  # a rollback leaves all the input in the state: callers keep no copy (two_stage)

    def __init__(self, process_group: dist.ProcessGroup | None = None, *, model: nn.Module | None = None):
        self.comm = Communicator(process_group)
        self.step = 0  # optimizer steps completed
        self.totals = {"elements_raw": 0, "elements_sent": 0, "bytes_raw": 0, "bytes_sent": 0}
        # Uncommitted steps: with ``defer_commit`` every step stays pending after its sync until `commit_step` or
        # `rollback_step` (a fault-tolerant loop decides whether it is applied); its record keeps the state before.
        self.defer_commit = False
        self._guard = UsageGuard(model)  # the parameters' names, the group, one state per DDP model: guards.py
        self._jobs = JobQueue(self._add_stats)  # how bucket jobs run; the device and its clock
        self._current: StepRecord | None = None  # the step being synced
        self._last: StepRecord | None = None  # the last step closed, settled when the next one begins

    # ------------------------------------------------------------------ what it knows
    @property
    def device(self) -> torch.device | None:
        """The gradients' device, once a step has seen one."""
        return self._jobs.device

    @property
    def clock(self) -> Clock:
        """The device timeline's stamps (`edgc.device.timing.Clock`), shared with the communicator."""
        return self._jobs.clock

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

    def agreed_settings(self, device: torch.device) -> dict[str, Any]:
        """What every rank of the group must hold alike, compared at the first step (`edgc.distributed.agreement`).

        Args:
            device: the gradients', for values resolved by device.

        Returns:
            Name → value of the method, its own arguments (a subclass adds them) and what an integration
            added (`agree_on`).
        """
        return {"method": type(self).__qualname__, **self._guard.also_agreed}

    def agree_on(self, settings: dict[str, Any]) -> None:
        """Add settings every rank must hold alike (an integration's), compared with the state's own at
        its first step; refused once that step has begun.

        Args:
            settings: name → value.
        """
        self._guard.agree_on(type(self).__name__, settings)

    def settings_group(self) -> Communicator:
        """The communicator over whose group the settings are compared.

        Returns:
            The state's.
        """
        return self.comm

    def error_table(self) -> dict[str, torch.Tensor]:
        """This rank's error feedback.

        Returns:
            Parameter name → the state's own tensor (changing one in place changes the state); none here,
            a method with error feedback has it.
        """
        return {}

    def check_group(self) -> None:
        """Bind a default group created after the state, and check the group it averages over
        (`edgc.safeguards.guards`): at its first step, or before training (`edgc.integrations.check_group`);
        later calls change nothing."""
        self.comm = self._guard.bound(self.comm)
        self._guard.first_use(type(self).__name__, self.comm)

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
            self._jobs.submit(names, grads, buffer, future, self._reduce, self._fusion_bytes(self._current))
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
        layout are averaged exactly (`edgc.sync.gradients`). Called again on the gradients it averaged,
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

    # ------------------------------------------------------------------ one step
    def _submit(self, names: list[str], grads: list[torch.Tensor]) -> None:
        """The dense tensors an integration or the plain loop hands over, as one bucket's job."""
        if grads:
            if self.device is None:
                self._use_device(grads[0].device)
            names, grads = self._guard.prepare(type(self).__name__, self.comm, names, grads)  # scaled, split
            self._jobs.submit(names, grads, None, None, self._reduce, self._fusion_bytes(self._current))

    def _submit_sparse(self, names: list[str], grad: torch.Tensor, future: torch.futures.Future | None) -> None:
        """A sparse gradient's job of its own (`edgc.sync.gradients.average_sparse`), after the buckets
        gathered before it have started, so that every rank issues in bucket order."""
        if self.device is None:
            self._use_device(grad.device)
        self._jobs.flush(self._reduce)
        self._jobs.submit(names, [grad], grad, future, lambda *bucket: average_sparse(self.comm, *bucket), 0)

    def _use_device(self, device: torch.device) -> None:
        self._jobs.use_device(device)
        self.clock.enabled = self._timed(self._current)
        self.comm.use_device(device, self.clock)
        self._on_device(device)
        self._agree_on_device(device)

    def _timed(self, record: StepRecord | None) -> bool:
        """Whether this step takes device timestamps (`edgc.device.timing.DEVICE_TIMING_EVERY`)."""
        return not self.clock.cuda or record is None or record.always_timed or record.step % DEVICE_TIMING_EVERY == 0

    def _begin_step(self, device: torch.device | None) -> None:
        self.check_group()  # binds a default group created after the state (edgc.safeguards.guards)
        # Start from a clean communicator; an unpickled state's stand-in refuses right here, before
        # anything of the state has changed (see edgc.distributed.detached).
        self.comm.reset()
        self._guard.agree(  # before anything is sent
            type(self).__name__,
            self.comm,
            self.settings_group(),
            self.agreed_settings,
            device or self.device or torch.device("cpu"),
        )
        self.settle()  # the step before: its values, metrics and decisions (their collectives count here)
        if self.pending:
            raise RuntimeError(
                f"{type(self).__name__}: step {self._last.step} was neither committed nor "  # type: ignore[union-attr]
                "rolled back; with defer_commit call commit_step() or rollback_step() after each step"
            )
        record = self._current = StepRecord(self.step, self._snapshot() if self.defer_commit else None)
        self._jobs.clear()
        self._plan_step(record)
        self.clock.enabled = self._timed(record)

    def _end_step(self) -> None:
        """Close the step (its last bucket is averaged) without reading anything: its values, the
        method's and the reducer's by name (`edgc.device.totals.StepTotals`), travel to the host as one tensor
        behind an event and are read when it is settled."""
        record = self._current
        assert record is not None
        self._close_step(record)  # the method's own values, by name
        if self.device is not None:
            for name, (values, weights) in record.measured().items():
                record.totals.add_sum(name, values, weights)
            with self._jobs.side_stream():  # made where the step's statistics were computed
                record.totals.send(self.device)
        record.busy, record.collectives = self._jobs.take_busy(), self.comm.take_step()
        self._last, self._current = record, None
        self.step += 1

    def settle(self) -> None:
        """Settle the last closed step: read its device values (waiting for that step's work alone), build
        its metrics, and take what the group must take together (EDGC's rank decision, which issues
        collectives). Called at the start of the next step and by integrations at their step
        boundary (torchft's commit, `synchronize`, `state_dict`): points every rank reaches in the
        same order. Reading `last_step_metrics` settles only the local part."""
        self._settle_local()
        record = self._last
        if record is not None and not record.shared_done:
            record.shared_done = True
            with host_reads_allowed():  # a decision reads the agreed values (once per window at most)
                self._settle_group(record)

    def _settle_local(self) -> None:
        record = self._last
        if record is None or record.local_done:
            return
        record.local_done = True
        with host_reads_allowed():  # the step's one read (edgc.device.timing)
            self._build_metrics(record)

    def _build_metrics(self, record: StepRecord) -> None:
        record.totals.read()
        method = self._settle_step(record, record.totals)
        for key in self.totals:
            self.totals[key] += getattr(record.stats, key)
        record.metrics = {**step_metrics(record), **method}
        if record.metrics["nonfinite"]:
            self.comm.report_nonfinite(type(self).__name__, record.step)

    @property
    def last_step_metrics(self) -> dict:
        """Metrics of the last closed step (settled locally on first read: no collective)."""
        self._settle_local()
        return self._last.metrics if self._last is not None else {}

    def _add_stats(self, stats: ReduceStats) -> None:
        self._current.add(stats)  # type: ignore[union-attr]

    def _average_raw(self, names: list[str], grads: list[torch.Tensor], flat: torch.Tensor | None) -> Any:
        """Plain averaged all-reduce, as a job (`edgc.sync.gradients.average_raw`)."""
        return average_raw(self.comm, names, grads, flat)

    # ------------------------------------------------------------------ the method's hooks
    def _plan_step(self, record: StepRecord) -> None:
        """The step begins (the one before is settled): plan it (``record.plan``, ``record.always_timed``)."""

    def _fusion_bytes(self, record: StepRecord | None) -> float:
        """Gradient bytes of consecutive buckets that one job syncs (`edgc.runner.jobs`); 0: each bucket its own."""
        return 0

    def _reduce(self, names: list[str], grads: list[torch.Tensor], flat: torch.Tensor | None) -> Any:
        raise NotImplementedError

    def _close_step(self, record: StepRecord) -> None:
        """The step's last bucket is averaged: finish its work, and add the values the step needs on the
        host besides the reducer's own (``nonfinite``, ``error_sq``, ``norm_sq``) to ``record.totals``
        by name (`edgc.device.totals.StepTotals`: 0-dim device tensors)."""

    def _settle_step(self, record: StepRecord, totals: StepTotals) -> dict:
        """The step's values are on the host, read by name (``totals``, the record's: the reducer's and
        `_close_step`'s): the method's part of its metrics. Local: no collective here."""
        return {"phase": "off", "rank": None, "entropy": None}

    def _settle_group(self, record: StepRecord) -> None:
        """What the group settles together (collectives, in the same order on every rank)."""

    def _on_device(self, device: torch.device) -> None:
        """Called with the gradients' device (move loaded state there): at the first step, and at a load
        once the device is known. No collective here: a healing replica loads alone."""

    def _agree_on_device(self, device: torch.device) -> None:
        """Called once, at the first step, on every rank at the same point: what the group decides about
        the device together (collectives allowed)."""

    # ------------------------------------------------------------------ uncommitted steps
    @property
    def pending(self) -> bool:
        """A step has synced but is neither committed nor rolled back (only with ``defer_commit``)."""
        return self._last is not None and self._last.snapshot is not None

    def commit_step(self) -> None:
        """The pending step is applied (the optimizer stepped): keep its state. No-op when none is pending."""
        self.settle()
        if not self.pending:
            return
        self._last.snapshot = None  # type: ignore[union-attr]
        self._commit()
        self.last_step_metrics["committed"] = True

    def rollback_step(self, reason: str = "the optimizer did not step") -> None:
        """The pending step is discarded (the optimizer did not step): the state is as if it had not
        synced — same step number and shared state — except that what the step tried to send is
        kept for the next one where the method has error feedback. Bytes sent stay counted: they
        were sent. No-op when none is pending.

        Args:
            reason: for its record (`edgc.control.events`).
        """
        self.settle()  # its values first (a non-finite step's cleanup), then undo its shared state
        if not self.pending:
            return
        snapshot, self._last.snapshot = self._last.snapshot, None  # type: ignore[union-attr]
        self._restore(snapshot)
        self.last_step_metrics["committed"] = False
        events.discarded(self.settings_group().rank, type(self).__name__, snapshot["step"], reason)

    def _snapshot(self) -> dict:
        """What `rollback_step` restores; subclasses add their state (cheaply: no gradient-sized copy)."""
        return {"step": self.step}

    def _restore(self, snapshot: dict) -> None:
        self.step = snapshot["step"]

    def _commit(self) -> None:
        """The pending step is kept."""

    # ------------------------------------------------------------------ checkpointing
    def state_dict(self) -> dict:
        """Settles the last step first (`settle`: call it on every rank at the same point, as
        checkpoints are taken), so that a resumed run starts where this one would go on.

        Returns:
            The step, the totals and the world size; a subclass adds its state.
        """
        self.comm = self._guard.bound(self.comm)  # a default group created after the state (edgc.safeguards.guards)
        self.settle()
        return {"step": self.step, "totals": dict(self.totals), "world_size": self.comm.world_size}

    def load_state_dict(self, state: dict) -> None:
        """Restore what `state_dict` returned; the last step's values, not yet settled, are dropped.

        Args:
            state: a state's `state_dict`.
        """
        self.comm = self._guard.bound(self.comm)
        if self._last is not None:  # its values belong to the state before: never settled now
            self._last.local_done = self._last.shared_done = True
        self.step = int(state["step"])
        self.totals = {key: int(value) for key, value in state["totals"].items()}

    def __getstate__(self) -> dict:
        """Pickle the data but not the ties to this run (`edgc.distributed.detached.detached_fields`)."""
        from ..distributed.detached import detached_fields

        self._settle_local()  # its metrics and totals travel; the device values do not
        return detached_fields(self.__dict__, type(self).__name__, self.comm, self._last)


class AllReduceState(GradientReducer):
    """Plain averaged all-reduce through the same non-blocking machinery, with EDGC's metrics
    (``process_group``, ``model``: as `GradientReducer`'s)."""

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
