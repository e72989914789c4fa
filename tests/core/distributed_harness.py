"""Run a function on N gloo (or NCCL) processes on 127.0.0.1 and collect what each returns.

Every collective has a timeout (the process group's), and the whole run has a wall-clock
limit after which all processes are killed, so a broken test fails instead of hanging CI.

The processes of a world size are started once and reused: starting them, importing torch and the
test module, and tearing them down took about 2.7 s of a 3.3 s two-process call. Each call still
gets a process group of its own (a new TCP store and new gloo connections, destroyed after the
call), and the torch generator is put back to a new process's seed before it, so a call sees what
it saw in new processes save Python state left by earlier calls in the same process (a test must
undo what it patches). After a failure or a timeout the pool is killed and the next call starts
new processes; a pool unused for IDLE_SECONDS is closed (its processes hold about 0.4 GB each,
which the later tests' own multi-process runs need). ``fresh=True`` runs in new processes that
exit afterwards, and so does a call with ``expect_dead`` (ranks meant to die), or every call with
EDGC_TEST_FRESH_PROCESSES=1 in the environment (to rule the pool out when a test fails).

Ports. The processes meet through a TCP store that this process serves for the call (`hosted_store`):
it binds port 0, so the kernel hands it a free port that is already its own, and the processes
connect to that port as clients. Finding a free port first and binding it later leaves a window in
which another job on the machine can take it (then every test of a run fails at once).
"""

from __future__ import annotations

import atexit
import contextlib
import io
import multiprocessing as mp
import os
import pickle
import queue
import threading
import time
import traceback
from datetime import timedelta

import torch
import torch.distributed as dist

GROUP_TIMEOUT = timedelta(seconds=60)
IDLE_SECONDS = 90


def hosted_store() -> dist.TCPStore:
    """A TCP store served by this process on a port the kernel picks and this process already holds
    (``store.port``): processes told that port connect as clients (`join`; for ``env://``, with
    ``TORCHELASTIC_USE_AGENT_STORE=True``, as torchrun's agent does it). Keep it until they are done."""
    return dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=GROUP_TIMEOUT)


_JOINED: dict = {}  # in a process of a call: the port of the call's store, and the groups made on it


def join(rank: int, world_size: int, port: int | None = None, backend: str = "gloo") -> None:
    """Make the default process group on the store served at ``port`` (default: this call's again,
    for a test that destroyed the harness's group and makes its own), under a prefix of its own."""
    if port is not None:
        _JOINED.update(port=port, groups=0)
    _JOINED["groups"] += 1
    client = dist.TCPStore("127.0.0.1", _JOINED["port"], is_master=False, timeout=GROUP_TIMEOUT)
    store = dist.PrefixStore(f"group{_JOINED['groups']}/", client)
    dist.init_process_group(backend, store=store, rank=rank, world_size=world_size, timeout=GROUP_TIMEOUT)


def _result(fn, rank: int, world_size: int, args) -> bytes:
    # Serialised to bytes: tensors sent through a queue as shared memory would vanish
    # with the exiting child before the parent reads them.
    payload = io.BytesIO()
    torch.save(fn(rank, world_size, *args), payload)
    return payload.getvalue()


def _entry(fn, rank, world_size, port, results, args, backend="gloo"):
    """A process of a ``fresh`` call: one call, then exit."""
    os.environ["OMP_NUM_THREADS"] = "1"
    torch.set_num_threads(1)
    try:
        join(rank, world_size, port, backend)
        results.put((rank, True, _result(fn, rank, world_size, args)))
    except BaseException:  # report, then exit non-zero
        results.put((rank, False, traceback.format_exc()))
        raise SystemExit(1) from None
    finally:
        # Flush the result before tearing down: after a peer died, gloo may abort the process.
        results.close()
        results.join_thread()
        if dist.is_initialized():
            dist.destroy_process_group()


def _serve(rank, world_size, tasks, results, parent):
    """A pool process: each task (pickled fn, args, port) runs in a new default process group."""
    os.environ["OMP_NUM_THREADS"] = "1"
    torch.set_num_threads(1)
    new_process_seed = torch.initial_seed()
    while os.getppid() == parent:  # an orphan (the test run was killed) exits
        try:
            task = tasks.get(timeout=5)
        except queue.Empty:
            continue
        if task is None:
            break
        torch.manual_seed(new_process_seed)
        try:
            fn, args, port = pickle.loads(task)
            join(rank, world_size, port)
            results.put((rank, True, _result(fn, rank, world_size, args)))
        except BaseException:
            results.put((rank, False, traceback.format_exc()))
        finally:
            if dist.is_initialized():
                dist.destroy_process_group()
    results.close()
    results.join_thread()
    # No interpreter shutdown: the groups of DDP calls are never freed and their gloo threads
    # would race it (see edgc.barrier_before_exit).
    os._exit(0)


def _collect(results, world_size: int, timeout: float, collected: dict) -> list:
    while len(collected) < world_size:
        try:
            rank, ok, value = results.get(timeout=timeout)
        except queue.Empty:
            raise TimeoutError(f"distributed test did not finish within {timeout} s") from None
        if not ok:
            failures = {rank: value, **_other_failures(results, world_size - len(collected) - 1)}
            raise RuntimeError("\n".join(f"rank {r} failed:\n{v}" for r, v in sorted(failures.items())))
        collected[rank] = torch.load(io.BytesIO(value), weights_only=False)
    return [collected[rank] for rank in range(world_size)]


OTHER_FAILURES_GRACE_S = 2.0  # how long a failed call waits for the other ranks' reports


