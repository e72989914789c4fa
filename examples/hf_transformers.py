"""A Hugging Face transformers GPT-2 under torchrun + DDP, gradients synced by EDGC.

    HF_HUB_OFFLINE=1 OMP_NUM_THREADS=1 torchrun --nproc_per_node 2 examples/hf_transformers.py

The model is built from a GPT2Config (nothing is downloaded); the data is a random token
walk (each token is the previous one plus 1 or 2, modulo 16), so the loss falls quickly.
The EDGC change is the one ``register_edgc`` line.
"""

import os

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP
from transformers import GPT2Config, GPT2LMHeadModel

from edgc import EDGCConfig, barrier_before_exit
from edgc.integrations import register_edgc

STEPS = int(os.environ.get("STEPS", 16))
VOCAB, SEQ = 512, 32


def batch(generator, size=8):
    """Random walks over 16 tokens (+1 or +2 each step): learnable in a few steps."""
    start = torch.randint(0, 16, (size, 1), generator=generator)
    steps = torch.randint(1, 3, (size, SEQ - 1), generator=generator)
    return torch.cat([start, start + steps.cumsum(dim=1)], dim=1) % 16


def main():
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    torch.manual_seed(0)
    config = GPT2Config(
        vocab_size=VOCAB, n_positions=SEQ, n_embd=64, n_layer=2, n_head=2, bos_token_id=0, eos_token_id=0
    )
    model = DDP(GPT2LMHeadModel(config))
    # short-demo settings; a real run keeps the defaults (window=1000, r_max profiled)
    state = register_edgc(model, EDGCConfig(r_max=8, window=4, total_steps=STEPS, warmup_error_test=False))
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    generator = torch.Generator().manual_seed(rank)
    for step in range(1, STEPS + 1):
        tokens = batch(generator)
        loss = model(input_ids=tokens, labels=tokens).loss
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        if rank == 0 and step % 4 == 0:
            print(f"step {step} loss {loss.item():.4f}")
    m = state.last_step_metrics
    print(
        f"[rank {rank}] edgc: step {m['step']} phase {m['phase']} rank {m['rank']} "
        f"sent {m['bytes_sent']} of {m['bytes_raw']} bytes"
    )
    barrier_before_exit()  # EDGC: not optional on gloo (see its docstring)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
