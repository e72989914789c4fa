"""`register_edgc` and the hook's registration on a plain DDP model.

The 2-process checks run inside test_composability's processes (one start-up for both files).
"""

import pytest
import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

from edgc import EDGCConfig, EDGCState, edgc_hook
from edgc.integrations import register_edgc


def registration_checks(rank):
    out = {}
    # edgc_hook itself passes DDP's annotation check (it once failed: string annotations).
    ddp = DDP(nn.Linear(32, 32))
    state = EDGCState(None, EDGCConfig.static(4), model=ddp)
    ddp.register_comm_hook(state, edgc_hook)
    ddp(torch.randn(4, 32)).sum().backward()
    out["direct_steps"] = state.step
    # register_edgc builds the state from a config, with the model's names.
    torch.manual_seed(0)
    ddp = DDP(nn.Linear(32, 32))
    state = register_edgc(ddp, EDGCConfig.static(4, min_warmup_steps=1))
    for _ in range(3):
        ddp(torch.randn(4, 32)).sum().backward()
    out["names"] = sorted(state.last_step_metrics["ranks"])
    out["phase"] = state.last_step_metrics["phase"]
    out["weight"] = ddp.module.weight.grad.clone()
    stale = EDGCState(None, EDGCConfig())
    stale.comm.world_size = 1  # as if built before init_process_group
    cases = (
        (lambda: register_edgc(nn.Linear(2, 2)), TypeError),  # not DDP
        (lambda: register_edgc(DDP(nn.Linear(2, 2)), EDGCConfig(), state=stale), ValueError),
        (lambda: register_edgc(DDP(nn.Linear(2, 2)), state=stale), RuntimeError),
    )
    out["errors"] = []
    for call, error in cases:
        with pytest.raises(error) as caught:
            call()
        out["errors"].append(str(caught.value))
    return out


def test_hook_registers_directly_and_through_register_edgc(two_process_results):
    results = [r["registration"] for r in two_process_results]
    for out in results:
        assert out["direct_steps"] == 1
        assert out["names"] == ["bias", "weight"] and out["phase"] == "compress"
        assert "DistributedDataParallel" in out["errors"][0] and "world of 1 process" in out["errors"][2]
    assert torch.equal(results[0]["weight"], results[1]["weight"])


def test_without_a_process_group_it_warns_and_registers_nothing():
    with pytest.warns(UserWarning, match="no hook registered"):
        assert register_edgc(nn.Linear(2, 2), EDGCConfig()) is None