def _other_failures(results, pending: int) -> dict:
    """The failures the other ranks report within `OTHER_FAILURES_GRACE_S` of the first: a rank that
    fails because another closed its connections names the symptom; the other one names the cause."""
    failures, deadline = {}, time.monotonic() + OTHER_FAILURES_GRACE_S
    while pending > 0 and (left := deadline - time.monotonic()) > 0:
        try:
            rank, ok, value = results.get(timeout=left)
        except queue.Empty:
            break
        pending -= 1
        if not ok:
            failures[rank] = value
    return failures


class _Pool:
    def __init__(self, world_size: int):
        context = mp.get_context("spawn")
        self.results = context.Queue()
        self.tasks = [context.Queue() for _ in range(world_size)]
        self.processes = [
            context.Process(target=_serve, args=(rank, world_size, self.tasks[rank], self.results, os.getpid()))
            for rank in range(world_size)
        ]
        for process in self.processes:
            process.start()
        self.busy, self.last_used = False, time.monotonic()

    def alive(self) -> bool:
        return all(process.is_alive() for process in self.processes)

    def close(self, kill: bool = False) -> None:
        if not kill:
            for tasks in self.tasks:
                tasks.put(None)
        for process in self.processes:
            process.join(timeout=0 if kill else 10)
            if process.is_alive():
                process.kill()
                process.join()


_POOLS: dict[int, _Pool] = {}
_POOLS_LOCK = threading.Lock()
_REAPER: list[threading.Thread] = []  # started with the first pool


@atexit.register
def _close_pools() -> None:
    with _POOLS_LOCK:
        while _POOLS:
            _POOLS.popitem()[1].close()


def _close_idle_pools() -> None:
    while True:
        time.sleep(5)
        with _POOLS_LOCK:
            idle = [
                size
                for size, pool in _POOLS.items()
                if not pool.busy and time.monotonic() - pool.last_used > IDLE_SECONDS
            ]
            for size in idle:
                _POOLS.pop(size).close()


def _run_fresh(fn, world_size: int, args, timeout: float, expect_dead, backend: str = "gloo") -> list:
    context = mp.get_context("spawn")
    results = context.Queue()
    store = hosted_store()
    processes = [
        context.Process(target=_entry, args=(fn, rank, world_size, store.port, results, args, backend))
        for rank in range(world_size)
    ]
    for process in processes:
        process.start()
    try:
        return _collect(results, world_size, timeout, {rank: None for rank in expect_dead})
    finally:
        for process in processes:
            process.join(timeout=10)
            if process.is_alive():
                process.kill()


def run_distributed(
    fn,
    world_size: int,
    *args,
    timeout: float = 240.0,
    expect_dead: tuple | list = (),
    fresh: bool = False,
    backend: str = "gloo",
) -> list:
    """fn(rank, world_size, *args) on every rank; returns the results ordered by rank.

    Ranks in ``expect_dead`` are meant to die without reporting; their result is None. ``timeout``
    is the longest wait for the next rank's result. A ``backend`` other than gloo runs fresh.
    """
    if fresh or expect_dead or backend != "gloo" or os.environ.get("EDGC_TEST_FRESH_PROCESSES") == "1":
        return _run_fresh(fn, world_size, args, timeout, expect_dead, backend)
    store = hosted_store()  # served until the call returns
    task = pickle.dumps((fn, args, store.port))  # here, so that what cannot be pickled fails at once
    with _POOLS_LOCK:
        pool = _POOLS.get(world_size)
        if pool is None or not pool.alive():
            if pool is not None:
                pool.close(kill=True)
            pool = _POOLS[world_size] = _Pool(world_size)
            if not _REAPER:
                _REAPER.append(threading.Thread(target=_close_idle_pools, name="close idle pools", daemon=True))
                _REAPER[0].start()
        pool.busy = True
    for tasks in pool.tasks:
        tasks.put(task)
    try:
        results = _collect(pool.results, world_size, timeout, {})
    except BaseException:
        with _POOLS_LOCK:
            _POOLS.pop(world_size, None)
        pool.close(kill=True)
        raise
    pool.busy, pool.last_used = False, time.monotonic()
    return results


@contextlib.contextmanager
def only_batched_point_to_point(log: list | None = None):
    """Inside: ``dist.isend``, ``irecv``, ``send`` and ``recv`` raise unless ``dist.batch_isend_irecv``
    calls them (it posts its ops through ``isend``/``irecv``), so all point-to-point traffic must
    go through batches. ``log`` gets one entry per batch: [("send" | "recv", peer's global rank,
    element count), …] in posting order. Patched in torch.distributed and in distributed_c10d
    (``P2POp`` checks its op against the latter's names); put back on exit."""
    c10d = dist.distributed_c10d
    names = ("isend", "irecv", "send", "recv", "batch_isend_irecv")
    originals = {name: getattr(c10d, name) for name in names}
    in_batch: list[bool] = []

    def guarded(name):
        def call(*args, **kwargs):
            if not in_batch:
                raise AssertionError(f"dist.{name} called outside dist.batch_isend_irecv")
            return originals[name](*args, **kwargs)

        call.__name__ = name
        return call

    patched = {name: guarded(name) for name in names[:4]}

    def batch_isend_irecv(ops):
        if log is not None:
            log.append([("send" if op.op is patched["isend"] else "recv", op.peer, op.tensor.numel()) for op in ops])
        in_batch.append(True)
        try:
            return originals["batch_isend_irecv"](ops)
        finally:
            in_batch.pop()

    patched["batch_isend_irecv"] = batch_isend_irecv
    for name, function in patched.items():
        setattr(c10d, name, function)
        setattr(dist, name, function)
    try:
        yield
    finally:
        for name, function in originals.items():
            setattr(c10d, name, function)
            setattr(dist, name, function)
