"""Entropy estimates of a gradient sample on the device: no atomics into few bins, no host read, no size
that depends on the values.

A 1000-bin histogram counted with one index-add over the whole sample is one atomic per element into
a thousand counters: on a GPU at GPT-2 XL's β sample that one kernel was most of a sampled step's
device time (docs/gpu.md). Here every row of `ROW` elements counts into a private row of counters
(one ``scatter_add_`` along the rows: an element's add meets only its own row's elements, so no
counter is shared between rows), and one sum over the rows gives the histogram. Integer counts, so
the result does not depend on the order of the adds: deterministic on every device.

Non-finite elements are not dropped (that would make the sample's size depend on its values): they
go to a bin of their own past the last, outside the range, which the finite values' [min, max] set;
the padding of the last row goes there too. What reaches the host, with the step's one read
(`edgc.device.totals.StepTotals`), is the estimate and the count of finite elements.
"""

from __future__ import annotations

import torch

ROW = 1 << 12  # sample elements per private row of counters


def finite_mask(values: torch.Tensor) -> torch.Tensor:
    """True where ``values`` is finite: x − x is 0 there and NaN for ±Inf and NaN (two element-wise ops)."""
    return (values - values) == 0


def finite_bounds(values: torch.Tensor, nonfinite: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(min, max) of the finite elements (+Inf, −Inf when there are none); ``nonfinite``: where they are not."""
    low = torch.where(nonfinite, float("inf"), values).amin()
    high = torch.where(nonfinite, float("-inf"), values).amax()
    return low, high


def bin_counts(values: torch.Tensor, bins: int, nonfinite: torch.Tensor, bounds: tuple) -> torch.Tensor:
    """Counts (int64) of the finite fp32 ``values`` in ``bins`` equal bins over ``bounds`` = their
    [min, max], as ``torch.histc`` counts them on a CPU: bin ⌊(x − min)·bins/(max − min)⌋ in fp32, the
    top edge in the last bin, a constant sample all in the first. ``nonfinite``: where the values are not
    finite (not counted). Private rows, then one sum (see the module docstring)."""
    low, high = bounds
    # A constant sample (span 0) puts every element in bin 0; a range past ~10³⁵ overflows this fp32
    # product (in histc too, where it is undefined): such elements land in an end bin, never outside.
    span = (high - low).clamp_(min=torch.finfo(torch.float32).tiny)
    size = values.numel()
    rows = -(-size // ROW)
    if size % ROW:  # the last row's padding: past the last bin
        placed = torch.full((rows * ROW,), bins, dtype=torch.int64, device=values.device)
    else:
        placed = torch.empty(size, dtype=torch.int64, device=values.device)
    # The bin in float32 (exact for whole numbers this small): clamped, the non-finite past the last
    # bin, then one conversion into the index (clamping before the truncation gives the same bins).
    scaled = (values - low).mul_(bins).div_(span).clamp_(0, bins - 1)
    placed[:size].copy_(scaled.masked_fill_(nonfinite, bins))
    counts = torch.zeros(rows, bins + 1, dtype=torch.int32, device=values.device)
    one = torch.ones((), dtype=torch.int32, device=values.device)
    counts.scatter_add_(1, placed.view(rows, ROW), one.expand(rows, ROW))
    return counts.sum(0)[:bins]


def histogram_counts(values: torch.Tensor, bins: int, bounds: tuple | None = None) -> torch.Tensor:
    """Counts (int64) of finite fp32 ``values`` in ``bins`` equal bins over their own [min, max]
    (`bin_counts`; non-finite values are not counted). ``bounds``: the finite values' ``(min, max)``,
    where the caller has them (a pass over the values fewer)."""
    nonfinite, values = _nonfinite(values), values.reshape(-1).float()
    return bin_counts(values, bins, nonfinite, finite_bounds(values, nonfinite) if bounds is None else bounds)


def _nonfinite(values: torch.Tensor) -> torch.Tensor:
    """Where the flattened ``values`` are not finite, read in their own dtype (half the bytes of float32)."""
    values = values.reshape(-1)
    return (values - values) != 0


def histogram_entropy_on_device(values: torch.Tensor, bins: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(plug-in Shannon entropy in nats of the finite values' histogram over their own [min, max], and
    how many values are finite), both 0-dim device tensors: NaN entropy when none is. Scale-invariant:
    it measures how concentrated the values are relative to their spread; a constant sample has 0."""
    nonfinite, values = _nonfinite(values), values.reshape(-1).float()
    counts = bin_counts(values, bins, nonfinite, finite_bounds(values, nonfinite))
    count = counts.sum()
    p = counts / count
    return -torch.xlogy(p, p).sum(), count  # xlogy(0, 0) = 0: empty bins add nothing


def gaussian_variance_on_device(values: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(the finite values' unbiased variance, in float64, and how many are finite), on the device."""
    values = values.reshape(-1).double()
    finite = finite_mask(values)
    count = finite.sum()
    kept = torch.where(finite, values, 0.0)
    deviation = torch.where(finite, kept - kept.sum() / count, 0.0)
    return deviation.square().sum() / (count - 1), count
