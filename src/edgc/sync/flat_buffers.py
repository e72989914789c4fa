"""How the two-stage all-reduce (`edgc.sync.two_stage`) lays out one call: the run of values cut into
buckets (`Partition`, `bucket_plan`) and the call's tensors as one flat run (`flat_run`); this rank's
error feedback, one flat buffer per call whose per-parameter entries are views, is
`edgc.runner.error_feedback.FlatErrors`.

Buckets are sized from the run (`bucket_plan`): a run of n values is cut into about `TARGET_BUCKETS`
buckets, each at least `MIN_BUCKET_VALUES` and at most `MAX_BUCKET_VALUES`, a multiple of the members
times the codec's row multiple, so that every bucket but the run's last is N whole rows of the codec:
the collectives of one call are tens, not thousands (two a bucket), and what a bucket holds while it
is encoded (about 10 bytes a value) stays under a byte per value of the run. A fixed ``bucket_values``
cuts as before (every bucket that many values, rows of ⌈values / N⌉).
"""

from __future__ import annotations

import bisect
import functools
import itertools
import math
from dataclasses import dataclass

import torch

from ..adapters.torch_adapter import view_base

TARGET_BUCKETS = 16  # buckets a run is cut into: 32 collectives, and 1/16 of the run encoded at once
MIN_BUCKET_VALUES = 2**19  # below this a bucket's launches cost more than its values take to encode
MAX_BUCKET_VALUES = 2**28  # a bucket's transient memory stays near 2.5 GiB beyond ~4·10⁹ values a run


def bucket_plan(values: int, members: int, bucket_values: int | None = None, row_multiple: int = 8) -> tuple[int, int]:
    """(values per bucket, buckets) of a run of ``values`` over ``members`` (see the module docstring):
    ``bucket_values`` fixes the bucket, None sizes it from the run. What the simulator prices: two
    collectives a bucket."""
    if bucket_values is None:
        step = members * row_multiple
        target = min(MAX_BUCKET_VALUES, max(MIN_BUCKET_VALUES, math.ceil(values / TARGET_BUCKETS)))
        bucket_values = step * math.ceil(target / step)
    return bucket_values, max(1, math.ceil(values / bucket_values)) if values else 0


@dataclass(frozen=True)
class Partition:
    """How one call's run of values is cut: tensor sizes, group size and rank, values per bucket, and
    the multiple a chunk's values are rounded up to (1: a chunk is ⌈bucket's values / members⌉)."""

    sizes: tuple[int, ...]
    members: int
    rank: int
    bucket: int
    row_multiple: int = 1

    @functools.cached_property
    def total(self) -> int:
        return sum(self.sizes)

    @functools.cached_property
    def _buckets(self) -> tuple[tuple[int, int, int], ...]:
        total, bucket, step = self.total, self.bucket, self.members * self.row_multiple
        return tuple(
            (lo, min(lo + bucket, total), self.row_multiple * math.ceil((min(lo + bucket, total) - lo) / step))
            for lo in range(0, total, bucket)
        )

    def buckets(self) -> list[tuple[int, int, int]]:
        """(first value, end, chunk values C) of each bucket."""
        return list(self._buckets)

    def owned(self) -> int:
        """Values of the chunks this rank owns, over all buckets."""
        return sum(chunk for _, _, chunk in self._buckets)

    @functools.cached_property
    def starts(self) -> list[int]:
        """Where each tensor starts in the run."""
        return list(itertools.accumulate(self.sizes, initial=0))

    def pieces(self, lo: int, hi: int) -> list[tuple[int, int, int, int]]:
        """(tensor index, its first value, its end, position from ``lo``) of the run's values [lo, hi)."""
        out, index = [], max(0, bisect.bisect_right(self.starts, lo) - 1)
        while index < len(self.sizes) and self.starts[index] < hi:
            start = self.starts[index]
            a, b = max(lo, start), min(hi, start + self.sizes[index])
            if a < b:
                out.append((index, a - start, b - start, a - lo))
            index += 1
        return out


def flat_run(tensors: list[torch.Tensor], flat: torch.Tensor | None = None) -> torch.Tensor | None:
    """The ``tensors`` end to end as one flat view, when they are consecutive contiguous views of one
    buffer (``flat`` when it is that run: DDP's bucket; a DiLoCo fragment's Δ); else None."""
    total = sum(t.numel() for t in tensors)
    if flat is not None and flat.dim() == 1 and flat.numel() == total and flat.is_contiguous():
        return flat
    first = tensors[0]
    base = _base(first)
    if not base.is_contiguous() or base.dtype != first.dtype:
        return None
    at = first.storage_offset()
    for t in tensors:
        if _base(t) is not base or not t.is_contiguous() or t.storage_offset() != at:
            return None
        at += t.numel()
    start = first.storage_offset() - base.storage_offset()
    return base.view(-1)[start : start + total]


def _base(tensor: torch.Tensor) -> torch.Tensor:
    """The tensor ``tensor`` views, or itself."""
    base = view_base(tensor)
    return tensor if base is None else base
