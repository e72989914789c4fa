"""FSDP2/HSDP with experts on their own mesh (`edgc.parallel.fsdp`, `edgc.distributed.experts`), EP 2 × DP 2
on 4 gloo processes (one call): the dense module sharded over the EP ranks of a replica, the stacked experts on
their own (one-rank) shard mesh, each mesh's shards averaged over the replicas by a state of its own
(``{mesh: state}``). The warm-up's gradients are the exact means of each group (dense over all four
ranks, each expert over its two replicas); compressed steps keep every replica of a shard identical,
each expert its own matrix. One state for the experts' mesh too, or no state for it, is refused in one
line before any hook is set. And without EP, experts that FSDP shards by expert (Shard(0), 2 replicas ×
2 shards): each shard's rows are compressed as the global experts they hold.
"""

import pytest
import torch
import torch.distributed as dist
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


def sharded(mesh, ep_rank: int):
    model = Model(ep_rank)
    mark_experts(model.experts, mesh["dp_replicate"], first=ep_rank * LOCAL)
    fully_shard(model.experts, mesh=mesh["dp_shard"])  # the experts' own mesh: one rank, whole experts
    fully_shard(model, mesh=mesh["ep"])  # the dense layer over the EP ranks of this replica
    return model


def refused(call) -> str:
    try:
        call()
    except ValueError as error:
        return str(error)
    return ""


def worker(rank: int, world: int) -> dict:
    from edgc.distributed.mesh import init_parallel_mesh

    mesh = init_parallel_mesh("cpu", ep=2)
    ep_rank = mesh["ep"].get_local_rank()
    out = {"ep_rank": ep_rank, "refusals": {}}
    model = sharded(mesh, ep_rank)
    dense_state = EDGCState(mesh["dp_replicate"], EDGCConfig(**CONFIG))
    out["refusals"]["one state"] = refused(lambda: register_fsdp_comm_hook(model, dense_state))
    both = {mesh["ep"]: dense_state, mesh["dp_shard"]: dense_state}
    out["refusals"]["shared state"] = refused(lambda: register_fsdp_comm_hook(model, both))

    expert_state = EDGCState(mesh["dp_replicate"], EDGCConfig(**CONFIG))
    register_fsdp_comm_hook(model, {mesh["ep"]: dense_state, mesh["dp_shard"]: expert_state})
    out["steps"] = []
    for step in range(4):
        plain = Model(ep_rank)
        plain(batch(rank, step)).backward()
        model.zero_grad()
        model(batch(rank, step)).backward()
        grads = {name: full(p.grad) for name, p in model.named_parameters()}
        everyone = {name: [torch.empty_like(g) for _ in range(world)] for name, g in grads.items()}
        local = {name: [torch.empty_like(p.grad) for _ in range(world)] for name, p in plain.named_parameters()}
        for name in grads:
            dist.all_gather(everyone[name], grads[name])
            dist.all_gather(local[name], plain.get_parameter(name).grad)
        phases = (dense_state.last_step_metrics["phase"], expert_state.last_step_metrics["phase"])
        ranks = expert_state.last_step_metrics["ranks"]
        out["steps"].append({"everyone": everyone, "local": local, "phases": phases, "ranks": ranks})
        with torch.no_grad():  # a step that moves the parameters alike where they must be alike
            for p in model.parameters():
                p.add_(p.grad, alpha=-0.1)
    return out


@pytest.fixture(scope="module")
def results():
    return run_distributed(worker, 4)


def test_experts_on_their_own_mesh_without_a_state_of_their_own_are_refused_in_one_line(results):
    for case, words in (("one state", "needs a state of its own"), ("shared state", "give each mesh its own")):
        lines = [out["refusals"][case] for out in results]
        assert all(line == lines[0] and "\n" not in line for line in lines) and words in lines[0], lines[0]


def test_the_warm_up_averages_each_group_exactly(results):
    for rank, out in enumerate(results):
        first = out["steps"][0]
        assert first["phases"] == ("warmup", "warmup")
        replicas = [r for r in range(4) if results[r]["ep_rank"] == out["ep_rank"]]
        for name in ("dense.weight", "dense.bias"):
            mean = sum(first["local"][name]) / 4
            assert torch.allclose(first["everyone"][name][rank], mean, atol=1e-6), name
        mean = sum(first["local"]["experts.w"][r] for r in replicas) / 2
        assert torch.allclose(first["everyone"]["experts.w"][rank], mean, atol=1e-6)


def test_compressed_steps_keep_every_replica_identical_each_expert_its_own_matrix(results):
    for out in results:
        replicas = [r for r in range(4) if results[r]["ep_rank"] == out["ep_rank"]]
        for record in out["steps"][1:]:
            assert record["phases"] == ("compress", "compress")
            dense = record["everyone"]["dense.weight"]
            assert all(torch.equal(g, dense[0]) for g in dense)
            experts = record["everyone"]["experts.w"]
            assert torch.equal(experts[replicas[0]], experts[replicas[1]])
            first = out["ep_rank"] * LOCAL
            assert {f"experts.w[{first}]", f"experts.w[{first + 1}]"} <= set(record["ranks"])


# ---------------------------------------------------------------------------- experts sharded by expert (Shard(0))
def sharded_by_expert(rank: int, world: int) -> dict:
    """HSDP 2 replicas × 2 shards, no EP: all four experts on every replica, FSDP's Shard(0) giving each
    shard rank two whole experts; one state averages both modules' shards over the replicas."""
    from edgc.parallel.fsdp import hsdp_mesh

    mesh = hsdp_mesh(2)
    model = Model(0)
    model.experts.w = nn.Parameter(torch.randn(EXPERTS, H, D))  # every expert (seeded by Model)
    mark_experts(model.experts, None, first=0)  # averaged over all four ranks: replicas × shards
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
