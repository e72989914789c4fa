"""The EDGC hook under DDP options people combine it with (2 gloo processes, one start-up).

Cases: ``no_sync`` gradient accumulation (2 micro-batches per step), ``static_graph=True``,
``find_unused_parameters=True`` with a branch that each rank uses on different steps, and
``bucket_cap_mb`` 1 (many buckets) and 500 (one bucket). Each must reach the compress phase,
count one hook step per optimizer step, send fewer bytes than raw, and keep the replicas
bit-identical.
"""

import pytest
import torch
from models import TinyTransformer, batch, flat_parameters, loss_fn
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

from edgc import EDGCConfig
from edgc.integrations import register_edgc

STEPS = 8
CONFIG = dict(r_max=4, window=3, total_steps=STEPS, warmup_error_test=False, iteration_sample_ratio=1.0)
CASES = {
    "no_sync": {},
    "static_graph": {"static_graph": True},
    "find_unused_parameters": {"find_unused_parameters": True},
    "bucket_cap_mb=1": {"bucket_cap_mb": 1},
    "bucket_cap_mb=500": {"bucket_cap_mb": 500},
}


class WithBranch(TinyTransformer):
    """TinyTransformer plus a 128×128 side branch, skipped when ``use_branch`` is False."""

    def __init__(self):
        super().__init__()
        self.branch = nn.Linear(128, 128)

    def forward(self, tokens, use_branch=True):
        hidden = self.embed(tokens) + self.position[: tokens.shape[1]]
        if use_branch:
            hidden = hidden + self.branch(hidden)
        return self.head(self.blocks(hidden))


def run_case(rank, name, ddp_kwargs):
    torch.manual_seed(0)
    model = WithBranch()
    ddp = DDP(model, **ddp_kwargs)
    state = register_edgc(ddp, EDGCConfig(**CONFIG))
    optimizer = torch.optim.AdamW(ddp.parameters(), lr=3e-3)
    calls, phases = 0, []
    for step in range(STEPS):
        optimizer.zero_grad()
        if name == "no_sync":
            with ddp.no_sync():
                loss_fn(ddp, *batch(rank, 2 * step)).backward()
            loss_fn(ddp, *batch(rank, 2 * step + 1)).backward()
        elif name == "find_unused_parameters":
            tokens, targets = batch(rank, step)
            logits = ddp(tokens, use_branch=(step + rank) % 3 == 0)  # ranks differ on some steps
            nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1)).backward()
        else:
            loss_fn(ddp, *batch(rank, step)).backward()
        optimizer.step()
        calls += 1
        phases.append(state.last_step_metrics["phase"])
    return {
        "params": flat_parameters(model),
        "step": state.step,
        "calls": calls,
        "phases": phases,
        "sent": state.last_step_metrics["bytes_sent"],
        "raw": state.last_step_metrics["bytes_raw"],
    }


def worker(rank, world_size):
    from .test_register import registration_checks  # in the same start-up: it costs seconds

    return {
        "cases": {name: run_case(rank, name, kwargs) for name, kwargs in CASES.items()},
        "registration": registration_checks(rank),
    }


@pytest.mark.parametrize("case", list(CASES))
def test_hook_composes_with_ddp_option(two_process_results, case):
    first, second = (r["cases"][case] for r in two_process_results)
    assert first["step"] == first["calls"] == STEPS  # one hook step per optimizer step
    assert first["phases"][-1] == "compress" and first["phases"] == second["phases"]
    assert first["sent"] < first["raw"] / 2
    assert torch.equal(first["params"], second["params"])
