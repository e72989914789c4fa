"""Composition with PyTorch's parallelisms: FSDP2/HSDP, pipeline stages and their traffic.

Modules:
    fsdp.py       EDGC for FSDP2 (`fully_shard`) and HSDP: compress the all-reduce between replicas.
    fsdp_layout.py Where each parameter's shard lies in the buffer FSDP2 hands that hook.
    interstage.py Compressed inter-stage traffic: low-rank activation gradients with per-slot error feedback.
    pipeline.py   DAC across pipeline stages: one `EDGCState` per stage, ranks aligned every window.
"""
