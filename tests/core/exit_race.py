"""One process of a 2-process DDP run (EDGC hook, gloo) whose gloo threads lag: `test_exit` runs it.

    RANK=r WORLD_SIZE=2 MASTER_ADDR=127.0.0.1 MASTER_PORT=p python tests/core/exit_race.py edgc|barrier

The process is pinned to one core and every thread ``init_process_group`` starts runs at
SCHED_IDLE, so a gloo worker runs only while the main thread is blocked. That turns the exit race
`barrier_before_exit` is for from rare into near-certain: the worker drops its last reference to the
final barrier (and, through it, to works issued during backward, whose thread-local state holds a
Python object) only once the main thread blocks, which at the end is inside interpreter
finalization. Ending with ``dist.barrier()`` (argument ``barrier``) aborted 5 of 6 such runs with
"terminate called without an active exception"; ``barrier_before_exit()`` (``edgc``) must exit 0.
"""

import os
import sys

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

from edgc import EDGCConfig, EDGCState, barrier_before_exit, edgc_hook


def init_with_lagging_gloo_threads() -> int:
    """init_process_group, then SCHED_IDLE for the threads it started; returns how many."""
    os.sched_setaffinity(0, {int(os.environ["RANK"]) % os.cpu_count()})  # inherited by gloo's threads
    before = set(os.listdir("/proc/self/task"))
    dist.init_process_group("gloo")
    started = set(os.listdir("/proc/self/task")) - before
    for tid in started:
        os.sched_setscheduler(int(tid), os.SCHED_IDLE, os.sched_param(0))
    return len(started)


def main(ending: str) -> None:
    lagging = init_with_lagging_gloo_threads()
    rank = dist.get_rank()
    torch.manual_seed(0)
    model = DDP(nn.Sequential(nn.Linear(32, 64), nn.GELU(), nn.Linear(64, 8)))
    state = EDGCState(None, EDGCConfig(r_max=4, window=2, total_steps=6, warmup_error_test=False), model=model)
    model.register_comm_hook(state, edgc_hook)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    generator = torch.Generator().manual_seed(rank)
    for _ in range(6):
        x = torch.randn(16, 32, generator=generator)
        optimizer.zero_grad()
        nn.functional.cross_entropy(model(x), x[:, :8].argmax(dim=1)).backward()
        optimizer.step()
    print(f"[rank {rank}] lagging gloo threads {lagging} phase {state.last_step_metrics['phase']}", flush=True)
    if ending == "edgc":
        barrier_before_exit()
    else:
        dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1])
