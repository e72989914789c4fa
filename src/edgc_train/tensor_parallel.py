"""Megatron-style tensor parallelism for the harness's GPT-2 blocks (hand-written, any backend).

A `TPBlock` is one HF ``GPT2Block`` cut over the T ranks of a tensor-parallel group:

    x ─ ln_1 ─ f ─ c_attn (column-parallel: this rank's H/T heads of q, k and v)
               ─ causal attention over those heads ─ c_proj (row-parallel) ─ g ─ + bias ─ + x
      ─ ln_2 ─ f ─ c_fc (column-parallel, 4E/T columns) ─ GELU ─ c_proj (row-parallel) ─ g ─ + bias ─ + x

f is the identity forward and an all-reduce of the gradient backward; g is an all-reduce forward
and the identity backward (Megatron's ``copy_to`` / ``reduce_from`` regions). LayerNorms, the
row-parallel biases, embeddings and the LM head are replicated: every TP rank computes them on the
same inputs and, thanks to f, receives the same gradient for them, so they stay identical as long
as their sync is deterministic (`replicated_parameters` names them for the DP sync and clipping).

Weights keep HF's Conv1D layout (in, out), so a shard is a slice of the full weight and
`shard_of` maps every local parameter back to its place in the full model (checkpoints store
local shards; the equivalence test compares losses, not weights).
"""
from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn


class _CopyToTP(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        grad = grad.contiguous()
        dist.all_reduce(grad, group=ctx.group)
        return grad, None


class _ReduceFromTP(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        x = x.contiguous()
        dist.all_reduce(x, group=group)
        return x

    @staticmethod
    def backward(ctx, grad):
        return grad, None


def _shard_parameter(tensor: torch.Tensor, index) -> nn.Parameter:
    parameter = nn.Parameter(tensor.detach()[index].clone())
    parameter.tp_sharded = True  # type: ignore[attr-defined]
    return parameter


class TPBlock(nn.Module):
    """Rank ``tp_rank`` of ``tp`` of one GPT-2 block (see the module docstring)."""

    def __init__(self, block, tp_rank: int, tp: int, group):
        super().__init__()
        attn, mlp = block.attn, block.mlp
        embed, heads = attn.embed_dim, attn.num_heads
        if heads % tp or (mlp.c_fc.weight.shape[1]) % tp:
            raise ValueError(f"tp: {heads} heads and {mlp.c_fc.weight.shape[1]} MLP columns must divide by tp = {tp}")
        self.group, self.tp = group, tp
        self.heads, self.head_dim = heads // tp, attn.head_dim
        self.scaling = attn.scaling
        width = embed // tp
        columns = torch.cat([torch.arange(j * embed + tp_rank * width, j * embed + (tp_rank + 1) * width)
                             for j in range(3)])
        self.ln_1, self.ln_2 = block.ln_1, block.ln_2
        self.qkv_weight = _shard_parameter(attn.c_attn.weight, (slice(None), columns))
        self.qkv_bias = _shard_parameter(attn.c_attn.bias, columns)
        rows = slice(tp_rank * width, (tp_rank + 1) * width)
        self.attn_proj_weight = _shard_parameter(attn.c_proj.weight, rows)
        self.attn_proj_bias = nn.Parameter(attn.c_proj.bias.detach().clone())
        hidden = mlp.c_fc.weight.shape[1] // tp
        mlp_slice = slice(tp_rank * hidden, (tp_rank + 1) * hidden)
        self.fc_weight = _shard_parameter(mlp.c_fc.weight, (slice(None), mlp_slice))
        self.fc_bias = _shard_parameter(mlp.c_fc.bias, mlp_slice)
        self.mlp_proj_weight = _shard_parameter(mlp.c_proj.weight, mlp_slice)
        self.mlp_proj_bias = nn.Parameter(mlp.c_proj.bias.detach().clone())
        self.act = mlp.act
        self.attn_dropout, self.resid_dropout = attn.attn_dropout.p, attn.resid_dropout.p

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch, length, _ = x.shape
        h = _CopyToTP.apply(self.ln_1(x), self.group)
        qkv = torch.addmm(self.qkv_bias, h.reshape(-1, h.shape[-1]), self.qkv_weight)
        q, k, v = (t.reshape(batch, length, self.heads, self.head_dim).transpose(1, 2)
                   for t in qkv.reshape(batch, length, -1).split(self.heads * self.head_dim, dim=-1))
        scores = torch.matmul(q, k.transpose(-1, -2)) * self.scaling
        mask = torch.ones(length, length, dtype=torch.bool, device=x.device).tril()
        scores = scores.masked_fill(~mask, torch.finfo(scores.dtype).min)
        weights = F.dropout(F.softmax(scores, dim=-1), self.attn_dropout, self.training)
        attended = torch.matmul(weights, v).transpose(1, 2).reshape(batch * length, -1)
        out = _ReduceFromTP.apply(attended @ self.attn_proj_weight, self.group) + self.attn_proj_bias
        x = x + F.dropout(out.reshape(batch, length, -1), self.resid_dropout, self.training)
        h = _CopyToTP.apply(self.ln_2(x), self.group)
        h = self.act(torch.addmm(self.fc_bias, h.reshape(-1, h.shape[-1]), self.fc_weight))
        out = _ReduceFromTP.apply(h @ self.mlp_proj_weight, self.group) + self.mlp_proj_bias
        return x + F.dropout(out.reshape(batch, length, -1), self.resid_dropout, self.training)


def is_sharded(parameter: torch.Tensor) -> bool:
    return bool(getattr(parameter, "tp_sharded", False))


def tp_squared_norm(parameters, group, skip=None) -> torch.Tensor:
    """Σ‖g‖² of this stage's gradients over its TP group: shards summed over the group, replicated
    parameters counted once (float64, shape (1,))."""
    grads = [(p.grad, is_sharded(p)) for p in parameters if p.grad is not None and p is not skip]
    zero = torch.zeros((), dtype=torch.float64)
    sharded = sum((g.detach().double().square().sum().cpu() for g, s in grads if s), zero).reshape(1)
    replicated = sum((g.detach().double().square().sum().cpu() for g, s in grads if not s), zero).reshape(1)
    if group is not None:
        dist.all_reduce(sharded, group=group)
    return sharded + replicated
