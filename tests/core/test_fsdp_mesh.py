"""`register_fsdp_comm_hook` averages one mesh's shards over the group that goes with it (`edgc.parallel.fsdp`),
on 2 gloo processes (one start-up): a module sharded on another mesh than the rest (experts on an
expert-data-parallel mesh) and a state whose group holds the other shards (built on the default
group beside a model sharded over both ranks) are each refused in the same one line on both ranks,
before any hook is set; the layout that goes together (shards of size 1 on ``dp_shard``, the state on
``dp_replicate``) trains, its gradients the exact group mean.
"""

import pytest
import torch
from distributed_harness import run_distributed
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard

from edgc import EDGCConfig, EDGCState
from edgc.parallel.fsdp import register_fsdp_comm_hook

WARMUP = EDGCConfig.static(2, min_warmup_steps=10)


class Mixture(nn.Module):
    def __init__(self):
        super().__init__()
        self.dense = nn.Linear(8, 8)
        self.experts = nn.Linear(8, 8)
        self.head = nn.Linear(8, 4)

    def forward(self, x):
        return self.head(self.dense(x) + self.experts(x))


def inputs(rank: int) -> torch.Tensor:
    return torch.randn(4, 8, generator=torch.Generator().manual_seed(rank))


def hooked(model: nn.Module) -> bool:
    return any(
        group._all_reduce_hook is not None
        for module in model.modules()
        if hasattr(module, "_get_fsdp_state")
        for group in module._get_fsdp_state()._fsdp_param_groups
    )


def refusal(model: nn.Module, state) -> dict:
    try:
        register_fsdp_comm_hook(model, state)
        line = ""
    except ValueError as error:
        line = str(error)
    return {"line": line, "hooked": hooked(model)}


def worker(rank: int, world_size: int) -> dict:
    both = init_device_mesh("cpu", (2,), mesh_dim_names=("dp_shard",))
    hsdp = init_device_mesh("cpu", (2, 1), mesh_dim_names=("dp_replicate", "dp_shard"))
    experts_mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("edp_shard",))
    out = {}

    torch.manual_seed(0)
    model = Mixture()
    fully_shard(model, mesh=both)  # sharded over both ranks, averaged over both again
    out["overlapping group"] = refusal(model, EDGCState(None, WARMUP))

    torch.manual_seed(0)
    model = Mixture()
    fully_shard(model.experts, mesh=experts_mesh)
    fully_shard(model, mesh=hsdp["dp_shard"])
    out["another mesh"] = refusal(model, EDGCState(hsdp["dp_replicate"], WARMUP))

    torch.manual_seed(0)
    model = Mixture()
    fully_shard(model.experts, mesh=hsdp["dp_shard"])
    fully_shard(model, mesh=hsdp["dp_shard"])
    state = EDGCState(hsdp["dp_replicate"], WARMUP)
    register_fsdp_comm_hook(model, state)
    model(inputs(rank)).square().mean().backward()
    out["grads"] = {name: p.grad.to_local().clone() for name, p in model.named_parameters()}
    out["phase"] = state.last_step_metrics["phase"]
    expected = {}
    for other in range(world_size):  # the plain model's gradients of both ranks' data
        torch.manual_seed(0)
        plain = Mixture()
        plain(inputs(other)).square().mean().backward()
        for name, p in plain.named_parameters():
            expected[name] = expected.get(name, 0) + p.grad / world_size
    out["mean"] = expected
    return out


@pytest.fixture(scope="module")
def results():
    return run_distributed(worker, 2)


@pytest.mark.parametrize(
    "case, words",
    [
        (
            "overlapping group",
            ("state's group (size 2) holds other shards of the model's", "mesh ('dp_shard',) of size 2"),
        ),
        ("another mesh", ("module 'experts' is sharded on mesh ('edp_shard',) of size 2", "needs a state of its own")),
    ],
)
def test_a_module_the_state_cannot_average_is_refused_in_one_line_before_any_hook(results, case, words):
    lines = [out[case]["line"] for out in results]
    assert lines[0] == lines[1] and "\n" not in lines[0], lines
    assert all(word in lines[0] for word in words), lines[0]
    assert not any(out[case]["hooked"] for out in results)


def test_the_mesh_that_goes_with_the_state_trains_to_the_exact_group_mean(results):
    for out in results:
        assert out["phase"] == "warmup"
        for name, grad in out["grads"].items():
            assert torch.equal(grad, out["mean"][name]), name
