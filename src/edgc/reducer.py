"""`GradientReducer`: the one abstraction every gradient-sync method implements.

Contract of ``_reduce(names, grads, flat)``: replace each tensor in ``grads`` in place by the
process group's average *as this method communicates it* (exact for plain all-reduce, an
approximation for a compressor). ``flat`` is DDP's bucket buffer that ``grads`` are views
into, or None. It either does so before returning (blocking), or returns a *job* (`edgc.comm`):
a generator that issues collectives, yields, and on resumption waits for them and goes on.

The DDP hook never blocks backward on a job. Each hook call first resumes, oldest first, every
job in flight that still has collectives to issue (a job says so with what it yields), then
starts the new bucket's job up to its first yield, and returns a Future; the last bucket of the
step resumes all jobs to their end before it returns, so DDP finds every Future complete. Which job is resumed when depends only on the bucket sequence,
so every rank issues the same collectives in the same order, with DDP's default buckets or many
tiny ones. Communication of bucket k runs while autograd computes the gradients of bucket k+1.

Everything else — step counting, parameter names, the plain training-loop path, timing and
per-step metrics, uncommitted steps — lives here once. A step is one optimizer step: DDP calls the hook once per
bucket and ``bucket.is_last()`` closes the step, so ``no_sync`` gradient accumulation does not
advance the counter. Device values of a step (non-finite flags, errors, timestamps) are read
once, at its end (`edgc.timing`).
"""
from __future__ import annotations

import math
import types
from typing import Any, Iterable

import torch
import torch.distributed as dist
from torch import nn

from .comm import FINISHES, ISSUES_MORE, Communicator, run_job
from .lowrank import ReduceStats
from .mesh import local_tensor
from . import timing
from .timing import Clock


def named_parameters(model: nn.Module | None) -> list[tuple[str, nn.Parameter]]:
    """(name, parameter) pairs without DDP's ``module.`` prefix, so names survive (un)wrapping."""
    if model is None:
        return []
    inner = model.module if isinstance(model, nn.parallel.DistributedDataParallel) else model
    return list(inner.named_parameters())


