"""The mixture-of-experts GPT of `edgc train --moe-experts E`: GPT-2 whose every block's MLP is a routed
MoE layer, its experts stored as torchtitan stores them, split over the ``ep`` ranks of the mesh.

A layer (`MoEFeedForward`): a router (a linear map to E logits, softmax in float32, each token to its
top-k experts, their probabilities as the weights of their outputs), a load-balancing loss (Switch
Transformer's: E·Σₑ fₑ·Pₑ, fₑ the share of the tokens' k choices that went to e, Pₑ the mean router
probability of e; its weight is ``--moe-aux-weight``), and the experts (`GroupedExperts`): one
``[E_local, hidden, d]`` parameter per projection (w1, w3; w2 is ``[E_local, d, hidden]``), a SwiGLU
feed-forward each, ``hidden`` = 2·d. Every rank initialises all E experts from the same seed and keeps
its ``E_local = E / ep`` (ranks ``ep_rank·E_local`` …), so a run is the same model at any ``ep``.

Expert parallelism: each rank sorts its tokens' k copies by expert, tells every rank of its EP group
how many go to each of that rank's experts (``all_to_all_single`` of the counts), and sends them
(``all_to_all_single_autograd`` of torch's functional collectives, whose backward is the reverse
all-to-all, on gloo as on NCCL); a rank runs its experts on what it received, grouped by expert, and sends the results
back the same way. The split sizes are read on the host, as every all-to-all dispatch does. The tokens
each local expert processed are added to the layer's ``tokens`` counter (training forwards only), which
the runner resets at each step and the experts' state reads, never writes, for a rank split by tokens
(`edgc.distributed.expert_tokens`).
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

HIDDEN_PER_WIDTH = 2  # an expert's hidden width over the model's


class GroupedExperts(nn.Module):
    """``count`` SwiGLU experts of width ``dim`` and hidden width ``hidden``, each projection one 3-D tensor,
    of the layer's ``num_experts`` (its experts on every expert-parallel rank: `edgc.distributed.experts` finds
    a module of this name, and refuses one that holds fewer than ``num_experts`` unless it is marked)."""

    def __init__(self, dim: int, hidden: int, count: int, num_experts: int | None = None):
        super().__init__()
        self.num_experts = count if num_experts is None else num_experts
        self.w1 = nn.Parameter(torch.empty(count, hidden, dim))
        self.w2 = nn.Parameter(torch.empty(count, dim, hidden))
        self.w3 = nn.Parameter(torch.empty(count, hidden, dim))

    def forward(self, x: torch.Tensor, counts: list[int]) -> torch.Tensor:
        """``x``: tokens grouped by local expert, ``counts[j]`` of them for expert j, in order."""
        outs = []
        for j, chunk in enumerate(torch.split(x, counts)):
            h = F.silu(chunk @ self.w1[j].T) * (chunk @ self.w3[j].T)
            outs.append(h @ self.w2[j].T)
        return torch.cat(outs) if outs else x.new_zeros(0, x.shape[-1])


def _exchange(x: torch.Tensor, send: list[int], receive: list[int], group) -> torch.Tensor:
    """All-to-all of ``x``'s rows, ``send[r]`` to rank r, ``receive[r]`` from it (autograd: the reverse)."""
    from torch.distributed import _functional_collectives as collectives

    out = collectives.all_to_all_single_autograd(x.contiguous(), receive, send, group)
    return collectives.wait_tensor(out)


