"""GPT-2 with Hugging Face's parameter layout, in plain torch: the shapes the GPU bench and the
dispatch counter use, and a model small enough for their CPU smoke runs.

``GPT2Layout(size)`` has the parameters of ``transformers.GPT2LMHeadModel`` for the same size, with
the same names, in the same registration order, and the same autograd structure where DDP can see
it: Conv1D layers as ``addmm`` with (in, out) weights, LayerNorms, and an LM head tied to ``wte``.
So DDP forms the same buckets around both (tests/bench/test_dispatch_count.py). On the meta device
it costs nothing, even at XL's 1.5 billion parameters (`gpt2_parameters`). It has no dropout, and
its attention is plain matmul attention, so its backward is deterministic on a CPU.
"""

from __future__ import annotations

import math
import types

import torch
from torch import nn

# (layers, width, heads, vocabulary, context) of OpenAI's GPT-2 sizes, and a tiny one for smoke runs.
GPT2_SIZES = {
    "tiny": (2, 128, 4, 1024, 64),
    "small": (12, 768, 12, 50257, 1024),
    "medium": (24, 1024, 16, 50257, 1024),
    "large": (36, 1280, 20, 50257, 1024),
    "xl": (48, 1600, 25, 50257, 1024),
}


class Conv1D(nn.Module):
    """Hugging Face's Conv1D: a linear layer with an (in, out) weight, computed by ``addmm``."""

    def __init__(self, inputs: int, outputs: int):
        super().__init__()
        self.weight = nn.Parameter(torch.randn(inputs, outputs) * 0.02)
        self.bias = nn.Parameter(torch.zeros(outputs))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.addmm(self.bias, x.reshape(-1, x.shape[-1]), self.weight).view(*x.shape[:-1], -1)


class _Attention(nn.Module):
    def __init__(self, width: int, heads: int):
        super().__init__()
        self.heads = heads
        self.c_attn, self.c_proj = Conv1D(width, 3 * width), Conv1D(width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, w = x.shape
        q, k, v = self.c_attn(x).view(b, t, 3, self.heads, w // self.heads).permute(2, 0, 3, 1, 4)
        scores = (q @ k.transpose(-1, -2)) / math.sqrt(w // self.heads)
        causal = torch.ones(t, t, dtype=torch.bool, device=x.device).tril()
        mixed = scores.masked_fill(~causal, float("-inf")).softmax(-1) @ v
        return self.c_proj(mixed.transpose(1, 2).reshape(b, t, w))


class _MLP(nn.Module):
    def __init__(self, width: int):
        super().__init__()
        self.c_fc, self.c_proj = Conv1D(width, 4 * width), Conv1D(4 * width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.c_proj(nn.functional.gelu(self.c_fc(x), approximate="tanh"))


class _Block(nn.Module):
    def __init__(self, width: int, heads: int):
        super().__init__()
        self.ln_1, self.attn = nn.LayerNorm(width), _Attention(width, heads)
        self.ln_2, self.mlp = nn.LayerNorm(width), _MLP(width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class _Transformer(nn.Module):
    def __init__(self, layers: int, width: int, heads: int, vocab: int, context: int):
        super().__init__()
        self.wte, self.wpe = nn.Embedding(vocab, width), nn.Embedding(context, width)
        self.h = nn.ModuleList(_Block(width, heads) for _ in range(layers))
        self.ln_f = nn.LayerNorm(width)


class GPT2Layout(nn.Module):
    """``model(input_ids=..., labels=...)`` returns an object with ``.loss`` (next-token cross
    entropy) and ``.logits``, as Hugging Face's model does."""

    def __init__(self, size: str):
        super().__init__()
        self.transformer = _Transformer(*GPT2_SIZES[size])

    def forward(self, input_ids: torch.Tensor, labels: torch.Tensor | None = None):
        body = self.transformer
        positions = torch.arange(input_ids.shape[1], device=input_ids.device)
        x = body.wte(input_ids) + body.wpe(positions)
        for block in body.h:
            x = block(x)
        logits = nn.functional.linear(body.ln_f(x), body.wte.weight)  # the LM head, tied to wte
        loss = None
        if labels is not None:
            loss = nn.functional.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]), labels[:, 1:].reshape(-1))
        return types.SimpleNamespace(loss=loss, logits=logits)


def gpt2_parameters(size: str) -> list[tuple[str, tuple[int, ...]]]:
    """(name, shape) of GPT-2 ``size``'s parameters in registration order, built on the meta device."""
    with torch.device("meta"):
        return [(name, tuple(p.shape)) for name, p in GPT2Layout(size).named_parameters()]
