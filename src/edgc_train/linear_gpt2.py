"""GPT-2 blocks with their projections as ``nn.Linear``, loaded from HF's ``GPT2Block``.

HF's GPT-2 keeps its projections in ``Conv1D`` layout (in, out) with q, k and v fused in one
``c_attn``. DTensor's ``ColwiseParallel`` / ``RowwiseParallel`` (and every other sharding plan written
for Llama-style models) expect ``nn.Linear`` (out, in) with separate q, k and v, so `LinearGPT2Block`
holds them that way: weights transposed, ``c_attn`` split into ``attn.q``, ``attn.k``, ``attn.v``.
The arithmetic is the HF block's (pre-LayerNorm, causal attention, GELU MLP, residuals).

The attention reads its number of heads from the width of q, so the same forward runs on a block
whose q, k, v are column-sharded over T ranks (H/T heads each, see `tensor_parallel`).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


def _linear_from_conv1d(conv, rows: slice = slice(None)) -> nn.Linear:
    """``nn.Linear`` with HF ``Conv1D`` ``conv``'s weight transposed (optionally its output columns ``rows``)."""
    weight, bias = conv.weight.detach()[:, rows].t(), conv.bias.detach()[rows]
    linear = nn.utils.skip_init(nn.Linear, weight.shape[1], weight.shape[0], device=weight.device, dtype=weight.dtype)
    with torch.no_grad():
        linear.weight.copy_(weight)
        linear.bias.copy_(bias)
    return linear


class LinearAttention(nn.Module):
    def __init__(self, attn):
        super().__init__()
        embed = attn.embed_dim
        self.head_dim, self.scaling, self.dropout = attn.head_dim, attn.scaling, attn.attn_dropout.p
        self.q, self.k, self.v = (_linear_from_conv1d(attn.c_attn, slice(i * embed, (i + 1) * embed)) for i in range(3))
        self.proj = _linear_from_conv1d(attn.c_proj)
        self.resid_dropout = nn.Dropout(attn.resid_dropout.p)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch, length, _ = x.shape
        q, k, v = (p(x).view(batch, length, -1, self.head_dim).transpose(1, 2) for p in (self.q, self.k, self.v))
        attended = F.scaled_dot_product_attention(
            q, k, v, dropout_p=self.dropout if self.training else 0.0, is_causal=True, scale=self.scaling
        )
        return self.resid_dropout(self.proj(attended.transpose(1, 2).reshape(batch, length, -1)))


class LinearMLP(nn.Module):
    def __init__(self, mlp):
        super().__init__()
        self.fc, self.proj = _linear_from_conv1d(mlp.c_fc), _linear_from_conv1d(mlp.c_proj)
        self.act, self.dropout = mlp.act, nn.Dropout(mlp.dropout.p)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.dropout(self.proj(self.act(self.fc(x))))


class LinearGPT2Block(nn.Module):
    """One HF ``GPT2Block`` with ``nn.Linear`` projections (see the module docstring)."""

    def __init__(self, block):
        super().__init__()
        self.ln_1, self.ln_2 = block.ln_1, block.ln_2
        self.attn, self.mlp = LinearAttention(block.attn), LinearMLP(block.mlp)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))
