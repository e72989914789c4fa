"""What the library must read inside PyTorch and FSDP2, each private name in one place.

Modules:
    torch_adapter.py The one place that reads PyTorch's private members on its objects (FSDP2's are
                     `edgc.adapters.fsdp_adapter`'s).
    fsdp_adapter.py  The one place that reads FSDP2's private state: what EDGC's replica all-reduce hook
                     (`edgc.parallel.fsdp`) needs of ``fully_shard`` that FSDP2 keeps private.
"""
