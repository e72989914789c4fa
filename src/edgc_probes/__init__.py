"""Probes: what the CPU can say of the library's CUDA path, where it cannot time it. Each runs the
library as it is (fake or CPU tensors, stand-ins for DDP and the process group) and counts or
checks what a GPU would see: the kernels a step launches and their bytes, the memory it keeps
alive, its device→host reads, its streams' order, whether CUDA graphs could hold it. The tests
assert with them and the bench (`edgc_bench`) measures with them. They import only the library.

Modules:
    dispatch_count.py       the kernel-launching dispatches of one compressed step, counted on the CPU, and their bytes
    op_traffic.py           what one dispatched op costs a GPU: its kernels and the bytes it reads and writes
    live_memory.py          the memory a step keeps alive beyond the gradients, counted by its storages
    host_reads.py           device→host reads, counted: the library's own, and any read of a tensor's value
    hook_steps.py           a DDP hook's state settled on fake gradients, without DDP or a process group
    stand_ins.py            what DDP and a process group hand the hook, without them: buckets, a recording communicator
    gpt2_layout.py          GPT-2 with Hugging Face's parameter layout in plain torch (shapes, smoke runs)
    stream_check.py         the CUDA path's stream races and host synchronisations, checked on the CPU
    stream_check_access.py  its kernels' accesses and the races between them
    stream_check_memory.py  where each storage came from, and what its free means
    stream_check_threads.py every thread and future under it
    stream_check_patches.py what that checker replaces while it runs (torch.cpu's streams, works, ...)
    stream_check_moves.py   ... and what it makes of tensors made, moved and read from Python
    stream_check_syncs.py   which operators make the host wait for the device
    capture_check.py        whether a step's work could be held by CUDA graphs, checked on the CPU
    capture_check_trace.py  what it records of a step: operators, region calls, where storages are made
    capture_check_judge.py  its violations, from that record
    participation.py        who took part in which step of a fault-tolerant run, from each group's step lines
"""
