"""A checkpoint resumed under the extreme DDP bucket layouts, one bucket per parameter and one bucket
for all, ends bit-identical to the uninterrupted run (default buckets), on 2 gloo processes, under
the rule docs/concepts/engine.md states: a CPU with MKL's conditional numerical reproducibility
(``MKL_CBWR=AUTO,STRICT``, set before the processes start), two ranks. Two models: the test
transformer through rank decisions (the rank moves across the split), and three same-shape skinny
matrices (1000 × 37) at rank 2, whose products MKL computes otherwise where a matrix lies elsewhere
in the engine's buffers or shares a batch with others, without that setting.
"""

import io
import os

import pytest
import torch
from distributed_harness import run_distributed
from models import TinyTransformer, batch, flat_parameters, loss_fn
from test_ddp import ADAPTIVE
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

from edgc import EDGCConfig, EDGCState, LowRankConfig, edgc_hook

ONE_PER_PARAMETER, ONE_FOR_ALL = 1e-6, 1000.0  # bucket_cap_mb
SKINNY = dict(
    r_max=2,
    r_min=2,
    adaptive=False,
    warmup_error_test=False,
    min_warmup_steps=2,
    engine=LowRankConfig(min_compression_rate=1.0),
)


class Skinny(nn.Module):
    """Three (1000 × 37) weight matrices: one shape group of three in a bucket that holds them all."""

    def __init__(self):
        super().__init__()
        self.branches = nn.ModuleList([nn.Linear(37, 1000) for _ in range(3)])
        self.out = nn.Linear(1000, 4)

    def forward(self, x):
        return self.out(sum(torch.tanh(branch(x)) for branch in self.branches))


def skinny_loss(model, rank, step):
    x = torch.randn(16, 37, generator=torch.Generator().manual_seed(100 * step + rank))
    return model(x).square().mean()


def transformer_loss(model, rank, step):
    return loss_fn(model, *batch(rank, step))


MODELS = {
    "transformer": (TinyTransformer, transformer_loss, ADAPTIVE, 7, 13),
    "skinny": (Skinny, skinny_loss, SKINNY, 5, 10),
}


def build(kind, bucket_cap_mb, seed=0):
    module_class, _, config, _, total = MODELS[kind]
    torch.manual_seed(seed)
    module = module_class()
    ddp = DDP(module, **({} if bucket_cap_mb is None else {"bucket_cap_mb": bucket_cap_mb}))
    state = EDGCState(None, EDGCConfig(**{**config, "total_steps": total}), model=ddp)
    state.buckets = []  # per step, the buckets DDP handed the hook

    def counting_hook(state, bucket):
        state.buckets[-1] += 1
        return edgc_hook(state, bucket)

    ddp.register_comm_hook(state, counting_hook)
    return module, ddp, state, torch.optim.AdamW(ddp.parameters(), lr=3e-3)


def train(kind, rank, ddp, state, optimizer, start, stop):
    ranks = []
    for step in range(start, stop):
        state.buckets.append(0)
        optimizer.zero_grad()
        MODELS[kind][1](ddp, rank, step).backward()
        optimizer.step()
        ranks.append(state.last_step_metrics["rank"])
    return ranks


def resumed(kind, layout, saved: bytes, rank, split, total) -> dict:
    """A new model, optimizer and state under ``layout`` load ``saved`` and train from ``split`` on."""
    checkpoint = torch.load(io.BytesIO(saved), weights_only=True)
    module, ddp, state, optimizer = build(kind, layout, seed=123)
    for part, target in (("model", module), ("optimizer", optimizer), ("edgc", state)):
        target.load_state_dict(checkpoint[part])
    ranks = train(kind, rank, ddp, state, optimizer, split, total)
    return {"params": flat_parameters(module), "ranks": ranks, "buckets": state.buckets[-1]}


def worker(rank, world_size):
    out = {}
    for kind, (_, _, _, split, total) in MODELS.items():
        module, ddp, state, optimizer = build(kind, None)
        train(kind, rank, ddp, state, optimizer, 0, total)
        out[kind, "uninterrupted"] = flat_parameters(module)
        module, ddp, state, optimizer = build(kind, None)
        train(kind, rank, ddp, state, optimizer, 0, split)
        saved = io.BytesIO()
        torch.save(
            {"model": module.state_dict(), "optimizer": optimizer.state_dict(), "edgc": state.state_dict()}, saved
        )
        for layout in (ONE_PER_PARAMETER, ONE_FOR_ALL):
            out[kind, layout] = resumed(kind, layout, saved.getvalue(), rank, split, total)
    return out


@pytest.fixture(scope="module")
def results():
    before = os.environ.get("MKL_CBWR")
    os.environ["MKL_CBWR"] = "AUTO,STRICT"  # read by MKL when the new processes start
    try:
        return run_distributed(worker, 2, fresh=True)
    finally:
        if before is None:
            del os.environ["MKL_CBWR"]
        else:
            os.environ["MKL_CBWR"] = before


@pytest.mark.parametrize("layout", [ONE_PER_PARAMETER, ONE_FOR_ALL], ids=["one bucket per parameter", "one for all"])
@pytest.mark.parametrize("kind", sorted(MODELS))
def test_resume_under_either_extreme_layout_is_bit_identical(results, kind, layout):
    parameters = len(list(MODELS[kind][0]().parameters()))
    for out in results:
        resumed = out[kind, layout]
        assert resumed["buckets"] == (parameters if layout == ONE_PER_PARAMETER else 1)
        assert all(rank for rank in resumed["ranks"])  # compressed after the split
        assert torch.equal(resumed["params"], out[kind, "uninterrupted"])
    if kind == "transformer":
        assert len(set(results[0][kind, layout]["ranks"])) >= 2  # resumed across a rank change
