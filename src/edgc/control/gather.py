"""One sampled step's gradient sample, gathered with one batched copy per job.

The sample is every k-th element of each tensor, from its first (`edgc.control.entropy`). A job's tensors
(DDP's buckets, one or several fused) are gathered as strided views in one ``cat`` into the step's
vector: on a GPU one batched copy per 64 views (ATen's ``cat_out_cuda``), where a copy per tensor
would launch hundreds of kernels for a large model's step and a gather by index (``index_select``,
one per bucket buffer) would launch one per bucket and read 8 B of index per sampled element.
The sample keeps the gradients' dtype (its values exactly): the estimate casts it once.
"""

from __future__ import annotations

import math

import torch

from ..device import timing


def nonzero_values(values: torch.Tensor) -> torch.Tensor:
    """The elements of ``values`` that are not exactly zero, in order (one read of their count, through
    `edgc.device.timing.to_host`: step end only; the gather itself reads nothing)."""
    keep = values.ne(0)
    (count,) = timing.to_host(keep.sum())
    return values[torch.nonzero_static(keep, size=int(count)).reshape(-1)]


class SampleBuffers:
    """What sampled steps keep from one to the next: the vector a step's sample is gathered into."""

    def __init__(self) -> None:
        self._room: torch.Tensor | None = None

    def room(self, size: int, like: torch.Tensor) -> torch.Tensor:
        """A vector of ``size`` elements of ``like``'s dtype and device, the same one as last time if it fits."""
        room = self._room
        if room is None or (room.numel(), room.dtype, room.device) != (size, like.dtype, like.device):
            room = self._room = torch.empty(size, dtype=like.dtype, device=like.device)
        return room


class StepGather:
    """One sampled step's gradient sample, gathered job by job without a host read: into a vector
    of ``size`` elements where the step before gave its size (kept from one sampled step to the next);
    parts that do not fit, or the first step's, are kept apart and joined in `sample`."""

    def __init__(self, step: int, stride: int, thinned: bool, size: int | None, buffers: SampleBuffers):
        self.step = step
        self.stride = stride  # this step's stride, the cap folded in where `thinned`
        self.thinned = thinned  # else a report sample is thinned after gathering
        self.size = size
        self.room: torch.Tensor | None = None
        self.filled = 0
        self.parts: list[torch.Tensor] = []
        self.expert_parts: list[torch.Tensor] = []  # experts' matrices: their exact zeros left out at the end
        self.seconds = 0.0
        self._buffers = buffers

    def add(self, tensors: list[torch.Tensor], experts: list[torch.Tensor] = ()) -> None:
        """One job's tensors (a bucket's, or several fused): their elements gathered into the room with one
        ``cat``, or, where they do not fit (the first sampled step, whose size is not known yet), kept as
        one part for the job. ``experts``:
        experts' matrices, kept apart (`edgc.control.entropy`'s docstring: their exact zeros leave the sample)."""
        if experts:
            views = [t.detach().reshape(-1)[:: self.stride] for t in experts]
            same = all(v.dtype == views[0].dtype for v in views)
            self.expert_parts.append(torch.cat(views if same else [v.float() for v in views]).float())
        if self.room is None and self.size and not self.filled and tensors:
            self.room = self._buffers.room(self.size, tensors[0])
        if not tensors:
            return
        views = [t.detach().reshape(-1)[:: self.stride] for t in tensors]  # a strided tensor: copied whole
        size = sum(v.numel() for v in views)
        if any(v.dtype != views[0].dtype for v in views):  # kept apart, in float32
            self.parts.append(torch.cat([v.float() for v in views]))
            return
        slot = self._slot(size, views[0])
        if slot is None:  # kept apart, joined in `sample` (no per-job read)
            self.parts.append(torch.cat(views))
        else:
            torch.cat(views, out=slot)
            self.filled += size

    def _slot(self, size: int, like: torch.Tensor) -> torch.Tensor | None:
        """Where the next ``size`` elements go in ``room`` (None: a part of its own)."""
        room = self.room
        if room is None or self.parts or room.dtype != like.dtype or self.filled + size > room.numel():
            return None
        return room[self.filled : self.filled + size]

    def sample(self, cap: int | None) -> torch.Tensor:
        """The step's sample, in the order its buckets came, thinned to ``cap`` if not already."""
        parts = ([self.room[: self.filled]] if self.filled else []) + self.parts
        if self.expert_parts:
            parts.append(nonzero_values(torch.cat(self.expert_parts)))
        size = sum(part.numel() for part in parts)
        if cap is not None and not self.thinned and size > cap:  # thinned before the copy into one
            parts = [part[:: math.ceil(size / cap)] for part in parts]
        if len(parts) == 1 and parts[0].is_contiguous():
            return parts[0]
        if not parts:
            return torch.empty(0)
        dtype = parts[0].dtype if all(p.dtype == parts[0].dtype for p in parts) else torch.float32
        return torch.cat([p.to(dtype) for p in parts])
