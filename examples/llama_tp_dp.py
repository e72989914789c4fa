"""A small Llama-style model, tensor parallel through DTensor × data parallel, with EDGC on the DP dimension.

    OMP_NUM_THREADS=1 torchrun --nproc_per_node 4 examples/llama_tp_dp.py     # TP 2 × DP 2

The model (RMSNorm, causal attention, SwiGLU MLP; learned positions instead of rotary) is sharded
the way torchtitan shards Llama: one `DeviceMesh` (`edgc.distributed.mesh.init_parallel_mesh`), and
``parallelize_module`` with torch's ``ColwiseParallel`` / ``RowwiseParallel`` on every projection, the
token embedding and the output layer. Each rank holds DTensor shards; EDGC (lines marked ``# EDGC``)
averages each shard's gradient over the ``dp_replicate`` dimension, compressed, and the few replicated
parameters (the norms, the positions) raw. Every rank prints ``step S loss L``, the loss averaged over
the replicas, and the same loss for the same data in one process (`single_process_losses`) matches it
to ~1e-5 while EDGC's warm-up sends gradients uncompressed (tests/integrations/test_llama_tp_dp.py).
"""

import hashlib
import os

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor import DTensor, Replicate
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

from edgc import AllReduceState, EDGCConfig, EDGCState, barrier_before_exit  # EDGC
from edgc.distributed.mesh import group_across, init_parallel_mesh, local_tensor  # EDGC

STEPS = int(os.environ.get("STEPS", 16))
TP = 2
VOCAB, DIM, HEADS, LAYERS, SEQ, BATCH = 64, 64, 4, 2, 16, 8  # BATCH: sequences per replica and step
# EDGC: short-demo settings (a real run keeps the defaults): 4 uncompressed warm-up steps, then rank ≤ 8
CONFIG = EDGCConfig(r_max=8, window=4, total_steps=STEPS, warmup_fraction=0.25, warmup_error_test=False)


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float = 1e-6):
        super().__init__()
        self.eps, self.weight = eps, nn.Parameter(torch.ones(dim))

    def forward(self, x):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * self.weight


class Attention(nn.Module):
    def __init__(self, dim: int, heads: int):
        super().__init__()
        self.head_dim = dim // heads
        self.wq, self.wk, self.wv, self.wo = (nn.Linear(dim, dim, bias=False) for _ in range(4))

    def forward(self, x):
        b, t, _ = x.shape  # -1 below: the heads this rank holds (all of them without TP)
        q, k, v = (w(x).view(b, t, -1, self.head_dim).transpose(1, 2) for w in (self.wq, self.wk, self.wv))
        return self.wo(F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(b, t, -1))


class FeedForward(nn.Module):
    def __init__(self, dim: int, hidden: int):
        super().__init__()
        self.w1, self.w3 = nn.Linear(dim, hidden, bias=False), nn.Linear(dim, hidden, bias=False)
        self.w2 = nn.Linear(hidden, dim, bias=False)

    def forward(self, x):
        return self.w2(F.silu(self.w1(x)) * self.w3(x))  # SwiGLU


class Block(nn.Module):
    def __init__(self, dim: int, heads: int):
        super().__init__()
        self.attention_norm, self.attention = RMSNorm(dim), Attention(dim, heads)
        self.ffn_norm, self.feed_forward = RMSNorm(dim), FeedForward(dim, 4 * dim)

    def forward(self, x):
        x = x + self.attention(self.attention_norm(x))
        return x + self.feed_forward(self.ffn_norm(x))


class Llama(nn.Module):
    def __init__(self):
        super().__init__()
        self.tok_embeddings, self.positions = nn.Embedding(VOCAB, DIM), nn.Embedding(SEQ, DIM)
        self.layers = nn.ModuleList(Block(DIM, HEADS) for _ in range(LAYERS))
        self.norm, self.output = RMSNorm(DIM), nn.Linear(DIM, VOCAB, bias=False)

    def forward(self, tokens):
        x = self.tok_embeddings(tokens) + self.positions(torch.arange(tokens.shape[1]))
        for layer in self.layers:
            x = layer(x)
        return self.output(self.norm(x))


