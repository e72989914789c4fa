"""`barrier_before_exit`: a no-op without a process group; with one, its work outlives the call.

The abort it prevents (gloo's worker thread dropping the last reference to a work while the
interpreter finalizes) is timing-dependent; tests/integrations/test_examples.py runs the examples
that call it, which aborted in about 1 of 3 runs on this machine before it existed.
"""
from __future__ import annotations

from datetime import timedelta

import torch.distributed as dist
from distributed_harness import free_port

from edgc import barrier_before_exit, comm


def test_without_a_process_group_it_does_nothing():
    before = len(comm._EXIT_BARRIERS)
    barrier_before_exit()
    assert len(comm._EXIT_BARRIERS) == before


def test_its_work_is_kept_until_exit():
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1,
                            timeout=timedelta(seconds=60))
    try:
        before = len(comm._EXIT_BARRIERS)
        barrier_before_exit()
        assert len(comm._EXIT_BARRIERS) == before + 1
        assert comm._EXIT_BARRIERS[-1].is_completed()
    finally:
        dist.destroy_process_group()
