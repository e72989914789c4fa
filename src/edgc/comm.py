"""Blocking, timed collectives over one process group (or none at all).

Every collective is issued from the caller's thread and waited for before returning, so all
ranks issue them in the same order whatever the bucket count (PyTorch's PowerSGD hook chains
them in future callbacks, whose order differs between ranks and aborts gloo). Without an
initialised process group the world has size 1 and collectives are no-ops, which keeps the
compressors testable in a single plain process.
"""
from __future__ import annotations

import time

import torch
import torch.distributed as dist


def synchronize(device: torch.device) -> None:
    """Wait for queued device work so wall-clock timings mean something on accelerators."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    elif device.type not in ("cpu", "meta") and hasattr(torch, "accelerator"):
        torch.accelerator.synchronize(device)


class Communicator:
    def __init__(self, process_group: dist.ProcessGroup | None = None):
        self.group = process_group
        distributed = dist.is_available() and dist.is_initialized()
        self.world_size = dist.get_world_size(process_group) if distributed else 1
        self.rank = dist.get_rank(process_group) if distributed else 0
        # Global rank of the group's rank 0: the source of every decision broadcast.
        self.root = dist.get_global_rank(process_group, 0) if distributed and process_group is not None else 0
        # Wall seconds of each collective since the last reset(), in issue order (the same order on
        # every rank, so traces of all ranks line up collective by collective).
        self.durations: list[float] = []

    @property
    def seconds(self) -> float:
        """Wall time spent inside collectives since the last reset()."""
        return sum(self.durations)

    @property
    def collectives(self) -> int:
        """Collectives issued since the last reset() (each has a fixed latency cost)."""
        return len(self.durations)

    def reset(self) -> list[float]:
        """Start a new step; returns the durations of the collectives of the one that ended."""
        durations, self.durations = self.durations, []
        return durations

    def forget_since(self, count: int) -> None:
        """Drop the collectives issued after the first ``count`` (traffic that is not the step's)."""
        del self.durations[count:]

    def _timed(self, tensor: torch.Tensor, run) -> None:
        if self.world_size == 1:
            return
        start = time.perf_counter()
        run()
        synchronize(tensor.device)
        self.durations.append(time.perf_counter() - start)

    def all_reduce(self, tensor: torch.Tensor, op: dist.ReduceOp.RedOpType = dist.ReduceOp.SUM) -> torch.Tensor:
        self._timed(tensor, lambda: dist.all_reduce(tensor, op=op, group=self.group))
        return tensor

    def all_gather(self, tensor: torch.Tensor) -> list[torch.Tensor]:
        """Every rank's ``tensor`` (same shape and dtype on all ranks), in group-rank order."""
        if self.world_size == 1:
            return [tensor]
        out = [torch.empty_like(tensor) for _ in range(self.world_size)]
        self._timed(tensor, lambda: dist.all_gather(out, tensor, group=self.group))
        return out

    def mean_(self, tensor: torch.Tensor) -> torch.Tensor:
        """In-place average over the group. Divides first so fp16 sums cannot overflow."""
        if self.world_size > 1:
            tensor.div_(self.world_size)
            self.all_reduce(tensor)
        return tensor

    def broadcast(self, tensor: torch.Tensor) -> torch.Tensor:
        """Overwrite ``tensor`` on every rank with group rank 0's value."""
        self._timed(tensor, lambda: dist.broadcast(tensor, src=self.root, group=self.group))
        return tensor
