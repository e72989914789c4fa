"""`GradientReducer`: the one abstraction every gradient-sync method implements.

Contract of ``_reduce(names, grads, flat)``: replace each tensor in ``grads`` in place by the
process group's average *as this method communicates it* (exact for plain all-reduce, an
approximation for a compressor). ``flat`` is DDP's bucket buffer that ``grads`` are views
into, or None. It either does so before returning (blocking), or returns a *job* (`edgc.comm`):
a generator that issues collectives, yields, and on resumption waits for them and goes on. How
jobs run — a fixed order on every rank, buckets fused into batches, a side stream — is
`edgc.jobs`; the DDP hook never blocks backward on a job.

Everything else — step counting, parameter names, the plain training-loop path, timing and
per-step metrics, uncommitted steps — lives here once. A step is one optimizer step: DDP calls
the hook once per bucket and ``bucket.is_last()`` closes the step, so ``no_sync`` gradient
accumulation does not advance the counter. A closed step's device values (non-finite flags,
errors) reach the host behind an event and are read when the step is *settled* (`settle`): when
its metrics are read, or when the next step begins (`edgc.timing`).
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Iterable

import torch
import torch.distributed as dist
from torch import nn

from . import events, streams
from .comm import FINISHES, Communicator, StepCollectives
from .guards import UsageGuard, check_gradients
from .jobs import JobQueue
from .lowrank import ReduceStats
from .mesh import local_tensor
from .timing import DEVICE_TIMING_EVERY, Clock, HostCopy, device_scalar, host_reads_allowed


@dataclass
class ClosedStep:
    """A step whose last bucket is averaged, until it is settled (`GradientReducer.settle`)."""

    step: int
    values: HostCopy | None  # its device values, on their way to the host
    stats: ReduceStats
    busy: list[tuple]  # (start, end) stamps of the jobs' time, on their stream
    collectives: StepCollectives
    local_done: bool = False
    shared_done: bool = False
    extra: dict = field(default_factory=dict)  # what a subclass keeps of the step for its settling


def named_parameters(model: nn.Module | None) -> list[tuple[str, nn.Parameter]]:
    """(name, parameter) pairs without DDP's ``module.`` prefix, so names survive (un)wrapping."""
    if model is None:
        return []
    inner = model.module if isinstance(model, nn.parallel.DistributedDataParallel) else model
    return list(inner.named_parameters())


