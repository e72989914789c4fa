"""The process grid of `edgc train --pp/--tp`: every rank's groups."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch.distributed as dist


from .rendezvous import dist_timeout


@dataclass
class Grid:
    rank: int
    world: int
    stages: int
    replicas: int
    stage: int  # this rank's pipeline stage
    replica: int  # this rank's data-parallel index
    dp_group: Any
    pp_group: Any
    embedding_group: Any  # None unless this rank holds a tied-embedding copy (first or last stage)
    tp: int = 1  # tensor-parallel degree T
    tp_rank: int = 0
    tp_group: Any = None  # None when tp = 1

    @property
    def first(self) -> bool:
        return self.stage == 0

    @property
    def last(self) -> bool:
        return self.stage == self.stages - 1

    def global_rank(self, stage: int, replica: int, tp_rank: int | None = None) -> int:
        return (replica * self.stages + stage) * self.tp + (self.tp_rank if tp_rank is None else tp_rank)


def make_grid(rank: int, world: int, stages: int, tp: int = 1) -> Grid:
    """Create every group on every rank, in the same order (new_group is collective).

    rank = (replica·P + stage)·T + tp_rank: a TP group is T consecutive ranks (one host), a
    pipeline P·T consecutive ones; one DP group per (TP rank, stage), one pipeline group and one
    embedding group per (TP rank, replica), one TP group per (stage, replica).
    """
    if world % (stages * tp):
        raise ValueError(f"pp × tp: world size {world} is not a multiple of {stages} stages × {tp} TP ranks")
    replicas = world // (stages * tp)
    rest, tp_rank = divmod(rank, tp)
    replica, stage = divmod(rest, stages)

    def at(s: int, d: int, t: int) -> int:
        return (d * stages + s) * tp + t

    dp_group = pp_group = embedding_group = tp_group = None
    timeout = dist_timeout()  # the default group's; new_group's own default is 30 min on gloo
    for t in range(tp):
        for s in range(stages):
            group = dist.new_group([at(s, d, t) for d in range(replicas)], timeout=timeout)
            if (t, s) == (tp_rank, stage):
                dp_group = group
    for t in range(tp):
        for d in range(replicas):
            group = dist.new_group([at(s, d, t) for s in range(stages)], timeout=timeout)
            if (t, d) == (tp_rank, replica):
                pp_group = group
    if stages > 1:
        for t in range(tp):
            for d in range(replicas):
                group = dist.new_group([at(0, d, t), at(stages - 1, d, t)], timeout=timeout)
                if (t, d) == (tp_rank, replica) and stage in (0, stages - 1):
                    embedding_group = group
    if tp > 1:
        for s in range(stages):
            for d in range(replicas):
                group = dist.new_group([at(s, d, t) for t in range(tp)], timeout=timeout)
                if (s, d) == (stage, replica):
                    tp_group = group
    return Grid(rank, world, stages, replicas, stage, replica, dp_group, pp_group, embedding_group,
                tp, tp_rank, tp_group)
