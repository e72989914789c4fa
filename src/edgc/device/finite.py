"""Finiteness flags that cannot overflow: is every element of a tensor finite, on the device.

A NaN or ±Inf anywhere makes a sum NaN or infinite, so one reduction answers, provided the sum
itself cannot overflow. In the values' own dtype it can: fp16 gradients under a GradScaler carry
its 2¹⁶ scale, and their sum passes fp16's largest number (65,504) while every element is finite,
which would flag, NaN and skip a sound step. Summed in float64, 16- and 32-bit values cannot
overflow: 2⁴⁰ elements of fp32's largest magnitude (3.4·10³⁸) add up to 4·10⁵⁰, far below
float64's 1.8·10³⁰⁸. float64 values are tested element by element instead.

The flag stays a device tensor (no host read): callers read it once, at the end of the step.
"""

from __future__ import annotations

import torch


def all_finite(values: torch.Tensor) -> torch.Tensor:
    """A 0-dim bool tensor on ``values``' device: True when no element is NaN or ±Inf."""
    if values.dtype == torch.float64:
        return torch.isfinite(values).all()
    return torch.isfinite(values.sum(dtype=torch.float64))


def nan_unless_finite(*tensors: torch.Tensor) -> torch.Tensor:
    """A 1-element float32 tensor: 0 when every element of every tensor is finite, NaN otherwise.

    A flag that survives an average over ranks (one rank's NaN keeps the mean NaN, zeros keep it
    zero) and that poisons whatever it is added to, so a non-finite step needs no branch: adding it
    to the decompressed factors makes every averaged gradient NaN on every rank."""
    sums = [
        values.sum(dtype=torch.float64)
        if values.dtype != torch.float64
        else torch.where(torch.isfinite(values).all(), 0.0, float("nan"))
        for values in tensors
        if values.numel()
    ]
    if not sums:
        return torch.zeros(1, dtype=torch.float32, device=tensors[0].device)
    total = sums[0]
    for value in sums[1:]:
        total = total + value
    return (total * 0).float().reshape(1)
