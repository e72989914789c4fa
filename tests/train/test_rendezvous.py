"""Joining under torchrun: ranks agree on a per-attempt key prefix even when the store still holds an
earlier attempt's keys, and a worker stuck in joining exits instead of hanging."""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time
from datetime import timedelta

import torch.distributed as dist

from edgc_train.rendezvous import attempt_token

from .conftest import REPO

TIMEOUT = timedelta(seconds=20)


def run_attempt(port: int, world: int, late: set[int]) -> list[str]:
    """One attempt: every rank in a thread with its own store client; ranks in ``late`` start 0.3 s later."""
    tokens = [None] * world

    def rank_main(rank: int) -> None:
        if rank in late:
            time.sleep(0.3)
        store = dist.TCPStore("127.0.0.1", port, is_master=False, timeout=TIMEOUT)
        tokens[rank] = attempt_token(store, rank, world, TIMEOUT, poll_s=0.01)

    threads = [threading.Thread(target=rank_main, args=(r,)) for r in range(world)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=30)
    return tokens


def test_every_attempt_agrees_on_a_new_token_despite_the_earlier_attempts_keys():
    server = dist.TCPStore("127.0.0.1", 0, is_master=True, timeout=TIMEOUT)  # outlives attempts, like the agent's
    seen = set()
    # rank 0 first (it reads the earlier nonces), rank 0 last (the others' first reads are of fresh keys), mixed
    for late in (set(), {1, 2}, {0}, {0, 2}):
        tokens = run_attempt(server.port, 3, late)
        assert None not in tokens and len(set(tokens)) == 1, tokens
        assert tokens[0] not in seen
        seen.add(tokens[0])


def test_a_worker_stuck_in_joining_exits_with_its_stack():
    # init_process_group replaced by a call that never returns: the watchdog must stop the process.
    code = (
        "import os, time\n"
        "from datetime import timedelta\n"
        "import torch.distributed as dist\n"
        "import edgc_train.rendezvous as r\n"
        "r.JOIN_GRACE_S = 1\n"
        "dist.init_process_group = lambda *a, **k: time.sleep(120)\n"
        "r.join_process_group('gloo', timedelta(seconds=1))\n"
    )
    env = {**os.environ, "WORLD_SIZE": "2", "RANK": "1", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "1"}
    env.pop("TORCHELASTIC_USE_AGENT_STORE", None)
    t0 = time.monotonic()
    proc = subprocess.run([sys.executable, "-c", code], cwd=REPO, env=env, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 1
    assert time.monotonic() - t0 < 30
    assert "joining the process group did not finish within 2 s" in proc.stderr, proc.stderr[-2000:]
    assert "join_process_group" in proc.stderr, proc.stderr[-2000:]  # the stack, from faulthandler
