"""The process grid of `edgc train --pp/--tp`: this rank's place in the run's one `DeviceMesh`.

`edgc.distributed.mesh.init_parallel_mesh` builds the mesh (dp_replicate, pp, dp_shard = 1, ep = 1, tp); every group
comes from it: a stage's data-parallel group is ``mesh["dp_replicate"]``, a pipeline ``mesh["pp"]``,
a stage's tensor-parallel ranks ``mesh["tp"]``, the tied embedding's stage 0 and stage P−1
`edgc.distributed.mesh.pipeline_ends_group`, and a stage's DP × TP ranks, who take EDGC's decisions together,
`edgc.distributed.mesh.group_across`. Global rank = (replica·P + stage)·T + tp_rank: a pipeline with
its TP ranks is P·T consecutive ranks (one host under ``torchrun --nproc_per_node P·T``), and each
stage's DP group spans the hosts, which is where gradient compression pays.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh

from edgc.distributed.mesh import group_across, init_parallel_mesh, pipeline_ends_group

from .rendezvous import dist_timeout


@dataclass
class Grid:
    mesh: DeviceMesh
    rank: int
    world: int
    stages: int
    replicas: int
    stage: int  # this rank's pipeline stage
    replica: int  # this rank's data-parallel index
    tp: int  # tensor-parallel degree T
    tp_rank: int
    embedding_group: Any  # None unless this rank holds a tied-embedding copy (first or last stage)
    stage_group: Any = None  # with tp > 1: this stage's DP replicas of all its TP shards, who decide EDGC alike

    @property
    def dp_group(self):
        return self.mesh.get_group("dp_replicate")

    @property
    def pp_group(self):
        return self.mesh.get_group("pp")

    @property
    def tp_group(self):
        """None when tp = 1."""
        return self.mesh.get_group("tp") if self.tp > 1 else None

    @property
    def first(self) -> bool:
        return self.stage == 0

    @property
    def last(self) -> bool:
        return self.stage == self.stages - 1

    def global_rank(self, stage: int, replica: int, tp_rank: int | None = None) -> int:
        return int(self.mesh.mesh[replica, stage, 0, 0, self.tp_rank if tp_rank is None else tp_rank])


def make_grid(device_type: str, stages: int, tp: int = 1) -> Grid:
    """The mesh over all ranks and this rank's coordinates in it (collective: every rank calls it)."""
    timeout = dist_timeout()  # the default group's, for every group of the mesh
    mesh = init_parallel_mesh(device_type, pp=stages, tp=tp, timeout=timeout)
    replica, stage, _, _, tp_rank = mesh.get_coordinate()
    return Grid(
        mesh,
        dist.get_rank(),
        dist.get_world_size(),
        stages,
        mesh.size(0),
        stage,
        replica,
        tp,
        tp_rank,
        pipeline_ends_group(mesh, "pp", timeout),
        group_across(mesh, ("dp_replicate", "tp"), timeout) if tp > 1 else None,
    )
