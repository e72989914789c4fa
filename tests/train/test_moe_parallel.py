"""The harness's MoE layer (`edgc_train.moe`, tokens through the all-to-all) under expert parallelism, on 4 gloo
processes (one call for everything, `edgc.distributed.scaling`'s contract):

* **ep = 1 and ep = 2 give the same gradients and step**: the same model and global batch (rank r reads
  the same tokens in both), every token routed to the same experts (asserted), the dense and every
  expert's gradient after the sync and before the optimizer equal (rtol 1e-5) at every step, and so the
  model after each step, uncompressed and with EDGC at a compressing static rank (PowerSGD is linear in
  the mean: both compress the same mean).
* **torchtitan's FSDP2 layout**: ``fully_shard`` of the MoE block with per-parameter meshes
  (``shard_placement_fn``: the experts on their expert-FSDP mesh, the router on the dense one: two
  parameter groups in one module), FSDP's division off and the loss divided by the global tokens, the
  hook summing each group over its own replicate group. Two layouts of 4 ranks: replicas 2 × ep 2 (the
  2-D expert mesh [dp_replicate 2, efsdp 1]) and ep 2 × an expert shard of 2 ranks (efsdp 2), and the
  first with FSDP's division on (each rank's loss its mean: the hook averages, the experts scaled by
  1/ep), and the second with the experts sharded within each (``Shard(1)``, as torchtitan shards them
  where the ranks outnumber the experts); the warm-up step's gradients are the global loss's, and EDGC's
  compressed steps keep every replica of the dense part and of each expert (over its expert-data-parallel
  group) identical. The experts' mesh without a state of its own, or one state for both meshes, is
  refused in one line before any hook is set.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor import Shard

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "core"))  # distributed_harness
from distributed_harness import run_distributed  # noqa: E402

from edgc import AllReduceState, EDGCConfig, EDGCState  # noqa: E402
from edgc.distributed.experts import dense_parameters, expert_parameters, mark_experts  # noqa: E402
from edgc_train.moe import MoEFeedForward  # noqa: E402

VOCAB, D, EXPERTS, TOP_K, TOKENS, STEPS = 32, 8, 4, 2, 12, 3
STATIC = dict(
    r_max=1, r_min=1, adaptive=False, window=2, total_steps=20, warmup_fraction=0.0, min_warmup_steps=1,
    warmup_error_test=False,
)  # fmt: skip


class TinyMoE(nn.Module):
    """An embedding, one routed MoE layer (a residual), a head: the same weights at any ep (one seed)."""

    def __init__(self, ep_group=None):
        super().__init__()
        torch.manual_seed(0)
        self.embed = nn.Embedding(VOCAB, D)
        self.moe = MoEFeedForward(D, EXPERTS, TOP_K, ep_group, init_std=0.2)
        self.head = nn.Linear(D, VOCAB)
        self.routes: list[torch.Tensor] = []
        self.moe.router.register_forward_hook(lambda _, __, out: self.routes.append(out.detach().topk(TOP_K)[1]))

    def forward(self, x: torch.Tensor, y: torch.Tensor, reduction: str = "mean") -> torch.Tensor:
        h = self.embed(x)
        h = h + self.moe(h)
        return F.cross_entropy(self.head(h).flatten(0, 1), y.flatten(), reduction=reduction)


def batch(rank: int, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    tokens = torch.randint(VOCAB, (1, TOKENS + 1), generator=torch.Generator().manual_seed(100 * step + rank))
    return tokens[:, :-1], tokens[:, 1:]


def full_experts(grad: torch.Tensor, ep_group, ep: int) -> torch.Tensor:
    """Every expert's gradient, [E, ·, ·], from the EP ranks that hold them."""
    if ep == 1:
        return grad.clone()
    parts = [torch.empty_like(grad) for _ in range(ep)]
    dist.all_gather(parts, grad.contiguous(), group=ep_group)
    return torch.cat(parts)