class GradientReducer:
    """Base of every comm-hook state; see the module docstring for the ``_reduce`` contract."""

    def __init__(self, process_group: dist.ProcessGroup | None = None, *, model: nn.Module | None = None):
        self.comm = Communicator(process_group)
        self.step = 0  # optimizer steps completed
        parameters = named_parameters(model)
        self._names = {id(p): name for name, p in parameters}
        self.parameter_shapes = {name: tuple(local_tensor(p).shape) for name, p in parameters}  # for checking loaded state
        self.last_step_metrics: dict = {}
        self.totals = {"elements_raw": 0, "elements_sent": 0, "bytes_raw": 0, "bytes_sent": 0}
        self._in_step = False
        self._busy: list[tuple] = []  # (start, end) stamps of the host's time inside the hook
        self._stats = ReduceStats()
        self._in_flight: list[list] = []  # [job, future, bucket buffer] of buckets not yet averaged
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
            if name is None:  # no model given: name by first appearance (stable for one layout)
                name = self._names[id(p)] = f"param{len(self._names)}"
                if not getattr(self, "_warned_unnamed", False):  # once: the same holds for every such name
                    import warnings

                    self._warned_unnamed = True
                    warnings.warn(f"{type(self).__name__}: a parameter without a name (no model= given, or not "
                                  f"in it) is called {name} by bucket order, so state_dict() loads only into a "
                                  "run with the same DDP bucket layout; pass model=ddp_model", stacklevel=2)
            names.append(name)
        return names

    # ------------------------------------------------------------------ entry points
    def reduce_bucket(self, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
        """DDP path: start averaging one bucket; the Future completes when it is averaged."""
        if not self._in_step:
            self._begin_step()
        self.comm.poll()
        self._resume_in_flight()
        buffer = bucket.buffer()
        # A Future holding CUDA tensors must name their device: it records an event on completion
        # that DDP's stream waits on (no host synchronisation).
        future: torch.futures.Future[torch.Tensor] = torch.futures.Future(
            devices=[buffer.device] if buffer.device.type == "cuda" else None)
        self._start(self.names_for(bucket.parameters()), bucket.gradients(), buffer, future)
        if bucket.is_last():
            self._finish_in_flight()
            self._end_step()
        return future

    def reduce_tensors(self, names: list[str], tensors: list[torch.Tensor], *, last: bool) -> None:
        """Integration path (FSDP2 hooks, custom buckets): average ``tensors`` in place as one bucket.

        Blocking: the tensors hold the group's average when this returns. Buckets of one optimizer
        step are passed in the same order on every rank; ``last=True`` closes the step (metrics,
        decisions, step counter). ``names`` key the compressor state (error feedback, Q) and must
        be the same on every rank and every step for the same tensor.
        """
        if not self._in_step:
            self._begin_step()
        self._start(list(names), list(tensors), None, None)
        self._finish_in_flight()
        if last:
            self._end_step()

    def synchronize(self, parameters: Iterable[torch.Tensor] | Iterable[tuple[str, torch.Tensor]]) -> None:
        """Plain-loop path: average ``p.grad`` of all parameters over the group, after backward.

        Accepts ``model.parameters()`` or ``model.named_parameters()``. A parameter without a
        gradient counts as a zero gradient, as in DDP, so every rank sends the same tensors.
        Blocking (the Megatron-style sync after backward: nothing left to overlap with). A DTensor
        parameter (tensor parallelism) is averaged shard by shard: this rank's local shard.
        """
        entries = list(parameters)
        if entries and isinstance(entries[0], tuple):
            names = [name for name, _ in entries]
            params = [p for _, p in entries]
        else:
            params = entries
            names = self.names_for(params)
        params_with_grad = [(n, p) for n, p in zip(names, params) if p.requires_grad]
        for _, p in params_with_grad:
            if p.grad is None:
                p.grad = torch.zeros_like(p)
        self._begin_step()
        self._start([n for n, _ in params_with_grad], [local_tensor(p.grad) for _, p in params_with_grad], None, None)
        self._finish_in_flight()
        self._end_step()

    # ------------------------------------------------------------------ jobs in flight
    def _start(self, names: list[str], grads: list[torch.Tensor], flat: torch.Tensor | None,
               future: torch.futures.Future | None) -> None:
        if not grads:
            if future is not None:
                future.set_result(flat)
            return
        if self.device is None:
            self.device = grads[0].device
            self.comm.use_device(self.device)
            self.clock = Clock(self.device)
            self._on_device(self.device)
        begin = self.clock.stamp()
        job = self._reduce(names, grads, flat)
        entry = [job if isinstance(job, types.GeneratorType) else None, future, flat, FINISHES]
        self._advance(entry)
        self._busy.append((begin, self.clock.stamp()))

    def _advance(self, entry: list) -> None:
        """Resume one job to its next yield; completes its Future when it returns."""
        job, future, flat, _ = entry
        if job is not None:
            try:
                entry[3] = next(job)  # ISSUES_MORE or FINISHES
                if entry not in self._in_flight:
                    self._in_flight.append(entry)
                return
            except StopIteration as done:
                if done.value is not None:
                    self._add_stats(done.value)
        if entry in self._in_flight:
            self._in_flight.remove(entry)
        if future is not None:
            future.set_result(flat)

    def _resume_in_flight(self, finishing: bool = False) -> None:
        """Jobs in flight move on by one stage, oldest first (a fixed, rank-independent order).

        Only jobs with collectives still to issue are resumed between buckets; one that only has
        to wait and finish is left for the drain (``finishing``), so backward never waits for a
        transfer that nothing needs yet."""
        due = [entry for entry in self._in_flight if finishing or entry[3] == ISSUES_MORE]
        if not due:
            return
        begin = self.clock.stamp()
        for entry in due:
            self._advance(entry)
        self._busy.append((begin, self.clock.stamp()))

    def _finish_in_flight(self) -> None:
        while self._in_flight:
            self._resume_in_flight(finishing=True)

    # ------------------------------------------------------------------ step bookkeeping
    def _on_device(self, device: torch.device) -> None:
        """Called once with the gradients' device (move loaded state there)."""

    def _begin_step(self) -> None:
        # Start from a clean communicator; an unpickled state's stand-in refuses right here, before
        # anything of the state has changed (see edgc.detached).
        self.comm.reset()
        if self._pending is not None:
            raise RuntimeError(f"{type(self).__name__}: step {self._pending['step']} was neither committed nor "
                               "rolled back; with defer_commit call commit_step() or rollback_step() after each step")
        if self.defer_commit:
            self._pending = self._snapshot()
        self._in_step = True
        self._busy = []
        self._stats = ReduceStats()
        self._in_flight = []

    def _device_values(self) -> list[torch.Tensor]:
        """0-dim device tensors this step needs on the host; read together at its end."""
        stats = self._stats
        return [torch.as_tensor(value, dtype=torch.float64, device=self.device).reshape(())
                for value in (stats.nonfinite, stats.error_sq, stats.norm_sq)]

    def _end_step(self) -> None:
        with timing.host_reads_allowed():  # the step's one synchronisation point (edgc.timing)
            self._close_step()

    def _close_step(self) -> None:
        stats = self._stats
        values = self._device_values()
        host = timing.to_host(torch.stack(values)) if values and self.device is not None else []
        nonfinite, error_sq, norm_sq = (host + [0.0, 0.0, 0.0])[:3]
        self._after_values(host)
        durations = self.comm.reset()
        comm_seconds = sum(durations)
        busy = sum(Clock.seconds(start, end) for start, end in self._busy)
        for key in self.totals:
            self.totals[key] += getattr(stats, key)
        self.last_step_metrics = {
            "step": self.step,
            "elements_raw": stats.elements_raw,
            "elements_sent": stats.elements_sent,
            "bytes_raw": stats.bytes_raw,
            "bytes_sent": stats.bytes_sent,
            "comm_time_s": comm_seconds,
            "comm_wait_s": self.comm.wait_seconds,
            "collectives": len(durations),
            "collective_s": durations,
            "compress_time_s": max(0.0, busy - self.comm.wait_seconds),
            "relative_error": math.sqrt(error_sq / norm_sq) if norm_sq > 0 else None,
            "nonfinite": bool(nonfinite),
            "ranks": dict(stats.ranks),
            **self._step_metrics(),
        }
        self.step += 1
        self._in_step = False

    def _after_values(self, host: list[float]) -> None:
        """Subclass hook: the step's device values are on the host (``host[:3]``: non-finite,
        ‖M−Ĝ‖², ‖M‖²; then whatever `_device_values` added)."""

    def _step_metrics(self) -> dict:
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
        if self._pending is None:
            return
        self._pending = None
        self._commit()
        self.last_step_metrics["committed"] = True

    def rollback_step(self) -> None:
        """The pending step is discarded (the optimizer did not step): the state is as if it had not
        synced — same step number and shared state — except that what the step tried to send is
        kept for the next one where the method has error feedback. Bytes sent stay counted: they
        were sent. No-op when none is pending."""
        snapshot, self._pending = self._pending, None
        if snapshot is None:
            return
        self._restore(snapshot)
        self.last_step_metrics["committed"] = False

    def _snapshot(self) -> dict:
        """What `rollback_step` restores; subclasses add their state (cheaply: no gradient-sized copy)."""
        return {"step": self.step}

    def _restore(self, snapshot: dict) -> None:
        self.step = snapshot["step"]

    def _commit(self) -> None:
        """Subclass hook: the pending step is kept."""

    # ------------------------------------------------------------------ checkpointing
    def state_dict(self) -> dict:
        return {"step": self.step, "totals": dict(self.totals), "world_size": self.comm.world_size}

    def load_state_dict(self, state: dict) -> None:
        self.step = int(state["step"])
        self.totals = {key: int(value) for key, value in state["totals"].items()}

    # ------------------------------------------------------------------ pickling: begin
    def __getstate__(self) -> dict:
        """Pickle the data but not the ties to this run (see `edgc.detached`): the unpickled state
        refuses to step, with one line naming state_dict()/load_state_dict() and model=."""
        from .detached import DetachedCommunicator

        state = dict(self.__dict__)
        state["comm"] = DetachedCommunicator(type(self).__name__, self.comm.rank, self.comm.world_size)
        state["_names"] = {}  # ids of this process's tensors: meaningless elsewhere, reusable by new ones
        return state
    # ------------------------------------------------------------------ pickling: end


class AllReduceState(GradientReducer):
    """Plain averaged all-reduce through the same non-blocking machinery, with EDGC's metrics."""

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