class MoEFeedForward(nn.Module):
    """A routed MoE feed-forward (see the module docstring); ``ep_group``: the expert-parallel group (None:
    every expert on this rank). After each forward ``aux_loss`` holds its load-balancing loss."""

    def __init__(self, dim: int, experts: int, top_k: int, ep_group=None, init_std: float = 0.02):
        super().__init__()
        ep = dist.get_world_size(ep_group) if ep_group is not None else 1
        ep_rank = dist.get_rank(ep_group) if ep_group is not None else 0
        if experts % ep:
            raise ValueError(f"moe: {experts} experts cannot be split over {ep} expert-parallel ranks")
        self.num_experts, self.top_k, self.ep_group, self.ep = experts, top_k, ep_group, ep
        self.local = experts // ep
        self.first = ep_rank * self.local
        self.router = nn.Linear(dim, experts, bias=False)
        hidden = HIDDEN_PER_WIDTH * dim
        self.experts = GroupedExperts(dim, hidden, self.local, experts)
        nn.init.normal_(self.router.weight, std=init_std)
        with torch.no_grad():  # all E experts from the same stream on every rank; this rank keeps its own
            for local in self.experts.parameters():
                full = torch.empty(experts, *local.shape[1:]).normal_(std=init_std)
                local.copy_(full[self.first : self.first + self.local])
        self.register_buffer("tokens", torch.zeros(self.local), persistent=False)
        self.routed = torch.zeros(experts, dtype=torch.long)  # this rank's tokens' choices per expert (the load)
        self.aux_loss = torch.zeros(())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        flat = x.reshape(-1, shape[-1])
        probs = F.softmax(self.router(flat).float(), dim=-1)
        weights, chosen = probs.topk(self.top_k, dim=-1)
        choices = chosen.reshape(-1)
        counts = torch.bincount(choices, minlength=self.num_experts)
        if self.training and torch.is_grad_enabled():
            self.routed = self.routed.to(counts.device) + counts.detach()
        share = counts.float() / choices.numel()
        self.aux_loss = self.num_experts * (share * probs.mean(0)).sum()
        order = torch.argsort(choices, stable=True)
        tokens = order // self.top_k
        routed = self._dispatch(flat[tokens], counts)
        scale = weights.reshape(-1)[order].unsqueeze(-1).to(routed.dtype)
        out = torch.zeros_like(flat).index_add(0, tokens, routed * scale)
        return out.view(shape)

    def _dispatch(self, sorted_tokens: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        """The experts' outputs for tokens sorted by expert (``counts`` per expert), through the EP group."""
        if self.ep == 1:
            per_expert = counts.tolist()
            self._count(per_expert)
            return self.experts(sorted_tokens, per_expert)
        by_rank = counts.view(self.ep, self.local)  # [destination rank, its local expert]
        received = torch.empty_like(by_rank)
        dist.all_to_all_single(received, by_rank.contiguous(), group=self.ep_group)  # [source rank, my expert]
        send, table = by_rank.sum(1).tolist(), received.tolist()
        receive = [sum(row) for row in table]
        arrived = _exchange(sorted_tokens, send, receive, self.ep_group)  # by source rank, then expert
        regroup, offset, starts = [], 0, []
        for row in table:
            starts.append(offset)
            offset += sum(row)
        for j in range(self.local):  # by expert, then source rank
            for source, row in enumerate(table):
                begin = starts[source] + sum(row[:j])
                regroup.append(torch.arange(begin, begin + row[j]))
        index = torch.cat(regroup).to(arrived.device) if regroup else torch.zeros(0, dtype=torch.long)
        per_expert = [sum(row[j] for row in table) for j in range(self.local)]
        self._count(per_expert)
        outputs = self.experts(arrived[index], per_expert)
        back = torch.empty_like(outputs).index_copy(0, index, outputs)  # by source rank again
        return _exchange(back, receive, send, self.ep_group)

    def _count(self, per_expert: list[int]) -> None:
        if self.training and torch.is_grad_enabled():
            self.tokens += torch.tensor(per_expert, dtype=self.tokens.dtype, device=self.tokens.device)


def make_moe(model: nn.Module, experts: int, top_k: int, ep_group=None) -> list[MoEFeedForward]:
    """Replace every block's MLP of a GPT-2 ``model`` by a `MoEFeedForward` (same seed on every rank)."""
    dim = model.config.n_embd
    layers = []
    for block in model.transformer.h:
        block.mlp = MoEFeedForward(dim, experts, top_k, ep_group)
        layers.append(block.mlp)
    return layers