def at_ep(rank: int, ep: int, compressed: bool) -> list[dict]:
    """STEPS steps at ``ep``: each step's routes, dense and full expert gradients after the sync."""
    from edgc.distributed.mesh import init_parallel_mesh

    mesh = init_parallel_mesh("cpu", ep=ep)
    ep_group = mesh.get_group("ep") if ep > 1 else None
    model = TinyMoE(ep_group)
    mark_experts(model.moe.experts, mesh["dp_replicate"], first=model.moe.first, ep=ep, tokens=model.moe.tokens)
    make = (lambda group: EDGCState(group, EDGCConfig(**STATIC), model=model)) if compressed else None
    make = make or (lambda group: AllReduceState(group, model=model))
    dense, experts = make(None), make(mesh["dp_replicate"])
    records = []
    for step in range(STEPS):
        model.zero_grad()
        model.routes.clear()
        model(*batch(rank, step)).backward()
        dense.synchronize(dense_parameters(model))
        experts.synchronize(expert_parameters(model))
        grads = {name: p.grad.clone() for name, p in dense_parameters(model)}
        grads.update({name: full_experts(p.grad, ep_group, ep) for name, p in expert_parameters(model)})
        phases = (dense.last_step_metrics.get("phase"), experts.last_step_metrics.get("phase"))
        records.append({"routes": model.routes[0].clone(), "grads": grads, "phases": phases})
        with torch.no_grad():  # the same SGD step at either ep: the next step's routes must agree again
            for _, p in model.named_parameters():
                p.add_(p.grad, alpha=-0.5)
        params = {name: p.detach().clone() for name, p in dense_parameters(model)}
        params.update({name: full_experts(p.detach(), ep_group, ep) for name, p in expert_parameters(model)})
        records[-1]["params"] = params  # after the step
    return records


# ---------------------------------------------------------------------------- torchtitan's FSDP2 layout
def refused(call) -> str:
    try:
        call()
    except ValueError as error:
        return str(error)
    return ""


