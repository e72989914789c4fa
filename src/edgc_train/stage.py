"""One pipeline stage of the harness's GPT-2: its blocks, embeddings and head, and the loss."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from .tensor_parallel import parallelize_block


def layer_split(n_layer: int, stages: int) -> list[range]:
    """Contiguous blocks per stage, as even as possible (earlier stages get the extra block)."""
    base, extra = divmod(n_layer, stages)
    bounds, start = [], 0
    for s in range(stages):
        size = base + (1 if s < extra else 0)
        if size < 1:
            raise ValueError(f"pp: {stages} stages need at least {stages} transformer blocks, the model has {n_layer}")
        bounds.append(range(start, start + size))
        start += size
    return bounds


class GPT2Stage(nn.Module):
    """Stage s of a ``GPT2LMHeadModel``: [embeddings] → blocks → [final LayerNorm, LM head]."""

    def __init__(self, model, stage: int, stages: int, tp_mesh=None):
        super().__init__()
        transformer = model.transformer
        self.first, self.last = stage == 0, stage == stages - 1
        if self.first:
            self.wte, self.wpe, self.drop = transformer.wte, transformer.wpe, transformer.drop
        blocks = [transformer.h[i] for i in layer_split(len(transformer.h), stages)[stage]]
        if tp_mesh is not None:  # --tp: DTensor-sharded nn.Linear blocks (tensor_parallel.py)
            blocks = [parallelize_block(block, tp_mesh) for block in blocks]
        self.h = nn.ModuleList(blocks)
        if self.last and self.first:  # one stage (--tp without --pp): the weight stays tied
            self.ln_f = transformer.ln_f
            self.lm_head = model.lm_head
        elif self.last:
            self.ln_f = transformer.ln_f
            # The LM head shares its weight with wte in the full model; on its own stage it is a
            # separate copy kept equal by summing both gradients (see module docstring, step 3).
            self.lm_head = torch.nn.utils.skip_init(
                nn.Linear, model.lm_head.in_features, model.lm_head.out_features, bias=False
            )
            with torch.no_grad():
                self.lm_head.weight.copy_(model.lm_head.weight)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.first:
            positions = torch.arange(x.shape[1], device=x.device)
            x = self.drop(self.wte(x) + self.wpe(positions))
        for block in self.h:
            x = block(x)
        if self.last:
            x = self.lm_head(self.ln_f(x))
        return x

    def tied_weight(self) -> torch.Tensor | None:
        if self.first and self.last:
            return None  # tied in place
        if self.first:
            return self.wte.weight
        if self.last:
            return self.lm_head.weight
        return None


def module_width(module: GPT2Stage) -> int:
    """The hidden size of the activations between stages."""
    return module.h[0].ln_1.normalized_shape[0]


def next_token_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten())
