"""FSDP2 as HSDP with EDGC: shard inside a host, replicate across hosts, compress between them.

    OMP_NUM_THREADS=1 torchrun --nproc_per_node 4 examples/fsdp2_hsdp.py        # 2 replicas × 2 shards

Native HSDP would be ``fully_shard(module, mesh=mesh)`` on the 2-D mesh. With EDGC, shard on the
mesh's "dp_shard" dimension only and let EDGC do the replica all-reduce (the lines marked ``# EDGC``).
"""

import os

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.fsdp import fully_shard

from edgc import EDGCConfig, EDGCState, barrier_before_exit  # EDGC
from edgc.parallel.fsdp import hsdp_mesh, register_fsdp_comm_hook  # EDGC

STEPS = int(os.environ.get("STEPS", 12))
SHARD = int(os.environ.get("SHARD", 2))  # ranks per host; replicas = world / SHARD


class Block(nn.Module):
    def __init__(self, width: int):
        super().__init__()
        self.norm = nn.LayerNorm(width)
        self.mlp = nn.Sequential(nn.Linear(width, 4 * width), nn.GELU(), nn.Linear(4 * width, width))

    def forward(self, x):
        return x + self.mlp(self.norm(x))


def main():
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 128), Block(128), Block(128), nn.Linear(128, 8))
    mesh = hsdp_mesh(SHARD, model)  # 2-D ("dp_replicate", "dp_shard") DeviceMesh, on the model's device
    for block in (model[1], model[2]):
        fully_shard(block, mesh=mesh["dp_shard"])  # EDGC: native HSDP would pass mesh=mesh
    fully_shard(model, mesh=mesh["dp_shard"])
    # EDGC: short-demo settings; a real run keeps the defaults (window=1000, r_max profiled)
    config = EDGCConfig(r_max=8, window=4, total_steps=STEPS, warmup_error_test=False)
    state = EDGCState(mesh["dp_replicate"], config)  # EDGC
    register_fsdp_comm_hook(model, state)  # EDGC
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    generator = torch.Generator().manual_seed(rank)  # different data on every rank
    for step in range(1, STEPS + 1):
        x = torch.randn(32, 64, generator=generator)
        loss = nn.functional.cross_entropy(model(x), x[:, :8].argmax(dim=1))
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        if rank == 0 and step % 4 == 0:
            print(f"step {step} loss {loss.item():.4f}")
    m = state.last_step_metrics  # EDGC: what the hook did on the last step (this rank's shards)
    print(
        f"[rank {rank}] edgc: step {m['step']} phase {m['phase']} rank {m['rank']} "
        f"sent {m['bytes_sent']} of {m['bytes_raw']} bytes"
    )
    barrier_before_exit()  # EDGC: not optional on gloo (see its docstring)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