def titan_layout(rank: int, world: int, replicas: int, division_off: bool = True, expert_dim: int = 0) -> dict:
    """``replicas`` × ep 2 × efsdp (4 / replicas / 2): the MoE block sharded as torchtitan shards it, FSDP's
    division off and the loss divided by the global tokens (torchtitan's), or on and each rank's loss its mean;
    the experts sharded by expert (``expert_dim`` 0) or within each (1: torchtitan's past one expert a rank)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import FSDPModule, fully_shard
    from torch.distributed.fsdp._fully_shard._fsdp_common import FSDPMeshInfo, ShardPlacementResult

    from edgc.parallel.fsdp import register_fsdp_comm_hook

    efsdp = world // replicas // 2
    mesh = init_device_mesh("cpu", (replicas, efsdp, 2), mesh_dim_names=("dp_replicate", "efsdp", "ep"))
    dense_shard = init_device_mesh("cpu", (replicas, efsdp * 2), mesh_dim_names=("dp_replicate", "fsdp"))["fsdp"]
    model = TinyMoE(mesh.get_group("ep"))
    edp = mesh["dp_replicate", "efsdp"]._flatten("edp")  # the ranks holding the same experts
    mark_experts(model.moe.experts, edp, first=model.moe.first, ep=2, tokens=model.moe.tokens)
    experts = set(model.moe.experts.parameters())
    expert_info, dense_info = FSDPMeshInfo(mesh["efsdp"], shard_mesh_dim=0), FSDPMeshInfo(dense_shard, shard_mesh_dim=0)

    dense_placement = ShardPlacementResult(Shard(0), dense_info)

    def place(p):  # torchtitan's: the experts on their expert-FSDP mesh, the rest on the dense one
        return ShardPlacementResult(Shard(expert_dim), expert_info) if p in experts else dense_placement

    fully_shard(model.moe, mesh=dense_shard, shard_placement_fn=place)
    fully_shard(model, mesh=dense_shard)
    for module in model.modules():
        if isinstance(module, FSDPModule) and division_off:
            module.set_gradient_divide_factor(1.0)  # torchtitan's: the loss is divided by the global tokens
            module.set_force_sum_reduction_for_comms(True)  # gloo has no PREMUL_SUM
    dense = EDGCState(mesh["dp_replicate"], EDGCConfig(**STATIC))
    expert = EDGCState(mesh["dp_replicate"], EDGCConfig(**STATIC))
    refusals = {  # before any hook is set: the experts' mesh without a state of its own, one state for both
        "one state": refused(lambda: register_fsdp_comm_hook(model, dense)),
        "shared state": refused(lambda: register_fsdp_comm_hook(model, {dense_shard: dense, mesh["efsdp"]: dense})),
    }
    register_fsdp_comm_hook(model, {dense_shard: dense, mesh["efsdp"]: expert})
    groups = len(model.moe._get_fsdp_state()._fsdp_param_groups)
    out = {"groups": groups, "steps": [], "ep_rank": mesh["ep"].get_local_rank(), "refusals": refusals}
    out["expert placement"] = model.moe.experts.w1.placements
    for step in range(STEPS):
        model.zero_grad()
        x, y = batch(rank, step)
        (model(x, y, reduction="sum") / (TOKENS * world) if division_off else model(x, y)).backward()
        grads = {name: p.grad.full_tensor() for name, p in model.named_parameters()}
        for name, _ in expert_parameters(model):  # every expert: this EP rank's, then the other's
            grads[name] = full_experts(grads[name], mesh.get_group("ep"), 2)
        everyone = {name: [torch.empty_like(g) for _ in range(world)] for name, g in grads.items()}
        for name, g in grads.items():
            dist.all_gather(everyone[name], g)
        phases = (dense.last_step_metrics["phase"], expert.last_step_metrics["phase"])
        out["steps"].append({"everyone": everyone, "phases": phases, "ranks": dict(expert.last_step_metrics["ranks"])})
        with torch.no_grad():
            for p in model.parameters():
                p.add_(p.grad, alpha=-0.5)
    return out


def reference(world: int) -> list[dict]:
    """The gradients of the global loss (every rank's batch, every expert on one process), step by step."""
    model = TinyMoE()
    out = []
    for step in range(STEPS):
        model.zero_grad()
        sum(model(*batch(rank, step), reduction="sum") for rank in range(world)).div(TOKENS * world).backward()
        out.append({name: p.grad.clone() for name, p in model.named_parameters()})
        with torch.no_grad():
            for p in model.parameters():
                p.add_(p.grad, alpha=-0.5)
    return out


def worker(rank: int, world: int) -> dict:
    out = {"parity": {(c, ep): at_ep(rank, ep, c) for c in (False, True) for ep in (1, 2)}}
    layouts = ((2, True, 0), (1, True, 0), (2, False, 0), (1, True, 1))
    out["titan"] = {layout: titan_layout(rank, world, *layout) for layout in layouts}
    out["reference"] = reference(world) if rank == 0 else None
    return out


@pytest.fixture(scope="module")
def runs():
    return run_distributed(worker, 4)


@pytest.mark.parametrize("compressed", [False, True], ids=["uncompressed", "edgc"])
def test_ep_1_and_ep_2_route_alike_and_give_the_same_gradients(runs, compressed):
    for out in runs:
        one, two = out["parity"][(compressed, 1)], out["parity"][(compressed, 2)]
        for step, (a, b) in enumerate(zip(one, two)):
            assert torch.equal(a["routes"], b["routes"]), step  # every token to the same experts
            if compressed:
                assert a["phases"] == b["phases"] == (("warmup",) * 2 if step == 0 else ("compress",) * 2)
            for name, grad in a["grads"].items():
                torch.testing.assert_close(b["grads"][name], grad, rtol=1e-5, atol=1e-7, msg=f"{step} {name}")
            for name, param in a["params"].items():  # and the same model after the step
                torch.testing.assert_close(b["params"][name], param, rtol=1e-5, atol=1e-7, msg=f"{step} {name}")


@pytest.mark.parametrize(
    "layout",
    [(2, True, 0), (1, True, 0), (2, False, 0), (1, True, 1)],
    ids=[
        "2-D expert mesh",
        "expert shard of 2",
        "FSDP's division on: the mean, experts by 1 over ep",
        "Shard(1) experts",
    ],
)
def test_torchtitans_layout_reduces_each_group_over_its_replicas_and_keeps_replicas_identical(runs, layout):
    ref = runs[0]["reference"]
    for rank, out in enumerate(runs):
        titan = out["titan"][layout]
        assert titan["groups"] == 2  # the router's mesh and the experts': one module, two parameter groups
        assert titan["expert placement"] == (Shard(layout[2]),)
        first = titan["steps"][0]
        assert first["phases"] == ("warmup", "warmup")
        for name, grad in ref[0].items():  # the warm-up's sum is the global loss's gradient
            torch.testing.assert_close(first["everyone"][name][rank], grad, rtol=1e-5, atol=1e-7, msg=name)
        for step in titan["steps"][1:]:
            assert step["phases"] == ("compress", "compress")
            assert any(name.startswith("moe.experts.w1[") for name in step["ranks"])  # each expert its own matrix
            for name, every in step["everyone"].items():  # full tensors: every replica, every expert alike
                assert all(torch.equal(g, every[0]) for g in every), name


def test_the_experts_mesh_without_a_state_of_its_own_is_refused_in_one_line(runs):
    for case, words in (("one state", "needs a state of its own"), ("shared state", "give each mesh its own")):
        lines = [out["titan"][(2, True, 0)]["refusals"][case] for out in runs]
        assert all(line == lines[0] and "\n" not in line for line in lines) and words in lines[0], lines[0]
