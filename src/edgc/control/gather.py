"""One sampled step's gradient sample, gathered with one gather per buffer its tensors lie in.

The sample is every k-th element of each tensor, from its first (`edgc.control.entropy`). A DDP bucket's
gradients are views of one flat buffer, so the positions of a bucket's sample are one index into that
buffer, and one ``index_select`` gathers them; copying strided views instead launches one copy per
tensor on a GPU (hundreds for a large model's step). The indices depend only on where the tensors lie
in their buffer and on the stride, so they are made once per bucket layout and kept (`GatherPlans`).
The sample keeps the gradients' dtype (its values exactly): the estimate casts it once.
"""

from __future__ import annotations

import math

import torch

from ..adapters import torch_adapter
from ..device import timing
from ..device.timing import to_device

PLANS_KEPT = 256  # bucket layouts whose gather indices are kept (a step's buckets, and then some)


def _runs(tensors: list[torch.Tensor]) -> list[tuple[torch.Tensor, list[torch.Tensor]]]:
    """The tensors grouped by the contiguous buffer they are views of, in order: (buffer, its tensors).
    A tensor that is no view of a contiguous buffer is its own buffer (flattened)."""
    runs: list[tuple[torch.Tensor, list[torch.Tensor]]] = []
    for tensor in tensors:
        base = torch_adapter.view_base(tensor)
        if base is None or not base.is_contiguous() or not tensor.is_contiguous():
            base = tensor.detach().reshape(-1) if tensor.is_contiguous() else None
        if base is None:
            runs.append((tensor, [tensor]))  # strided: a copy of its own
        elif runs and runs[-1][0] is base:
            runs[-1][1].append(tensor)
        else:
            runs.append((base, [tensor]))
    return runs


def nonzero_values(values: torch.Tensor) -> torch.Tensor:
    """The elements of ``values`` that are not exactly zero, in order (one read of their count, through
    `edgc.device.timing.to_host`: step end only; the gather itself reads nothing)."""
    keep = values.ne(0)
    (count,) = timing.to_host(keep.sum())
    return values[torch.nonzero_static(keep, size=int(count)).reshape(-1)]


class SampleBuffers:
    """What sampled steps keep from one to the next: the gather indices of the bucket layouts seen so far
    (per where each tensor lies and the stride), and the vector a step's sample is gathered into."""

    def __init__(self) -> None:
        self._plans: dict[tuple, torch.Tensor] = {}
        self._room: torch.Tensor | None = None

    def index(self, base: torch.Tensor, tensors: list[torch.Tensor], stride: int) -> torch.Tensor:
        """Positions in ``base`` (flat) of every ``stride``-th element of each of ``tensors``, on its device."""
        base_offset = base.storage_offset()
        places = tuple((t.storage_offset() - base_offset, t.numel()) for t in tensors)
        key = (places, stride, base.device)
        plan = self._plans.get(key)
        if plan is None:
            if len(self._plans) >= PLANS_KEPT:
                self._plans.clear()
            positions = [torch.arange(start, start + numel, stride) for start, numel in places]
            plan = self._plans[key] = to_device(torch.cat(positions), base.device)
        return plan

    def room(self, size: int, like: torch.Tensor) -> torch.Tensor:
        """A vector of ``size`` elements of ``like``'s dtype and device, the same one as last time if it fits."""
        room = self._room
        if room is None or (room.numel(), room.dtype, room.device) != (size, like.dtype, like.device):
            room = self._room = torch.empty(size, dtype=like.dtype, device=like.device)
        return room


class StepGather:
    """One sampled step's gradient sample, gathered bucket by bucket without a host read: into a vector
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
        """One bucket's tensors: each buffer's elements gathered into the room, or, where they do not fit
        (the first sampled step, whose size is not known yet), kept as one part for the bucket. ``experts``:
        experts' matrices, kept apart (`edgc.control.entropy`'s docstring: their exact zeros leave the sample)."""
        if experts:
            views = [t.detach().reshape(-1)[:: self.stride] for t in experts]
            same = all(v.dtype == views[0].dtype for v in views)
            self.expert_parts.append(torch.cat(views if same else [v.float() for v in views]).float())
        if self.room is None and self.size and not self.filled and tensors:
            self.room = self._buffers.room(self.size, tensors[0])
        apart = []
        for base, run in _runs(tensors):
            if len(run) == 1 and base is run[0]:  # a strided tensor: its elements copied
                values = run[0].detach().reshape(-1)[:: self.stride]
                slot = self._slot(values.numel(), values, apart)
                gathered = slot.copy_(values) if slot is not None else values.clone()
            else:
                index = self._buffers.index(base, run, self.stride)
                slot = self._slot(index.numel(), base, apart)
                gathered = torch.index_select(base.detach().reshape(-1), 0, index, out=slot)
            if slot is not None:
                self.filled += gathered.numel()
            else:
                apart.append(gathered)
        if apart:  # kept apart, joined in `sample` (no per-bucket read)
            self.parts.append(apart[0] if len(apart) == 1 else torch.cat(apart))

    def _slot(self, size: int, like: torch.Tensor, apart: list) -> torch.Tensor | None:
        """Where the next ``size`` elements go in ``room`` (None: a part of its own)."""
        room = self.room
        if room is None or self.parts or apart or room.dtype != like.dtype or self.filled + size > room.numel():
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
