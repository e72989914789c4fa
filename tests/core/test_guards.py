"""No silent wrong result (`edgc.safeguards.guards`, `edgc.safeguards.fingerprint`), on 2 gloo processes (one start-up).

A state built before ``init_process_group`` binds the group at its first step (the replicas end
bit-identical); every misuse ends in one line on both ranks, the same on each: a group that does not
match DDP's, a ``model=`` that is not DDP's module, one state on two DDP models, ``synchronize()``
before ``backward()`` or twice on one backward's gradients; and replicas whose shared state differs
(one rank's Q perturbed) raise at the window's end, naming the field.
"""

import pytest
import torch
import torch.distributed as dist
from distributed_harness import join, run_distributed
from models import flat_parameters
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

from edgc import EDGCConfig, EDGCState, edgc_hook
from edgc.safeguards.fingerprint import ReplicasDiverged

STATIC = dict(min_warmup_steps=2, window=3)  # compressing from step 2, a window's end every 3 steps


def mlp() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(16, 32), nn.GELU(), nn.Linear(32, 4))


def train(model: nn.Module, rank: int, steps: int, first: int = 0) -> None:
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    for step in range(first, first + steps):
        x = torch.randn(8, 16, generator=torch.Generator().manual_seed(100 * step + rank))
        optimizer.zero_grad()
        model(x).square().mean().backward()
        optimizer.step()


def refusal(call) -> str:
    """The one line a misuse ends in (the exception's message as raised inside DDP's hook)."""
    try:
        call()
    except RuntimeError as error:
        return str(error)
    return ""


def late_group(rank: int, world_size: int) -> dict:
    """The issue's script: the state first, then the process group, DDP and register_comm_hook."""
    dist.destroy_process_group()  # the harness's group: this state is built with none
    state = EDGCState(process_group=None, config=EDGCConfig.static(4, **STATIC))
    join(rank, world_size)  # init_process_group, on the harness's store
    model = DDP(mlp())
    model.register_comm_hook(state, edgc_hook)
    train(model, rank, 6)
    gathered = [torch.empty_like(flat_parameters(model)) for _ in range(world_size)]
    dist.all_gather(gathered, flat_parameters(model))
    return {
        "identical": all(torch.equal(gathered[0], other) for other in gathered),
        "world_size": state.comm.world_size,
        "phase": state.last_step_metrics["phase"],
    }


def misuses(rank: int, world_size: int) -> dict:
    out = {}
    alone = dist.new_group([0]), dist.new_group([1])  # every rank takes part in creating both
    state = EDGCState(alone[rank], EDGCConfig.static(4, **STATIC), model=(model := DDP(mlp())))
    model.register_comm_hook(state, edgc_hook)
    out["group"] = refusal(lambda: train(model, rank, 1))

    state = EDGCState(None, EDGCConfig.static(4, **STATIC), model=mlp())  # not the module DDP wraps
    (model := DDP(mlp())).register_comm_hook(state, edgc_hook)
    out["model"] = refusal(lambda: train(model, rank, 1))

    state = EDGCState(None, EDGCConfig.static(4, **STATIC))
    first, second = DDP(mlp()), DDP(mlp())
    for ddp in (first, second):
        ddp.register_comm_hook(state, edgc_hook)
    train(first, rank, 1)
    out["twice"] = refusal(lambda: train(second, rank, 1))

    module = mlp()
    state = EDGCState(None, EDGCConfig.static(4, **STATIC), model=module)
    out["before_backward"] = refusal(lambda: state.synchronize(module.named_parameters()))

    # synchronize() twice on one backward's gradients: the second refuses, the average stays the mean
    module, x = mlp(), torch.randn(8, 16, generator=torch.Generator().manual_seed(rank))
    state = EDGCState(None, EDGCConfig.static(4, **STATIC), model=module)
    module(x).square().mean().backward()
    local = [p.grad.clone() for p in module.parameters()]
    state.synchronize(module.named_parameters())
    out["again"] = refusal(lambda: state.synchronize(module.named_parameters()))
    averaged = [p.grad.clone() for p in module.parameters()]
    for g in local:
        dist.all_reduce(g.div_(world_size))
    out["again_kept"] = (state.step, all(torch.equal(a, g) for a, g in zip(averaged, local)))
    module(x).square().mean().backward()  # accumulated into the gradients: a new step's
    state.synchronize(module.named_parameters())
    out["again_after_backward"] = state.step
    return out


def diverged(rank: int, world_size: int) -> dict:
    """Rank 1's Q factors moved after a window's last sync: the next step's settle compares."""
    model = DDP(mlp())
    state = EDGCState(None, EDGCConfig.static(4, **STATIC), model=model)
    model.register_comm_hook(state, edgc_hook)
    train(model, rank, 6)  # steps 0-5: compressing from step 2; step 5 ends a window, not yet settled
    if rank == 1:
        next(iter(state.compressor.q.values())).add_(1e-3)
    try:
        train(model, rank, 1, first=6)
    except ReplicasDiverged as error:
        return {"error": str(error), "q": len(state.compressor.q)}
    return {"error": "", "q": len(state.compressor.q)}


def worker(rank: int, world_size: int) -> dict:
    return {
        "late_group": late_group(rank, world_size),
        "misuses": misuses(rank, world_size),
        "diverged": diverged(rank, world_size),
    }


@pytest.fixture(scope="module")
def results():
    return run_distributed(worker, 2, fresh=True)  # fresh: it replaces the default group


def test_a_state_built_before_the_process_group_binds_it_and_the_replicas_stay_identical(results):
    for out in results:
        assert out["late_group"] == {"identical": True, "world_size": 2, "phase": "compress"}


@pytest.mark.parametrize(
    "case, words",
    [
        ("group", ("averages over global ranks", "its DDP model over [0, 1]", "process_group=ddp_model.process_group")),
        ("model", ("not in its model=",)),
        ("twice", ("one state serves one DDP model",)),
        ("before_backward", ("synchronize() found no gradient", "after loss.backward()")),
        ("again", ("synchronize() was called again", "once after each backward")),
    ],
)
def test_each_misuse_ends_in_one_line_on_every_rank(results, case, words):
    lines = [out["misuses"][case] for out in results]
    for line in lines:
        assert all(word in line for word in words), line
        assert "\n" not in line.strip(), line
    assert lines[0].replace("[0]", "[1]") == lines[1]  # the same refusal (rank 0 names its group [0])


def test_a_second_synchronize_changes_nothing_and_one_after_a_backward_counts(results):
    for out in results:
        assert out["misuses"]["again_kept"] == (1, True)  # one step; the gradients are the group mean
        assert out["misuses"]["again_after_backward"] == 2


def test_replicas_whose_q_differs_raise_at_the_window_end_naming_it_on_every_rank(results):
    errors = [out["diverged"]["error"] for out in results]
    assert results[0]["diverged"]["q"] > 0
    for error in errors:
        assert "diverged at step 5" in error and "Q checksum differs" in error, error
    assert errors[0].split("this rank")[0] == errors[1].split("this rank")[0]  # same field, same range


def test_a_state_used_without_any_process_group_warns_once():
    module = mlp()
    state = EDGCState(None, EDGCConfig.static(4, **STATIC), model=module)
    with pytest.warns(UserWarning, match="averages over this process alone") as caught:
        for _ in range(3):
            module.zero_grad()
            module(torch.randn(8, 16)).square().mean().backward()
            state.synchronize(module.named_parameters())
    assert sum("process alone" in str(warning.message) for warning in caught) == 1