class GradientReducer:
    """Base of every comm-hook state (the module docstring has the ``_reduce`` contract). ``process_group``:
    the group it averages over (None: the default one; a 1-D DeviceMesh too). ``model``: the module whose
    parameters it syncs (the DDP model or the module it wraps): it names them (`edgc.guards`)."""

    def __init__(self, process_group: dist.ProcessGroup | None = None, *, model: nn.Module | None = None):
        self.comm = Communicator(process_group)
        self._guard = UsageGuard(model)  # the group, the model, one state per DDP model (edgc.guards)
        self.step = 0  # optimizer steps completed
        parameters = named_parameters(model)
        self._names = {id(p): name for name, p in parameters}
        self.parameter_shapes = {name: tuple(local_tensor(p).shape) for name, p in parameters}  # for checking loaded state
        self.last_step_metrics: dict = {}
        self.totals = {"elements_raw": 0, "elements_sent": 0, "bytes_raw": 0, "bytes_sent": 0}
        self._in_step = False
        self._stats = ReduceStats()
        self._jobs = JobQueue(self._add_stats)
        self._closed: ClosedStep | None = None  # the last step, until it is settled
        self._metrics: dict = {}
        self.device: torch.device | None = None
        self.clock = Clock()
        # Uncommitted steps: with ``defer_commit`` every step stays pending after its sync until
        # `commit_step` or `rollback_step` (a fault-tolerant loop decides after the sync whether the
        # step is applied). ``_pending`` is the snapshot of the state from before that step.
        self.defer_commit = False
        self._pending: dict | None = None

    # ------------------------------------------------------------------ names
    def names_for(self, params: Iterable[torch.Tensor]) -> list[str]:
        names = []
        for p in params:
            name = self._names.get(id(p))
            if name is None:  # no model given: named by first appearance (`UsageGuard.unnamed`)
                name = self._names[id(p)] = self._guard.unnamed(type(self).__name__, len(self._names))
            names.append(name)
        return names

    # ------------------------------------------------------------------ entry points
    def reduce_bucket(self, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
        """DDP path: start averaging one bucket; the Future completes when it is averaged."""
        if not self._in_step:
            self._begin_step()
        self.comm.poll()
        buffer = bucket.buffer()
        # A Future holding CUDA tensors must name their device: it records an event on completion
        # that DDP's stream waits on (no host synchronisation).
        future: torch.futures.Future[torch.Tensor] = torch.futures.Future(
            devices=[buffer.device] if buffer.device.type == "cuda" else None)
        names = self._guard.ddp_bucket(type(self).__name__, self.names_for(bucket.parameters()), bucket.is_last())
        self._submit(names, bucket.gradients(), buffer, future)
        if bucket.is_last():
            self._jobs.drain(self._reduce)
            self._end_step()
        return future

    def reduce_tensors(self, names: list[str], tensors: list[torch.Tensor], *, last: bool,
                       blocking: bool = True) -> None:
        """Integration path (FSDP2 hooks, custom buckets, DiLoCo): average ``tensors`` in place as one bucket.

        ``blocking``: the tensors hold the group's average when this returns (on the caller's stream);
        else their job starts and goes on at later calls (`progress`, the next buckets), and they
        hold it once a blocking call or ``last=True`` returns; nothing may touch them until then.
        Buckets of one optimizer step are passed in the same order on every rank; ``last=True``
        closes the step (its metrics and decisions are settled when the next one begins). ``names``
        key the compressor state (error feedback, Q), the same on every rank and step for a tensor.
        """
        if not self._in_step:
            self._begin_step()
        self._submit(list(names), list(tensors), None, None)
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
        averaged shard by shard: this rank's local shard.
        """
        entries = list(parameters)
        if entries and isinstance(entries[0], tuple):
            names = [name for name, _ in entries]
            params = [p for _, p in entries]
        else:
            params = entries
            names = self.names_for(params)
        params_with_grad = [(n, p) for n, p in zip(names, params) if p.requires_grad]
        check_gradients(type(self).__name__, [p for _, p in params_with_grad])
        for _, p in params_with_grad:
            if p.grad is None:
                p.grad = torch.zeros_like(p)
        self._begin_step()
        self._submit([n for n, _ in params_with_grad], [local_tensor(p.grad) for _, p in params_with_grad], None, None)
        self._jobs.drain(self._reduce)
        self._end_step()
        self.settle()

    # ------------------------------------------------------------------ jobs
    def _submit(self, names: list[str], grads: list[torch.Tensor], flat: torch.Tensor | None,
                future: torch.futures.Future | None) -> None:
        if not grads:
            if future is not None:
                future.set_result(flat)
            return
        if self.device is None:
            self._use_device(grads[0].device)
        self._jobs.submit(names, grads, flat, future, self._reduce, self._fusion_bytes())

    def _use_device(self, device: torch.device) -> None:
        self.device = device
        self.clock = Clock(device)
        self.clock.enabled = self._timed()
        self.comm.use_device(device, self.clock)
        self._jobs.use_device(device, self.clock)
        self._on_device(device)

    def _fusion_bytes(self) -> float:
        """Gradient bytes of consecutive buckets that one job syncs (`edgc.jobs`); 0: each bucket its own."""
        return 0

    def _timed(self) -> bool:
        """Whether this step takes device timestamps (`edgc.timing.DEVICE_TIMING_EVERY`)."""
        return not self.clock.cuda or self.step % DEVICE_TIMING_EVERY == 0

    # ------------------------------------------------------------------ step bookkeeping
    def _on_device(self, device: torch.device) -> None:
        """Called once with the gradients' device (move loaded state there)."""

    def _begin_step(self) -> None:
        self._guard.first_use(self)  # binds a default group created after the state (edgc.guards)
        # Start from a clean communicator; an unpickled state's stand-in refuses right here, before
        # anything of the state has changed (see edgc.detached).
        self.comm.reset()
        self.settle()  # the step before: its values, metrics and decisions (their collectives count here)
        if self._pending is not None:
            raise RuntimeError(f"{type(self).__name__}: step {self._pending['step']} was neither committed nor "
                               "rolled back; with defer_commit call commit_step() or rollback_step() after each step")
        if self.defer_commit:
            self._pending = self._snapshot()
        self._in_step = True
        self._stats = ReduceStats()
        self._jobs.clear()
        self.clock.enabled = self._timed()

    def _device_values(self) -> list[torch.Tensor]:
        """0-dim float64 device tensors this step needs on the host, made on the jobs' stream (called
        there: the step's statistics were computed there); read together when it is settled."""
        stats = self._stats
        return [device_scalar(value, self.device) for value in (stats.nonfinite, stats.error_sq, stats.norm_sq)]

    def _end_step(self) -> None:
        """Close the step (its last bucket is averaged) without reading anything: its device values
        travel to the host behind an event (`edgc.timing.HostCopy`) and are read when it is settled."""
        copy = None
        if self.device is not None:
            with self._jobs.side_stream():
                values = self._device_values()
                copy = HostCopy(torch.stack(values)) if values else None
        self._closed = ClosedStep(self.step, copy, self._stats, self._jobs.take_busy(), self.comm.take_step())
        self.step += 1
        self._in_step = False

    def settle(self) -> None:
        """Settle the last closed step: read its device values (waiting for that step's work alone), build
        its metrics, and take what the group must take together (EDGC's rank decision, which issues
        collectives). Called at the start of the next step and by integrations at their step
        boundary (torchft's commit, `synchronize`, `state_dict`): points every rank reaches in the
        same order. Reading `last_step_metrics` settles only the local part."""
        self._settle_local()
        closed = self._closed
        if closed is not None and not closed.shared_done:
            closed.shared_done = True
            with host_reads_allowed():  # a decision reads the agreed values (once per window at most)
                self._after_group(closed)

    def _settle_local(self) -> None:
        closed = self._closed
        if closed is None or closed.local_done:
            return
        closed.local_done = True
        with host_reads_allowed():  # the step's one read (edgc.timing)
            self._build_metrics(closed)

    def _build_metrics(self, closed: "ClosedStep") -> None:
        stats = closed.stats
        host = closed.values.values() if closed.values is not None else []
        nonfinite, error_sq, norm_sq = (host + [0.0, 0.0, 0.0])[:3]
        self._after_values(host, closed)
        durations = closed.collectives.durations()
        timed = all(d is not None for d in durations)
        waited = closed.collectives.wait_seconds()
        busy = Clock.total(closed.busy)
        for key in self.totals:
            self.totals[key] += getattr(stats, key)
        self._metrics = {
            "step": closed.step,
            "elements_raw": stats.elements_raw,
            "elements_sent": stats.elements_sent,
            "bytes_raw": stats.bytes_raw,
            "bytes_sent": stats.bytes_sent,
            "timed": timed and busy is not None,  # False: an untimed step on an accelerator (edgc.timing)
            "comm_time_s": sum(durations) if timed else None,  # type: ignore[arg-type]
            "comm_wait_s": waited,
            "collectives": len(durations),
            "collective_s": durations if timed else None,
            "compress_time_s": max(0.0, busy - (waited or 0.0)) if busy is not None else None,
            "relative_error": math.sqrt(error_sq / norm_sq) if norm_sq > 0 else None,
            "nonfinite": bool(nonfinite),
            "ranks": dict(stats.ranks),
            **self._step_metrics(closed),
        }

    @property
    def last_step_metrics(self) -> dict:
        """Metrics of the last closed step (settled locally on first read: no collective)."""
        self._settle_local()
        return self._metrics

    @last_step_metrics.setter
    def last_step_metrics(self, metrics: dict) -> None:
        self._metrics = metrics

    def _after_values(self, host: list[float], closed: "ClosedStep") -> None:
        """Subclass hook: the step's device values are on the host (``host[:3]``: non-finite,
        ‖M−Ĝ‖², ‖M‖²; then whatever `_device_values` added). Local: no collective here."""

    def _after_group(self, closed: "ClosedStep") -> None:
        """Subclass hook: what the group settles together (collectives, in the same order on every rank)."""

    def _step_metrics(self, closed: "ClosedStep") -> dict:
        return {"phase": "off", "rank": None, "entropy": None}

    def _add_stats(self, stats: ReduceStats) -> None:
        total = self._stats
        for key in ("elements_raw", "elements_sent", "bytes_raw", "bytes_sent", "error_sq", "norm_sq"):
            setattr(total, key, getattr(total, key) + getattr(stats, key))
        total.nonfinite = total.nonfinite | stats.nonfinite
        total.ranks.update(stats.ranks)

    def _average_raw(self, names: list[str], grads: list[torch.Tensor], flat: torch.Tensor | None) -> Any:
        """Plain averaged all-reduce, as a job: of DDP's bucket buffer directly, or of one packed copy."""
        packed = flat if flat is not None else torch.cat([g.reshape(-1) for g in grads])
        sent = self.comm.mean_async(packed)
        elements = sum(g.numel() for g in grads)
        size = elements * grads[0].element_size()
        yield FINISHES
        sent.wait()
        if flat is None:
            offset = 0
            for g in grads:
                g.view(-1).copy_(packed[offset : offset + g.numel()])
                offset += g.numel()
        return ReduceStats(elements, elements, size, size, ranks={n: 0 for n in names})

    def _reduce(self, names: list[str], grads: list[torch.Tensor], flat: torch.Tensor | None) -> None:
        raise NotImplementedError

    # ------------------------------------------------------------------ uncommitted steps
    @property
    def pending(self) -> bool:
        """A step has synced but is neither committed nor rolled back (only with ``defer_commit``)."""
        return self._pending is not None

    def commit_step(self) -> None:
        """The pending step is applied (the optimizer stepped): keep its state. No-op when none is pending."""
        self.settle()
        if self._pending is None:
            return
        self._pending = None
        self._commit()
        self.last_step_metrics["committed"] = True

    def rollback_step(self, reason: str = "the optimizer did not step") -> None:
        """The pending step is discarded (the optimizer did not step): the state is as if it had not
        synced — same step number and shared state — except that what the step tried to send is
        kept for the next one where the method has error feedback. Bytes sent stay counted: they
        were sent. No-op when none is pending. ``reason``: for its record (`edgc.events`)."""
        self.settle()  # its values first (a non-finite step's cleanup), then undo its shared state
        snapshot, self._pending = self._pending, None
        if snapshot is None:
            return
        self._restore(snapshot)
        self.last_step_metrics["committed"] = False
        events.discarded(self, snapshot["step"], reason)

    def _snapshot(self) -> dict:
        """What `rollback_step` restores; subclasses add their state (cheaply: no gradient-sized copy)."""
        return {"step": self.step}

    def _restore(self, snapshot: dict) -> None:
        self.step = snapshot["step"]

    def _commit(self) -> None:
        """Subclass hook: the pending step is kept."""

    # ------------------------------------------------------------------ checkpointing
    def state_dict(self) -> dict:
        """Settles the last step first (`settle`: call it on every rank at the same point, as
        checkpoints are taken), so that a resumed run starts where this one would go on."""
        self._guard.bind(self)  # a default group created after the state (edgc.guards)
        self.settle()
        return {"step": self.step, "totals": dict(self.totals), "world_size": self.comm.world_size}

    def load_state_dict(self, state: dict) -> None:
        self._guard.bind(self)
        self._closed = None
        self.step = int(state["step"])
        self.totals = {key: int(value) for key, value in state["totals"].items()}

    # ------------------------------------------------------------------ pickling: begin
    def __getstate__(self) -> dict:
        """Pickle the data but not the ties to this run (`edgc.detached.detached_state`)."""
        from .detached import detached_state

        return detached_state(self)
    # ------------------------------------------------------------------ pickling: end


class AllReduceState(GradientReducer):
    """Plain averaged all-reduce through the same non-blocking machinery, with EDGC's metrics
    (``process_group``, ``model``: as `GradientReducer`'s)."""

    def _reduce(self, names: list[str], grads: list[torch.Tensor], flat: torch.Tensor | None):
        return self._average_raw(names, grads, flat)


def edgc_hook(state: GradientReducer, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """DDP communication hook for any `GradientReducer` (EDGCState, AllReduceState, …).

    Usage: ``ddp_model.register_comm_hook(state, edgc_hook)``. Returns at once with a Future;
    backward goes on while the bucket is averaged (see the module docstring for the order).
    """
    return state.reduce_bucket(bucket)


# DDP's register_comm_hook compares the annotations with the classes themselves, and this
# module's annotations are strings (postponed evaluation): give the hook the evaluated ones.
edgc_hook.__annotations__ = {"state": GradientReducer, "bucket": dist.GradBucket,
                             "return": torch.futures.Future[torch.Tensor]}

allreduce_hook = edgc_hook  # the same hook; the name reads better with AllReduceState
