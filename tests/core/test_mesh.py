"""`edgc.distributed.mesh`: one DeviceMesh for every group; the library takes its dimensions where it takes groups.

4 gloo processes; each check is a collective on the mesh's groups."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from distributed_harness import run_distributed
from torch import nn


def _mesh_checks(rank: int, world: int) -> dict:
    from torch.distributed.tensor.parallel import ColwiseParallel, parallelize_module

    import edgc
    from edgc.distributed.mesh import as_process_group, init_parallel_mesh, local_tensor, pipeline_ends_group

    out = {}
    with pytest.raises(ValueError, match="must divide the world size 4"):  # before any collective
        init_parallel_mesh("cpu", tp=3)
    mesh = init_parallel_mesh("cpu", tp=2)  # dp_replicate 2 × pp 1 × dp_shard 1 × ep 1 × tp 2
    out["shape"] = tuple(mesh.shape)
    out["coordinate"] = tuple(mesh.get_coordinate())
    value = torch.tensor([float(rank)])
    dist.all_reduce(value, group=as_process_group(mesh["tp"]))
    out["tp_sum"] = value.item()
    try:
        as_process_group(mesh["dp_replicate", "tp"])
    except ValueError as error:
        out["two_d"] = str(error)

    # A column-parallel Linear: each rank's weight gradient is its DTensor's local shard; the state,
    # built on the dp_replicate dimension, averages those shards over the replicas.
    torch.manual_seed(0)
    layer = parallelize_module(nn.Linear(4, 6, bias=False), mesh["tp"], ColwiseParallel())
    layer.weight.grad = torch.zeros_like(layer.weight)
    local_tensor(layer.weight.grad).fill_(float(rank))
    state = edgc.AllReduceState(mesh["dp_replicate"], model=layer)
    state.synchronize(layer.named_parameters())
    out["shard_grad"] = local_tensor(layer.weight.grad).clone()
    out["shapes"] = state.parameter_shapes

    four_stages = init_parallel_mesh("cpu", pp=4)
    ends = pipeline_ends_group(four_stages)
    if ends is not None:
        value = torch.tensor([float(rank)])
        dist.all_reduce(value, group=ends)
        out["ends_sum"] = value.item()
    return out


def test_one_mesh_builds_every_group_and_the_library_takes_its_dimensions():
    results = run_distributed(_mesh_checks, 4)
    for rank, r in enumerate(results):
        replica, tp_rank = divmod(rank, 2)  # TP ranks consecutive, replicas outermost
        assert r["shape"] == (2, 1, 1, 1, 2) and r["coordinate"] == (replica, 0, 0, 0, tp_rank)
        assert r["tp_sum"] == {0: 1.0, 1: 5.0}[replica]
        assert "pass one dimension" in r["two_d"]
        # replicas r and r + 2 hold the same shard: its average is (r + r + 2) / 2
        assert torch.equal(r["shard_grad"], torch.full((3, 4), float(tp_rank + 1)))
        assert r["shapes"] == {"weight": (3, 4)}  # the local shard's shape, for checking loaded state
    # stage 0 and stage 3 of the one pipeline share a group; stages 1 and 2 are in none
    assert [r.get("ends_sum") for r in results] == [3.0, None, None, 3.0]


def _shard_decisions(rank: int, world: int, agree_over_stage: bool) -> dict:
    """TP 2 × DP 2 with two shards that see different gradients: TP shard 0's a fixed matrix, whose
    warm-up error test passes at its second check, TP shard 1's zeros, whose test never can."""
    import edgc
    from edgc.distributed.mesh import group_across, init_parallel_mesh

    mesh = init_parallel_mesh("cpu", tp=2)
    stage = group_across(mesh, ("dp_replicate", "tp"))  # here: all four ranks
    sizes = {"stage": dist.get_world_size(stage), "dp_tp": dist.get_world_size(group_across(mesh, ("dp_replicate",)))}
    config = edgc.EDGCConfig(
        r_max=4,
        r_min=4,
        window=2,
        total_steps=20,
        warmup_fraction=0.1,
        max_warmup_fraction=0.5,
        min_warmup_steps=2,
        warmup_error_test=True,
        adaptive=False,
    )
    state = edgc.EDGCState(mesh["dp_replicate"], config, decision_group=stage if agree_over_stage else None)
    tp_rank = mesh.get_coordinate()[4]
    weight = nn.Parameter(torch.zeros(32, 16))
    torch.manual_seed(0)
    fixed = torch.randn(32, 16)
    phases = []
    for _ in range(12):
        weight.grad = fixed.clone() if tp_rank == 0 else torch.zeros(32, 16)
        state.synchronize([("w", weight)])
        phases.append((state.last_step_metrics["phase"], state.last_step_metrics["rank"]))
    return {"tp_rank": tp_rank, "phases": phases, "sizes": sizes}


def test_a_decision_group_makes_every_tp_shard_take_the_same_phases_and_ranks():
    apart = run_distributed(_shard_decisions, 4, False)
    together = run_distributed(_shard_decisions, 4, True)
    assert together[0]["sizes"] == {"stage": 4, "dp_tp": 2}
    # each shard's DP group alone: its replicas agree, the shards do not (shard 0 compresses first)
    assert apart[0]["phases"] == apart[2]["phases"] and apart[1]["phases"] == apart[3]["phases"]
    assert apart[0]["phases"] != apart[1]["phases"]
    assert any(phase == "compress" for phase, _ in apart[0]["phases"])
    # over the stage's DP × TP group: one decision for all four ranks
    assert all(r["phases"] == together[0]["phases"] for r in together)


def test_a_mesh_takes_the_models_device_not_the_cpu():
    """FSDP2 moves a model to its mesh's device: a CUDA model on a default "cpu" mesh went to the CPU."""
    from edgc.distributed.mesh import mesh_device_type

    model = torch.nn.Linear(2, 2)
    assert mesh_device_type(model) == "cpu"
    assert mesh_device_type(torch.nn.Linear(2, 2, device="meta")) == "meta"
    assert mesh_device_type(torch.device("cuda", 1)) == mesh_device_type("cuda:0") == "cuda"
    assert mesh_device_type(torch.empty(1, device="meta")) == "meta"
    assert not dist.is_initialized() and mesh_device_type(None) == "cpu"  # no group to ask: the host
