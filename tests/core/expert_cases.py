"""The EP 2 × DP 2 cases test_experts.py runs in its one 4-process call besides marked experts with synchronize:
experts found without marks, the DDP paths, torchtitan-style load balancing, a dead expert. Each returns
what its tests assert on (plain data)."""

from __future__ import annotations

import torch
from torch import nn
from torch.distributed.tensor import DTensor, Shard

from edgc import EDGCConfig, EDGCState, edgc_hook
from edgc.distributed.experts import dense_parameters, expert_parameters, ignore_experts, mark_experts


def line_of(call) -> str:
    """The one line ``call`` is refused with ('' when it is not)."""
    try:
        call()
    except (RuntimeError, ValueError) as error:
        return str(error)
    return ""


def unmarked(model_type, rank: int, mesh, ep_rank: int, config: dict, batch, steps: int) -> dict:
    """Model ``model_type``'s experts as torchtitan holds them, a DTensor sharded on dim 0 over the EP dimension
    and no mark: the experts' state syncs them as experts (names, scale, ranks) for ``steps`` steps; the dense
    state, handed every parameter, refuses; and a ``GroupedExperts`` of 2 of 4 plain experts is refused."""
    edp, out = mesh["dp_replicate"], {}
    model = model_type(ep_rank)
    model.experts.w = nn.Parameter(DTensor.from_local(model.experts.w.detach(), mesh["ep"], [Shard(0)]))
    dense, experts = (
        EDGCState(None, EDGCConfig(**config), model=model),
        EDGCState(edp, EDGCConfig(**config), model=model),
    )
    out["found"] = []
    for step in range(steps):
        model.zero_grad()
        model(batch(rank, step)).backward()
        dense.synchronize(dense_parameters(model))
        experts.synchronize(expert_parameters(model))
        grads = {name: (p.grad.to_local() if isinstance(p.grad, DTensor) else p.grad).clone() for name, p in
                 model.named_parameters()}  # fmt: skip
        out["found"].append({"grads": grads, "ranks": dict(experts.last_step_metrics["ranks"])})
    model = model_type(ep_rank)
    model.experts.w = nn.Parameter(DTensor.from_local(model.experts.w.detach(), mesh["ep"], [Shard(0)]))
    state = EDGCState(None, EDGCConfig(**config), model=model)
    model(batch(rank, 0)).backward()
    out["dense state"] = {"line": line_of(lambda: state.synchronize(model.named_parameters())), "step": state.step}

    class GroupedExperts(nn.Module):  # named as torchtitan's: found by class, 2 of its 4 experts here
        def __init__(self, w: torch.Tensor):
            super().__init__()
            self.w, self.num_experts = nn.Parameter(w), 2 * w.shape[0]

    model = model_type(ep_rank)
    model.experts = GroupedExperts(model.experts.w.detach().clone())
    state = EDGCState(edp, EDGCConfig(**config), model=model)
    model(batch(rank, 0)).backward()
    out["split unnamed"] = {"line": line_of(lambda: state.synchronize(expert_parameters(model))), "step": state.step}
    return out


