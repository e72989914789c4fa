"""The one place where a gradient's scale is set before a state averages it: the contract an integration builds on.

A state (`edgc.EDGCState`, `edgc.AllReduceState`, any sync method) averages what it is handed over its
group G: it returns ``(1/|G|) · Σ_{r ∈ G} s · g_r`` for each gradient ``g_r``, compressed or not. The
factor ``s`` is set here, by `GradientScale`, and nowhere else in edgc; it follows one of two conventions:

* **mean** (DDP's, the default): each rank's loss is the mean over its own tokens, and the result is the
  gradient of the mean of the data-parallel ranks' losses, as DDP's. For a dense parameter s = 1. A
  stacked experts gradient (`edgc.distributed.experts`) holds, on each rank, the contributions of the
  tokens of all its ``ep`` expert-parallel peers (the all-to-all's backward sums them into the rank that
  holds the expert), and is averaged over its expert-data-parallel group, ``1/ep`` of the data-parallel
  ranks: s = 1/ep (Megatron's edp/dp), so that an expert's gradient is the same at any ep.
* **sum** (FSDP2's division off: ``set_gradient_divide_factor`` set on the module, as torchtitan sets 1.0
  and divides its loss by the global number of tokens itself): FSDP's own division is the whole scaling,
  FSDP sums over the shard ranks, and the state sums over its replicate group: ``s = |G|`` for every
  parameter, experts included (no 1/ep: the user's loss scaling already counts every token once).
  Only the FSDP hook (`edgc.parallel.fsdp`) sets it, from the FSDP modules it reduces.

An integration that hands gradients to a state scales nothing itself, and must not divide again what
the state averaged (torchtitan: keep its division off and its loss divided by the global tokens; the
hook sums). ``s`` multiplies the gradient in place before anything else (error feedback, compression,
sampling) sees it, so the error feedback is kept in the scaled units and a low-rank average stays the
low-rank average of the scaled mean. Every rank of a group applies the same ``s``: it is compared with
the other settings at the first step (`edgc.distributed.agreement`).
"""

from __future__ import annotations

from collections.abc import Mapping

import torch

__all__ = ["GradientScale", "MEAN", "SUM"]

MEAN, SUM = "mean", "sum"


class GradientScale:
    """``s`` of each gradient a state is handed (see the module docstring): ``convention`` ('mean' or 'sum'),
    set once, before the first step; the experts' ``ep`` comes with the gradients (by parameter name)."""

    def __init__(self):
        self.convention = MEAN

    def use(self, convention: str, state_name: str) -> None:
        """Set the convention (the FSDP hook, from FSDP's division); refused once it differs from a set one."""
        if convention not in (MEAN, SUM):
            raise ValueError(f"{state_name}: a gradient scale is {MEAN!r} or {SUM!r}, got {convention!r}")
        self.convention = convention

    def factor(self, group_size: int, ep: int) -> float:
        """``s`` of a gradient averaged over ``group_size`` ranks whose experts are split over ``ep`` ranks
        (1: a dense parameter)."""
        return float(group_size) if self.convention == SUM else 1.0 / ep

    def apply(self, names: list[str], grads: list[torch.Tensor], group_size: int, ep: Mapping[str, int]) -> None:
        """Multiply each gradient in place by its ``s`` (``ep``: parameter name → its experts' ep; others dense):
        one launch per distinct factor, none where every factor is 1 (no loop over the names without experts)."""
        if self.convention == SUM:
            if group_size != 1:
                torch._foreach_mul_(grads, float(group_size))
            return
        if not ep:
            return
        by_factor: dict[float, list[torch.Tensor]] = {}
        for name, grad in zip(names, grads):
            s = self.factor(group_size, ep.get(name, 1))
            if s != 1.0:
                by_factor.setdefault(s, []).append(grad)
        for s, tensors in by_factor.items():
            torch._foreach_mul_(tensors, s)

    def agreed(self, group_size: int, ep: Mapping[str, int]) -> dict[str, object]:
        """What the group compares at the first step: the convention, and each expert parameter's ``s``."""
        out: dict[str, object] = {"gradient scale": self.convention}
        if ep:
            out["expert gradient scales"] = sorted((name, self.factor(group_size, e)) for name, e in ep.items())
        return out
