"""Tensor parallelism for the harness's GPT-2 through DTensor: torch's plan, not ours.

Each block becomes a `linear_gpt2.LinearGPT2Block` and ``parallelize_module`` shards it over the
TP mesh dimension with torch's ``ColwiseParallel`` (q, k, v and the MLP's fc: this rank's H/T heads
and 4E/T columns) and ``RowwiseParallel`` (the attention and MLP output projections, whose partial
sums torch all-reduces forward; the gradient of their replicated input is all-reduced backward).
The parameters become DTensors: sharded weights (``Shard``), row-parallel biases (``Replicate``).
LayerNorms, embeddings and the LM head stay plain tensors, replicated: every TP rank computes them
on the same inputs and gets the same gradient, so they stay identical as long as their sync is
deterministic (`stage_sync.StageCompressor` averages them raw).

EDGC compresses each sharded parameter's local shard over its DP group (`edgc.distributed.mesh.local_tensor`).
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor, Replicate
from torch.distributed.tensor.parallel import ColwiseParallel, PrepareModuleInput, RowwiseParallel, parallelize_module

from edgc.distributed.mesh import local_tensor

from .linear_gpt2 import LinearGPT2Block


def block_plan() -> dict:
    """The sharding plan of one `LinearGPT2Block` (Megatron's: column-parallel in, row-parallel out).

    The attention's input enters as one replicated DTensor (``PrepareModuleInput``, as torchtitan
    does), so the gradients q, k and v send back to it are summed first and all-reduced once, not
    once per projection."""
    return {
        "attn": PrepareModuleInput(
            input_layouts=(Replicate(),), desired_input_layouts=(Replicate(),), use_local_output=False
        ),
        "attn.q": ColwiseParallel(),
        "attn.k": ColwiseParallel(),
        "attn.v": ColwiseParallel(),
        "attn.proj": RowwiseParallel(),
        "mlp.fc": ColwiseParallel(),
        "mlp.proj": RowwiseParallel(),
    }


def parallelize_block(block, tp_mesh) -> LinearGPT2Block:
    """HF ``GPT2Block`` → `LinearGPT2Block` sharded over the 1-D ``tp_mesh``."""
    heads, tp = block.attn.num_heads, tp_mesh.size()
    hidden = block.mlp.c_fc.weight.shape[1]
    if heads % tp or hidden % tp:
        raise ValueError(f"tp: {heads} heads and {hidden} MLP columns must divide by tp = {tp}")
    return parallelize_module(LinearGPT2Block(block), tp_mesh, block_plan())


def is_sharded(parameter: torch.Tensor) -> bool:
    """A DTensor split over the TP ranks (each holds a different part); replicated otherwise."""
    return isinstance(parameter, DTensor) and any(p.is_shard() for p in parameter.placements)


def tp_squared_norm(parameters, group, skip=None) -> torch.Tensor:
    """Σ‖g‖² of this stage's gradients over its TP group: shards summed over the group, replicated
    parameters counted once (float64, shape (1,)). One all-reduce for all shards together, where
    DTensor's own norm would issue one per parameter."""
    grads = [(local_tensor(p.grad), is_sharded(p)) for p in parameters if p.grad is not None and p is not skip]
    zero = torch.zeros((), dtype=torch.float64)
    sharded = sum((g.detach().double().square().sum().cpu() for g, s in grads if s), zero).reshape(1)
    replicated = sum((g.detach().double().square().sum().cpu() for g, s in grads if not s), zero).reshape(1)
    if group is not None:
        dist.all_reduce(sharded, group=group)
    return sharded + replicated
