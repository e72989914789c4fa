"""`GradientReducer`: the one abstraction every gradient-sync method implements.

Contract of ``_reduce(names, grads, flat)``: replace each tensor in ``grads`` in place by the
process group's average *as this method communicates it* (exact for plain all-reduce, an
approximation for a compressor). ``flat`` is DDP's bucket buffer that ``grads`` are views
into, or None. Everything else — step counting, parameter names, the DDP hook and the plain
training-loop path, timing and per-step metrics — lives here once.

A step is one optimizer step: DDP calls the hook once per bucket and ``bucket.is_last()``
closes the step, so ``no_sync`` gradient accumulation does not advance the counter.
"""
from __future__ import annotations

import time
from typing import Iterable

import torch
import torch.distributed as dist
from torch import nn

from .comm import Communicator
from .lowrank import ReduceStats


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
        self.parameter_shapes = {name: tuple(p.shape) for name, p in parameters}  # for checking loaded state
        self.last_step_metrics: dict = {}
        self.totals = {"elements_raw": 0, "elements_sent": 0, "bytes_raw": 0, "bytes_sent": 0}
        self._in_step = False
        self._busy = 0.0
        self._stats = ReduceStats()
        self.device: torch.device | None = None

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
    def reduce_bucket(self, bucket: dist.GradBucket) -> torch.Tensor:
        """DDP path: average one bucket in place and return its buffer."""
        if not self._in_step:
            self._begin_step()
        buffer = bucket.buffer()
        self._timed_reduce(self.names_for(bucket.parameters()), bucket.gradients(), buffer)
        if bucket.is_last():
            self._end_step()
        return buffer

    def reduce_tensors(self, names: list[str], tensors: list[torch.Tensor], *, last: bool) -> None:
        """Integration path (FSDP2 hooks, custom buckets): average ``tensors`` in place as one bucket.

        Blocking: the tensors hold the group's average when this returns. Buckets of one optimizer
        step are passed in the same order on every rank; ``last=True`` closes the step (metrics,
        decisions, step counter). ``names`` key the compressor state (error feedback, Q) and must
        be the same on every rank and every step for the same tensor.
        """
        if not self._in_step:
            self._begin_step()
        self._timed_reduce(list(names), list(tensors), None)
        if last:
            self._end_step()

    def synchronize(self, parameters: Iterable[torch.Tensor] | Iterable[tuple[str, torch.Tensor]]) -> None:
        """Plain-loop path: average ``p.grad`` of all parameters over the group, after backward.

        Accepts ``model.parameters()`` or ``model.named_parameters()``. A parameter without a
        gradient counts as a zero gradient, as in DDP, so every rank sends the same tensors.
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
        self._timed_reduce([n for n, _ in params_with_grad], [p.grad for _, p in params_with_grad], None)
        self._end_step()

    # ------------------------------------------------------------------ step bookkeeping
    def _timed_reduce(self, names: list[str], grads: list[torch.Tensor], flat: torch.Tensor | None) -> None:
        if not grads:
            return
        if self.device is None:
            self.device = grads[0].device
            self._on_device(self.device)
        start = time.perf_counter()
        self._reduce(names, grads, flat)
        self._busy += time.perf_counter() - start

    def _on_device(self, device: torch.device) -> None:
        """Called once with the gradients' device (move loaded state there)."""

    def _begin_step(self) -> None:
        self._in_step = True
        self._busy = 0.0
        self._stats = ReduceStats()
        self.comm.reset()

    def _end_step(self) -> None:
        stats = self._stats
        durations = self.comm.reset()
        comm_seconds = sum(durations)
        for key in self.totals:
            self.totals[key] += getattr(stats, key)
        relative_error = (stats.error_sq / stats.norm_sq) ** 0.5 if stats.norm_sq > 0 else None
        self.last_step_metrics = {
            "step": self.step,
            "elements_raw": stats.elements_raw,
            "elements_sent": stats.elements_sent,
            "bytes_raw": stats.bytes_raw,
            "bytes_sent": stats.bytes_sent,
            "comm_time_s": comm_seconds,
            "collectives": len(durations),
            "collective_s": durations,
            "compress_time_s": max(0.0, self._busy - comm_seconds),
            "relative_error": relative_error,
            "nonfinite": stats.nonfinite,
            "ranks": dict(stats.ranks),
            **self._step_metrics(),
        }
        self.step += 1
        self._in_step = False

    def _step_metrics(self) -> dict:
        return {"phase": "off", "rank": None, "entropy": None}

    def _add_stats(self, stats: ReduceStats) -> None:
        total = self._stats
        for key in ("elements_raw", "elements_sent", "bytes_raw", "bytes_sent", "error_sq", "norm_sq"):
            setattr(total, key, getattr(total, key) + getattr(stats, key))
        total.nonfinite |= stats.nonfinite
        total.ranks.update(stats.ranks)

    def _average_raw(self, names: list[str], grads: list[torch.Tensor], flat: torch.Tensor | None) -> None:
        """Plain averaged all-reduce: of DDP's bucket buffer directly, or of one packed copy."""
        packed = flat if flat is not None else torch.cat([g.reshape(-1) for g in grads])
        self.comm.mean_(packed)
        if flat is None:
            offset = 0
            for g in grads:
                g.view(-1).copy_(packed[offset : offset + g.numel()])
                offset += g.numel()
        elements = sum(g.numel() for g in grads)
        size = elements * grads[0].element_size()
        self._add_stats(ReduceStats(elements, elements, size, size, ranks={n: 0 for n in names}))

    def _reduce(self, names: list[str], grads: list[torch.Tensor], flat: torch.Tensor | None) -> None:
        raise NotImplementedError

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
    """Plain averaged all-reduce (the uncompressed baseline) with the same metrics as EDGC."""

    def _reduce(self, names: list[str], grads: list[torch.Tensor], flat: torch.Tensor | None) -> None:
        self._average_raw(names, grads, flat)


def edgc_hook(state: GradientReducer, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """DDP communication hook for any `GradientReducer` (EDGCState, AllReduceState, …).

    Usage: ``ddp_model.register_comm_hook(state, edgc_hook)``. Collectives run synchronously
    inside the hook, in bucket order, so ranks can never issue them in different orders.
    """
    future: torch.futures.Future[torch.Tensor] = torch.futures.Future()
    future.set_result(state.reduce_bucket(bucket))
    return future


# DDP's register_comm_hook compares the annotations with the classes themselves, and this
# module's annotations are strings (postponed evaluation): give the hook the evaluated ones.
edgc_hook.__annotations__ = {"state": GradientReducer, "bucket": dist.GradBucket,
                             "return": torch.futures.Future[torch.Tensor]}

allreduce_hook = edgc_hook  # the same hook; the name reads better with AllReduceState
