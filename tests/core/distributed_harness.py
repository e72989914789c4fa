"""Run a function on N gloo (or NCCL) processes on 127.0.0.1 and collect what each returns.

Every collective has a timeout (the process group's), and the whole run has a wall-clock
limit after which all processes are killed, so a broken test fails instead of hanging CI.
"""
from __future__ import annotations

import io
import multiprocessing as mp
import os
import queue
import socket
import traceback
from datetime import timedelta

import torch
import torch.distributed as dist


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _entry(fn, rank, world_size, port, results, args, backend="gloo"):
    os.environ["OMP_NUM_THREADS"] = "1"
    torch.set_num_threads(1)
    try:
        dist.init_process_group(backend, init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                                world_size=world_size, timeout=timedelta(seconds=60))
        # Serialised to bytes: tensors sent through a queue as shared memory would vanish
        # with the exiting child before the parent reads them.
        payload = io.BytesIO()
        torch.save(fn(rank, world_size, *args), payload)
        results.put((rank, True, payload.getvalue()))
    except BaseException:  # report, then exit non-zero
        results.put((rank, False, traceback.format_exc()))
        raise SystemExit(1)
    finally:
        # Flush the result before tearing down: after a peer died, gloo may abort the process.
        results.close()
        results.join_thread()
        if dist.is_initialized():
            dist.destroy_process_group()


def run_distributed(fn, world_size: int, *args, timeout: float = 240.0, expect_dead: tuple | list = (),
                    backend: str = "gloo") -> list:
    """fn(rank, world_size, *args) on every rank; returns the results ordered by rank.

    Ranks in ``expect_dead`` are meant to die without reporting; their result is None.
    """
    context = mp.get_context("spawn")
    results = context.Queue()
    port = free_port()
    processes = [context.Process(target=_entry, args=(fn, rank, world_size, port, results, args, backend))
                 for rank in range(world_size)]
    for process in processes:
        process.start()
    collected: dict[int, object] = {rank: None for rank in expect_dead}
    try:
        while len(collected) < world_size:
            try:
                rank, ok, value = results.get(timeout=timeout)
            except queue.Empty:
                raise TimeoutError(f"distributed test did not finish within {timeout} s") from None
            if not ok:
                raise RuntimeError(f"rank {rank} failed:\n{value}")
            collected[rank] = torch.load(io.BytesIO(value), weights_only=False)
    finally:
        for process in processes:
            process.join(timeout=10)
            if process.is_alive():
                process.kill()
    return [collected[rank] for rank in range(world_size)]
