"""Plain PyTorch DDP with EDGC: a vanilla training loop plus the lines marked ``# EDGC``.

    OMP_NUM_THREADS=1 torchrun --nproc_per_node 2 examples/ddp_plain.py

``examples/ddp_plain.diff`` is the whole change against the vanilla script.
"""

import os

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

from edgc import EDGCConfig, EDGCState, barrier_before_exit, edgc_hook  # EDGC

STEPS = int(os.environ.get("STEPS", 20))


def main():
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    torch.manual_seed(0)
    model = DDP(nn.Sequential(nn.Linear(64, 256), nn.GELU(), nn.Linear(256, 256), nn.GELU(), nn.Linear(256, 8)))
    # EDGC: short-demo settings; a real run keeps the defaults (window=1000, r_max profiled)
    config = EDGCConfig(r_max=8, window=5, total_steps=STEPS, warmup_error_test=False)
    state = EDGCState(None, config, model=model)
    model.register_comm_hook(state, edgc_hook)
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    generator = torch.Generator().manual_seed(rank)  # different data on every rank
    for step in range(1, STEPS + 1):
        x = torch.randn(32, 64, generator=generator)
        loss = nn.functional.cross_entropy(model(x), x[:, :8].argmax(dim=1))
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        if rank == 0 and step % 5 == 0:
            print(f"step {step} loss {loss.item():.4f}")
    m = state.last_step_metrics  # EDGC: what the hook did on the last step
    print(
        f"[rank {rank}] edgc: step {m['step']} phase {m['phase']} rank {m['rank']} "
        f"sent {m['bytes_sent']} of {m['bytes_raw']} bytes"
    )
    barrier_before_exit()  # EDGC: not optional on gloo (see its docstring)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
