"""Joining the process group under torchrun, safely across `--max-restarts` restarts.

Why this exists (torch 2.4 and later): torchrun's agent hosts the TCPStore that its workers use for
``init_process_group`` (``TORCHELASTIC_USE_AGENT_STORE=True``, both the c10d and the static
rendezvous) and keeps that same store for every restart of the workers. The keys that gloo (peer
addresses) and NCCL (the unique id) write while joining have the same names in every attempt, so a
restarted worker can read the address of a peer that died in the previous attempt: it then fails at
once (connection refused) or waits in gloo's connect far longer than the process-group timeout (seen
as a hang of the killed-worker test; torch issue #135712). ``TORCHELASTIC_RESTART_COUNT`` is no
remedy: it is counted per agent and differs between nodes after an elastic restart.

So the ranks first agree on a random token through the store, by an exchange in which every key
that a waiting rank reads is named after a random value made in this attempt, and the group is
created under that token's prefix: no key of an earlier attempt can be read.
"""

from __future__ import annotations

import faulthandler
import os
import sys
import threading
import time
import uuid
from datetime import timedelta

import torch.distributed as dist

# Extra time beyond the process-group timeout before a worker stuck in joining is stopped.
JOIN_GRACE_S = 30


def dist_timeout() -> timedelta:
    """The timeout of every process group we create: ``EDGC_DIST_TIMEOUT`` seconds (default 120), not
    the backend's default (30 min for gloo, also for the groups a DeviceMesh builds without one)."""
    return timedelta(seconds=int(os.environ.get("EDGC_DIST_TIMEOUT", 120)))


def attempt_token(store, rank: int, world: int, timeout: timedelta, poll_s: float = 0.05) -> str:
    """A token that every rank of this attempt returns and no earlier attempt used.

    Rank r > 0 posts a fresh nonce under ``hello/r`` and waits for ``welcome/r/<nonce>``, which only
    this attempt's rank 0 can write. Rank 0 answers whatever ``hello/r`` holds (perhaps an earlier
    attempt's nonce, which nobody waits for) until each rank acknowledges under ``ack/<token>/r``."""
    if world == 1:
        return uuid.uuid4().hex
    if rank != 0:
        nonce = uuid.uuid4().hex
        store.set(f"edgc/join/hello/{rank}", nonce)
        token = store.get(f"edgc/join/welcome/{rank}/{nonce}").decode()  # waits up to the store's timeout
        store.set(f"edgc/join/ack/{token}/{rank}", "")
        return token
    token, answered = uuid.uuid4().hex, {}
    waiting, deadline = set(range(1, world)), time.monotonic() + timeout.total_seconds()
    while True:
        for r in sorted(waiting):
            nonce = store.get(f"edgc/join/hello/{r}").decode()
            if answered.get(r) != nonce:
                store.set(f"edgc/join/welcome/{r}/{nonce}", token)
                answered[r] = nonce
        waiting = {r for r in waiting if not store.check([f"edgc/join/ack/{token}/{r}"])}
        if not waiting:
            return token
        if time.monotonic() > deadline:
            raise TimeoutError(f"ranks {sorted(waiting)} did not join the process group within {timeout}")
        time.sleep(poll_s)


def join_process_group(backend: str, timeout: timedelta, *, alone: bool = False) -> None:
    """``dist.init_process_group(backend)`` from the env:// variables (torchrun's or our own).

    ``alone``: a group of this process only, on a store in its own memory: no port is bound, so none
    can be taken by another job between choosing it and binding it."""
    if alone:
        dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1, timeout=timeout)
        return
    world = int(os.environ["WORLD_SIZE"])
    limit = timeout.total_seconds() + JOIN_GRACE_S
    # A last resort if joining blocks where torch's timeout does not reach (gloo's connect can wait
    # several times longer): say so, print every thread's stack and exit 1, so torchrun sees a failed
    # worker instead of a silent hang. faulthandler's watchdog runs even if the GIL is never released.
    warn = threading.Timer(
        limit,
        lambda: print(
            f"rank {os.environ['RANK']}: joining the process group did not finish within {limit:.0f} s; exiting",
            file=sys.stderr,
            flush=True,
        ),
    )
    if world > 1:
        warn.daemon = True
        warn.start()
        faulthandler.dump_traceback_later(limit + 1, exit=True)
    try:
        if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True":  # a store of this attempt only
            dist.init_process_group(backend, timeout=timeout)
            return
        rank = int(os.environ["RANK"])
        store = dist.TCPStore(
            os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), is_master=False, timeout=timeout
        )
        prefix = f"edgc/attempt/{attempt_token(store, rank, world, timeout)}/"
        dist.init_process_group(
            backend, store=dist.PrefixStore(prefix, store), rank=rank, world_size=world, timeout=timeout
        )
    finally:
        if world > 1:
            warn.cancel()
            faulthandler.cancel_dump_traceback_later()
