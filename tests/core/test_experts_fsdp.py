"""FSDP2/HSDP with experts that FSDP shards by expert (`edgc.parallel.fsdp`, `edgc.distributed.experts`), on 4
gloo processes: without EP, Shard(0) over 2 shards × 2 replicas, each shard's rows are compressed as the global
experts they hold. (EP with FSDP, torchtitan's layout, tokens through the all-to-all: tests/train/test_moe_parallel.py.)
"""

import torch
from distributed_harness import run_distributed
from torch import nn
from torch.distributed.fsdp import fully_shard

from edgc import EDGCConfig, EDGCState
from edgc.distributed.experts import mark_experts
from edgc.parallel.fsdp import register_fsdp_comm_hook

EXPERTS, LOCAL, D, H = 4, 2, 8, 16
CONFIG = dict(
    r_max=2,
    r_min=2,
    adaptive=False,
    window=2,
    total_steps=20,
    warmup_fraction=0.0,
    min_warmup_steps=1,
    warmup_error_test=False,
)


class Experts(nn.Module):
    """This EP rank's ``LOCAL`` of ``EXPERTS`` experts, one stacked ``[LOCAL, H, D]`` parameter; row i to i % LOCAL."""

    def __init__(self, ep_rank: int):
        super().__init__()
        self.w = nn.Parameter(torch.randn(EXPERTS, H, D)[ep_rank * LOCAL : (ep_rank + 1) * LOCAL].clone())

    def forward(self, h):
        return torch.stack([self.w[i % LOCAL] @ row for i, row in enumerate(h)])


class Model(nn.Module):
    def __init__(self, ep_rank: int):
        super().__init__()
        torch.manual_seed(0)
        self.dense = nn.Linear(D, D)
        self.experts = Experts(ep_rank)

    def forward(self, x):
        return self.experts(self.dense(x)).square().mean()


def batch(rank: int, step: int) -> torch.Tensor:
    return torch.randn(4, D, generator=torch.Generator().manual_seed(100 * step + rank))


def full(grad) -> torch.Tensor:
    return grad.full_tensor() if hasattr(grad, "full_tensor") else grad


# ---------------------------------------------------------------------------- experts sharded by expert (Shard(0))
def sharded_by_expert(rank: int, world: int) -> dict:
    """HSDP 2 replicas × 2 shards, no EP: all four experts on every replica, FSDP's Shard(0) giving each
    shard rank two whole experts; one state averages both modules' shards over the replicas."""
    from edgc.parallel.fsdp import hsdp_mesh

    mesh = hsdp_mesh(2)
    model = Model(0)
    model.experts.w = nn.Parameter(torch.randn(EXPERTS, H, D))  # every expert (seeded by Model)
    mark_experts(model.experts, None, first=0, ep=1)  # averaged over all four ranks: replicas × shards
    fully_shard(model.experts, mesh=mesh["dp_shard"])
    fully_shard(model, mesh=mesh["dp_shard"])
    state = EDGCState(mesh["dp_replicate"], EDGCConfig(**CONFIG))
    register_fsdp_comm_hook(model, state)
    out = {"shard": mesh["dp_shard"].get_local_rank(), "grads": [], "ranks": []}
    for step in range(3):
        model.zero_grad()
        model(batch(rank, step)).backward()
        out["grads"].append({name: full(p.grad) for name, p in model.named_parameters()})
        out["ranks"].append(dict(state.last_step_metrics["ranks"]))
        with torch.no_grad():
            for p in model.parameters():
                p.add_(p.grad, alpha=-0.1)
    return out


def test_experts_sharded_by_expert_are_each_named_by_the_global_expert_their_rows_hold():
    results = run_distributed(sharded_by_expert, 4)
    for out in results:
        held = {f"experts.w[{2 * out['shard'] + i}]" for i in range(2)}
        for ranks in out["ranks"][1:]:  # compressed steps: this shard's two experts, each its own matrix
            assert {name for name in ranks if name.startswith("experts.w[")} == held
            assert all(ranks[name] == 2 for name in held)
    for step in range(3):  # every rank ends with the same full gradients (replicas of each shard alike)
        for name, grad in results[0]["grads"][step].items():
            assert all(torch.equal(out["grads"][step][name], grad) for out in results), (step, name)
