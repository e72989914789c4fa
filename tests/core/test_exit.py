"""`barrier_before_exit`: a no-op without a process group; with one, its work outlives the call,
and a DDP run that ends with it exits cleanly even when gloo's threads lag.

The abort it prevents (gloo's worker thread dropping the last reference to a work while the
interpreter finalizes) is timing-dependent: 1 in 150 example runs on 2 busy cores. exit_race.py
makes it near-certain for a run that ends without it (see its docstring).
"""

from __future__ import annotations

import os
import subprocess
import sys
from datetime import timedelta
from pathlib import Path

import pytest
import torch.distributed as dist
from distributed_harness import hosted_store

from edgc import barrier_before_exit
from edgc.distributed import comm


def test_without_a_process_group_it_does_nothing():
    before = len(comm._EXIT_BARRIERS)
    barrier_before_exit()
    assert len(comm._EXIT_BARRIERS) == before


def test_its_work_is_kept_until_exit():
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1, timeout=timedelta(seconds=60))
    try:
        before = len(comm._EXIT_BARRIERS)
        barrier_before_exit()
        assert len(comm._EXIT_BARRIERS) == before + 1
        assert comm._EXIT_BARRIERS[-1].is_completed()
    finally:
        dist.destroy_process_group()


@pytest.mark.skipif(not hasattr(os, "SCHED_IDLE"), reason="needs Linux scheduling policies")
def test_a_ddp_run_ending_with_it_exits_cleanly_while_gloo_threads_lag():
    script = Path(__file__).with_name("exit_race.py")
    store = hosted_store()  # both ranks connect to it as clients: no port to race for
    env = {
        **os.environ,
        "WORLD_SIZE": "2",
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(store.port),
        "TORCHELASTIC_USE_AGENT_STORE": "True",
        "OMP_NUM_THREADS": "1",
    }
    procs = [
        subprocess.Popen(
            [sys.executable, str(script), "edgc"],
            env={**env, "RANK": str(rank)},
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for rank in range(2)
    ]
    try:
        outputs = [proc.communicate(timeout=120)[0] for proc in procs]
    finally:
        for proc in procs:
            proc.kill()
    for rank, (proc, output) in enumerate(zip(procs, outputs)):
        assert proc.returncode == 0, output[-3000:]
        assert f"[rank {rank}] lagging gloo threads" in output and "threads 0 " not in output, output[-3000:]