def shard(model: Llama, tp_mesh) -> Llama:
    """torchtitan's Llama plan (without sequence parallelism)."""
    parallelize_module(
        model,
        tp_mesh,
        {
            "tok_embeddings": RowwiseParallel(input_layouts=Replicate()),
            "output": ColwiseParallel(output_layouts=Replicate()),
        },
    )
    for layer in model.layers:
        parallelize_module(
            layer,
            tp_mesh,
            {
                "attention.wq": ColwiseParallel(),
                "attention.wk": ColwiseParallel(),
                "attention.wv": ColwiseParallel(),
                "attention.wo": RowwiseParallel(),
                "feed_forward.w1": ColwiseParallel(),
                "feed_forward.w3": ColwiseParallel(),
                "feed_forward.w2": RowwiseParallel(),
            },
        )
    return model


def batch(step: int, replica: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Replica ``replica``'s sequences at ``step``: a noisy "next = 3·token + 1 mod VOCAB" pattern."""
    generator = torch.Generator().manual_seed(1000 * step + replica)
    tokens = torch.empty(BATCH, SEQ + 1, dtype=torch.long)
    tokens[:, 0] = torch.randint(VOCAB, (BATCH,), generator=generator)
    for i in range(SEQ):
        noise = torch.randint(VOCAB, (BATCH,), generator=generator)
        keep = torch.rand(BATCH, generator=generator) < 0.9
        tokens[:, i + 1] = torch.where(keep, (3 * tokens[:, i] + 1) % VOCAB, noise)
    return tokens[:, :-1], tokens[:, 1:]


def new_model_and_optimizer(tp_mesh=None):
    torch.manual_seed(0)  # the same full model everywhere, then sharded
    model = Llama()
    if tp_mesh is not None:
        shard(model, tp_mesh)
    return model, torch.optim.AdamW(model.parameters(), lr=3e-3)


def single_process_losses(steps: int, replicas: int) -> list[float]:
    """The same training in one process: each step on all replicas' sequences at once."""
    model, optimizer = new_model_and_optimizer()
    losses = []
    for step in range(1, steps + 1):
        x, y = (torch.cat(parts) for parts in zip(*(batch(step, d) for d in range(replicas))))
        loss = F.cross_entropy(model(x).flatten(0, 1), y.flatten())
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    return losses


def main():
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    mesh = init_parallel_mesh("cpu", tp=TP)  # (dp_replicate, pp, dp_shard, tp) = (world / TP, 1, 1, TP)
    replica, replicas = mesh["dp_replicate"].get_local_rank(), mesh["dp_replicate"].size()
    model, optimizer = new_model_and_optimizer(mesh["tp"])
    named = list(model.named_parameters())
    sharded = [(n, p) for n, p in named if isinstance(p, DTensor) and p.placements[0].is_shard()]
    replicated = [(n, p) for n, p in named if (n, p) not in sharded]
    # EDGC: each shard over its replicas; all shards take the same decisions (phase, rank)
    state = EDGCState(
        mesh["dp_replicate"], CONFIG, model=model, decision_group=group_across(mesh, ("dp_replicate", "tp"))
    )
    raw = AllReduceState(mesh["dp_replicate"], model=model)  # EDGC: norms, positions: small, raw
    for step in range(1, STEPS + 1):
        x, y = batch(step, replica)
        loss = F.cross_entropy(model(x).flatten(0, 1), y.flatten())
        optimizer.zero_grad()
        loss.backward()
        state.synchronize(sharded)  # EDGC: compressed after its warm-up
        raw.synchronize(replicated)  # EDGC
        optimizer.step()
        mean = loss.detach().reshape(1)
        dist.all_reduce(mean, group=mesh.get_group("dp_replicate"))
        m = state.last_step_metrics
        print(f"[rank {rank}] step {step} loss {mean.item() / replicas:.7f} phase {m['phase']} rank {m['rank']}")
    digest = hashlib.sha256(b"".join(local_tensor(p).detach().numpy().tobytes() for _, p in named)).hexdigest()
    print(f"[rank {rank}] parameters {digest[:16]}")  # replicas of one TP shard: identical
    m = state.last_step_metrics  # EDGC: what the last sync did (this rank's shards)
    print(
        f"[rank {rank}] edgc: step {m['step']} phase {m['phase']} rank {m['rank']} "
        f"sent {m['bytes_sent']} of {m['bytes_raw']} bytes"
    )
    barrier_before_exit()  # EDGC: not optional on gloo (see its docstring)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