def ddp_paths(model_type, rank: int, mesh, ep_rank: int, config: dict, batch) -> dict:
    """A DDP built after ``ignore_experts`` (the experts synced by their own state), and, at ep 1, a DDP whose
    buckets hold the stacked experts (found by their class): each a warm-up step and a compressed one."""
    edp, out = mesh["dp_replicate"], {"ignored": [], "in buckets": []}
    model = model_type(ep_rank)
    mark_experts(model.experts, edp, first=2 * ep_rank, ep=2, tokens=model.tokens)
    ignore_experts(model)
    ddp = nn.parallel.DistributedDataParallel(model)
    dense, experts = EDGCState(None, EDGCConfig(**config), model=ddp), EDGCState(edp, EDGCConfig(**config), model=model)
    ddp.register_comm_hook(dense, edgc_hook)
    out["wrapped"] = line_of(lambda: ignore_experts(ddp))
    for step in range(2):
        model.zero_grad()
        ddp(batch(rank, step)).backward()
        local = model.experts.w.grad.clone()
        experts.synchronize(expert_parameters(model))
        grads = {name: p.grad.clone() for name, p in model.named_parameters()}
        out["ignored"].append({"local": local, "grads": grads, "phase": dense.last_step_metrics["phase"]})

    class GroupedExperts(nn.Module):  # every expert on every rank (ep 1): found by class, synced by DDP
        def __init__(self, w: torch.Tensor):
            super().__init__()
            self.w = nn.Parameter(w)

    model = model_type(0)
    model.experts = GroupedExperts(torch.cat([model.experts.w.detach(), model_type(1).experts.w.detach()]))
    ddp = nn.parallel.DistributedDataParallel(model)
    state = EDGCState(None, EDGCConfig(**config), model=ddp)
    ddp.register_comm_hook(state, edgc_hook)
    for step in range(2):
        model.zero_grad()
        ddp(batch(rank, step)).backward()
        grads = {name: p.grad.clone() for name, p in model.named_parameters()}
        out["in buckets"].append({"grads": grads, "ranks": dict(state.last_step_metrics["ranks"] or {})})
    return out


def load_balancing(model_type, rank: int, mesh, ep_rank: int, config: dict, batch, steps: int) -> dict:
    """torchtitan's auxiliary-loss-free balancing beside a split by tokens: the model counts each step's
    routing per global expert; an optimizer pre-hook reads the counter, moves the expert bias and zeroes it.
    Returns what the hook saw, what the forward counted, and the split's weights after each window."""
    edp = mesh["dp_replicate"]

    class Counting(model_type):
        def __init__(self):
            super().__init__(ep_rank)
            self.register_buffer("tokens_per_expert", torch.zeros(2 * len(self.experts.w)))
            self.register_buffer("expert_bias", torch.zeros(2 * len(self.experts.w)))

        def forward(self, x):
            routed = self.route(len(x)) + ep_rank * len(self.experts.w)
            self.tokens_per_expert += torch.bincount(routed, minlength=len(self.tokens_per_expert)).float()
            return super().forward(x)

    model = Counting()
    mark_experts(model.experts, edp, first=ep_rank * len(model.experts.w), ep=2, tokens=model.tokens_per_expert)
    dense, experts = (
        EDGCState(None, EDGCConfig(**config), model=model),
        EDGCState(edp, EDGCConfig(**config), model=model),
    )
    optimizer = torch.optim.SGD(model.parameters(), lr=0.0)
    seen, counted, weights = [], [], []

    def balance(*_):
        counts = model.tokens_per_expert
        seen.append(counts.clone())
        model.expert_bias += 1e-3 * torch.sign(counts.mean() - counts)
        counts.zero_()

    optimizer.register_step_pre_hook(balance)
    for step in range(steps):
        optimizer.zero_grad()
        routed = model.route(len(batch(rank, step))) + ep_rank * len(model.experts.w)
        counted.append(torch.bincount(routed, minlength=len(model.tokens_per_expert)).float())
        model(batch(rank, step)).backward()
        dense.synchronize(dense_parameters(model))
        experts.synchronize(expert_parameters(model))
        optimizer.step()
        weights.append(dict(experts.controller.split.weights))
    return {"seen": seen, "counted": counted, "weights": weights, "bias": model.expert_bias.clone()}


def dead_expert(model_type, rank: int, mesh, ep_rank: int, config: dict, batch, steps: int) -> list[dict]:
    """Every token to this rank's first expert: its second gets none, step after step."""

    class OneExpert(model_type):
        def route(self, rows: int) -> torch.Tensor:
            return torch.zeros(rows, dtype=torch.long)

    model = OneExpert(ep_rank)
    mark_experts(model.experts, mesh["dp_replicate"], first=2 * ep_rank, ep=2, tokens=model.tokens)
    experts = EDGCState(mesh["dp_replicate"], EDGCConfig(**config), model=model)
    out = []
    for step in range(steps):
        model.zero_grad()
        model(batch(rank, step)).backward()
        experts.synchronize(expert_parameters(model))
        out.append({"ranks": dict(experts.last_step_metrics["ranks"] or {}), "grad": model.experts.w.grad.clone()})
    return out
