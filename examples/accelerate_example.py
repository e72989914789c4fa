"""HF Accelerate with EDGC: register the hook on the model ``accelerator.prepare`` returned.

    OMP_NUM_THREADS=1 torchrun --nproc_per_node 2 examples/accelerate_example.py

Launch with torchrun: ``accelerate launch --cpu --num_processes 2`` starts a single process
on CPU. Accelerate's ``DistributedDataParallelKwargs(comm_hook=...)`` accepts only its built-in
hooks, so the EDGC change is one ``register_edgc`` line after ``prepare``. Gradient accumulation
(``accelerator.accumulate``, which uses DDP's ``no_sync``) counts optimizer steps, not micro-batches.
"""

import os

import torch
from accelerate import Accelerator
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from edgc import EDGCConfig, barrier_before_exit
from edgc.integrations import register_edgc

STEPS = int(os.environ.get("STEPS", 12))  # optimizer steps
ACCUMULATE = 2


def main():
    accelerator = Accelerator(cpu=True, gradient_accumulation_steps=ACCUMULATE)
    torch.manual_seed(0)
    x = torch.randn(STEPS * ACCUMULATE * 16 * accelerator.num_processes, 64)
    data = DataLoader(TensorDataset(x, x[:, :8].argmax(dim=1)), batch_size=16, shuffle=True)
    model = nn.Sequential(nn.Linear(64, 256), nn.GELU(), nn.Linear(256, 256), nn.GELU(), nn.Linear(256, 8))
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    model, optimizer, data = accelerator.prepare(model, optimizer, data)
    # short-demo settings; a real run keeps the defaults (window=1000, r_max profiled)
    state = register_edgc(model, EDGCConfig(r_max=8, window=4, total_steps=STEPS, warmup_error_test=False))
    for i, (inputs, targets) in enumerate(data, start=1):
        with accelerator.accumulate(model):
            loss = nn.functional.cross_entropy(model(inputs), targets)
            accelerator.backward(loss)
            optimizer.step()
            optimizer.zero_grad()
        if accelerator.is_main_process and i % 8 == 0:
            print(f"micro-batch {i} loss {loss.item():.4f}")
    m = state.last_step_metrics
    print(
        f"[rank {accelerator.process_index}] edgc: step {m['step']} phase {m['phase']} rank {m['rank']} "
        f"sent {m['bytes_sent']} of {m['bytes_raw']} bytes"
    )
    barrier_before_exit()  # EDGC: not optional on gloo, also under Accelerate (see its docstring)
    accelerator.end_training()


if __name__ == "__main__":
    main()
