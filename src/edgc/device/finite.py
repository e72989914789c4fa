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


def finite_flag(values: torch.Tensor) -> torch.Tensor:
    """A (1,) float64 tensor that is finite exactly when every element of ``values`` is: their sum in
    float64 (which 16- and 32-bit values cannot overflow), or for float64 values 0 or NaN."""
    if values.dtype == torch.float64:
        return torch.where(torch.isfinite(values).all(), 0.0, float("nan")).reshape(1)
    return (
        values.sum(0, keepdim=True, dtype=torch.float64)
        if values.dim() == 1
        else values.sum(dtype=torch.float64).reshape(1)
    )


def flag_into(out: torch.Tensor, *tensors: torch.Tensor) -> None:
    """`nan_unless_finite` of ``tensors`` (one or two, non-empty) written into ``out`` (one element, any
    floating dtype): 0·s₁·s₂ of their `finite_flag` s is NaN when either is not finite (0·Inf, 0·NaN),
    and the product of two finite float64 sums of 16- or 32-bit values cannot overflow. No tensor:
    0."""
    if not tensors:
        out.zero_()
        return
    flag = finite_flag(tensors[0])
    for values in tensors[1:]:
        flag = torch.mul(flag, finite_flag(values))
    torch.mul(flag, 0, out=out)
