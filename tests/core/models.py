"""A small transformer LM for the distributed tests (~0.5M parameters: DDP makes ≥ 2 buckets)."""

import torch
from torch import nn


class TinyTransformer(nn.Module):
    def __init__(self, vocab: int = 256, width: int = 128, layers: int = 2, heads: int = 4, seq_len: int = 16):
        super().__init__()
        self.embed = nn.Embedding(vocab, width)
        self.position = nn.Parameter(torch.zeros(seq_len, width))
        layer = nn.TransformerEncoderLayer(width, heads, 4 * width, dropout=0.0, batch_first=True)
        self.blocks = nn.TransformerEncoder(layer, layers, enable_nested_tensor=False)
        self.head = nn.Linear(width, vocab)

    def forward(self, tokens):
        return self.head(self.blocks(self.embed(tokens) + self.position[: tokens.shape[1]]))


def batch(rank: int, step: int, vocab: int = 256, size: int = 4, seq_len: int = 16):
    """Different data on every rank and step, reproducible."""
    generator = torch.Generator().manual_seed(1000 * step + rank)
    tokens = torch.randint(0, vocab, (size, seq_len + 1), generator=generator)
    return tokens[:, :-1], tokens[:, 1:]


def loss_fn(model, tokens, targets):
    logits = model(tokens)
    return nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))


def flat_parameters(model) -> torch.Tensor:
    return torch.cat([p.detach().reshape(-1) for p in model.parameters()])
