"""Every kind of gradient DDP or a plain loop hands EDGC is averaged to the exact group mean
(`edgc.runner.gradients`), on 2 gloo processes (one start-up): dense ones of every float dtype, a
channels-last convolution's and a transposed one (another layout), and a sparse embedding's, which
DDP hands the hook as a bucket of its own. Judged against the mean of both ranks' local gradients,
recomputed on each rank: bit for bit while uncompressed (dividing by two and adding two values is
exact in any order), and the sparse gradient also while the dense ones are compressed.
"""

import types

import pytest
import torch
from distributed_harness import run_distributed
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

from edgc import EDGCConfig, EDGCState, LowRankConfig, edgc_hook
from edgc.runner.gradients import HandedGradients

DTYPES = {"float32": torch.float32, "float64": torch.float64, "bfloat16": torch.bfloat16, "float16": torch.float16}
KINDS = (*DTYPES, "channels last", "transposed", "sparse")
PATHS = ("ddp", "synchronize")


class Bag(nn.Module):
    """A sparse embedding under a dense head: the embedding's gradient is sparse COO."""

    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(12, 8, sparse=True)
        self.head = nn.Linear(8, 8)

    def forward(self, tokens):
        return self.head(self.embed(tokens).sum(1))


def model(kind: str) -> nn.Module:
    torch.manual_seed(0)
    if kind == "sparse":
        return Bag()
    if kind == "channels last":
        net = nn.Sequential(nn.Conv2d(3, 8, 3), nn.Flatten(), nn.Linear(128, 8))
        return net.to(memory_format=torch.channels_last)
    return nn.Sequential(nn.Linear(8, 16), nn.GELU(), nn.Linear(16, 8)).to(DTYPES.get(kind, torch.float32))


def inputs(kind: str, rank: int, step: int) -> torch.Tensor:
    generator = torch.Generator().manual_seed(100 * step + rank)
    if kind == "sparse":  # rows both ranks touch, and rows only one does
        return torch.randint(0, 12, (4, 3), generator=generator)
    if kind == "channels last":
        return torch.randn(4, 3, 6, 6, generator=generator).to(memory_format=torch.channels_last)
    return torch.randn(4, 8, generator=generator).to(DTYPES.get(kind, torch.float32))


def backward(net: nn.Module, kind: str, rank: int, step: int) -> None:
    net(inputs(kind, rank, step)).float().square().mean().backward()
    if kind == "transposed":  # the same values, in column-major layout
        for p in net.parameters():
            if p.dim() == 2:
                p.grad = p.grad.t().contiguous().t()


def group_mean(kind: str, world_size: int, step: int) -> list[torch.Tensor]:
    """Σ_r g_r / world_size of every parameter, from both ranks' gradients recomputed here."""
    local = []
    for rank in range(world_size):
        net = model(kind)
        backward(net, kind, rank, step)
        local.append([p.grad.to_dense() for p in net.parameters()])
    return [sum(grads[i] / world_size for grads in local) for i in range(len(local[0]))]


def averaged(kind: str, path: str, rank: int, steps: int, config: EDGCConfig) -> dict:
    """The gradients of the last of ``steps`` steps after the sync, and whether they were sparse."""
    net = model(kind)
    ddp = DDP(net) if path == "ddp" else None
    state = EDGCState(None, config, model=ddp or net)
    if ddp is not None:
        ddp.register_comm_hook(state, edgc_hook)
    for step in range(steps):
        net.zero_grad(set_to_none=True)
        backward(ddp or net, kind, rank, step)
        if ddp is None:
            state.synchronize(net.named_parameters())
    grads = [p.grad for p in net.parameters()]
    return {
        "grads": [g.to_dense() for g in grads],
        "sparse": [g.is_sparse for g in grads],
        "strides": [g.stride() for g in grads],
        "phase": state.last_step_metrics["phase"],
    }


def worker(rank: int, world_size: int) -> dict:
    out = {}
    warmup = EDGCConfig.static(2, min_warmup_steps=10)
    compressing = EDGCConfig.static(2, min_warmup_steps=1, engine=LowRankConfig(min_compression_rate=0.0))
    for kind in KINDS:
        for path in PATHS:
            out[kind, path] = {**averaged(kind, path, rank, 2, warmup), "mean": group_mean(kind, world_size, 1)}
    for path in PATHS:
        out["sparse", path, "compressing"] = {
            **averaged("sparse", path, rank, 3, compressing),
            "mean": group_mean("sparse", world_size, 2),
        }
    return out


@pytest.fixture(scope="module")
def results():
    return run_distributed(worker, 2)


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("kind", KINDS)
def test_each_kind_is_the_exact_group_mean_and_keeps_its_form(results, kind, path):
    for out in results:
        got = out[kind, path]
        assert got["phase"] == "warmup"
        for grad, mean in zip(got["grads"], got["mean"]):
            assert torch.equal(grad, mean), float((grad.double() - mean.double()).abs().max())
    if kind == "sparse":  # still a sparse gradient, as DDP leaves it; the head's dense
        assert results[0][kind, path]["sparse"] == [True, False, False]
    if kind == "transposed" and path == "synchronize":  # the (16, 8) gradient keeps its column-major layout
        assert results[0][kind, path]["strides"][0] == (1, 16)


@pytest.mark.parametrize("path", PATHS)
def test_a_sparse_gradient_is_averaged_exactly_while_the_dense_ones_are_compressed(results, path):
    for out in results:
        got = out["sparse", path, "compressing"]
        assert got["phase"] == "compress"
        assert torch.equal(got["grads"][0], got["mean"][0])  # the embedding: exact
        assert not torch.equal(got["grads"][1], got["mean"][1])  # the head's matrix: rank 2 of 8
    assert torch.equal(
        results[0]["sparse", path, "compressing"]["grads"][1], results[1]["sparse", path, "compressing"]["grads"][1]
    )


@pytest.mark.filterwarnings("ignore:Sparse CSR tensor support is in beta")
def test_a_sparse_layout_without_an_all_reduce_is_refused_in_one_line():
    """Only sparse COO has an all-reduce (a CSR gradient: a CSR parameter's, here a stand-in)."""
    parameter = types.SimpleNamespace(requires_grad=True, grad=torch.eye(4).to_sparse_csr())
    with pytest.raises(ValueError, match=r"w is sparse in layout torch.sparse_csr.*to_sparse_coo") as caught:
        HandedGradients("EDGCState", ["w"], [parameter])
    assert "\n" not in str(caught.value)


def test_reduce_tensors_refuses_a_tensor_it_cannot_average_in_place():
    state = EDGCState(None, EDGCConfig.static(2))
    for tensor, kind in ((torch.zeros(4, 6).t(), "not contiguous"), (torch.zeros(4, 6).to_sparse(), "sparse")):
        with pytest.raises(ValueError, match=f"w is {kind}") as caught:
            state.reduce_tensors(["w"], [tensor], last=True)
        assert "\n" not in str(caught.value) and state.step == 0
