"""Where each parameter's shard lies in the buffer FSDP2 hands its all-reduce hook (`edgc.parallel.fsdp`).

FSDP2 reduce-scatters a parameter group's gradients into one flat buffer: this rank's shard of each
parameter, back to back in the group's order, each padded to its padded shard size. Where a backward
gave only some of the group's parameters gradients (torchtitan's chunked loss reduces ``lm_head`` of a
``fully_shard([norm, lm_head])`` group in a backward of its own), the buffer holds those alone.
"""

from __future__ import annotations

import torch
from torch import nn

__all__ = ["shard_layout", "partial_layout"]


def shard_layout(group) -> list[tuple[nn.Parameter, torch.Size, int]]:
    """(sharded parameter, this rank's shard size, padded shard numel) per parameter, in buffer order."""
    return [(fp.sharded_param, fp.sharded_size, fp.padded_sharded_param_size.numel()) for fp in group.fsdp_params]


def partial_layout(layout: list, numel: int) -> list:
    """The parameters of ``layout`` [(name, size, padded numel)] that a reduce-scatter of ``numel``
    elements holds: FSDP reduce-scatters the parameters that got gradients in a backward, in the group's
    order, so they are the one ordered subset whose padded sizes add up to ``numel``. Raises where none
    or several do (two parameters of one shard size)."""
    found: list[list] = []

    def search(start: int, left: int, chosen: list) -> None:
        if left == 0:
            found.append(list(chosen))
        for i in range(start, len(layout)):
            if len(found) > 1:
                return
            if layout[i][2] <= left:
                search(i + 1, left - layout[i][2], [*chosen, layout[i]])

    search(0, numel, [])
    if len(found) != 1:
        names = [name for name, _, _ in layout]
        raise RuntimeError(
            f"FSDP reduce-scatter output has {numel} elements, which {'no' if not found else 'more than one'} "
            f"subset of its group's parameters {names} makes up: cannot tell which gradients it holds"
        )
    return found[0]
