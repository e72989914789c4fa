"""Quorum settings for torchft replica groups that keep every live group in every step.

How torchft 0.2.0's lighthouse forms a quorum (``quorum_compute`` in its src/lighthouse.rs), at
every request and every ``quorum_tick``:

1. *Fast quorum*: once every member of the previous quorum has asked, the quorum is issued at
   once, with every healthy group that has asked by then and no other.
2. Otherwise it is issued once at least ``min_replicas`` healthy groups have asked, more than half
   of the heartbeating ones, and either every heartbeating group has asked or ``join_timeout``
   has passed since the first one asked.

A group is healthy while its heartbeats (every 100 ms, from the manager's own thread) are younger
than ``heartbeat_timeout``. A group that asks after a quorum was issued waits for the next one.

With ``min_replicas 1`` and a 1 s join timeout, a group more than 1 s late (a slow step on a
shared machine) is left out; its peers commit the step without it, so it is behind and heals from
a peer when it next asks. The heal takes longer than 1 s over a real link, so it is late again for
the quorum after: with three groups, every step had two participants, in turn, and a group that
finished behind ran its last steps in a quorum of one, its replica no longer the others'.

So, per group count and number of failures the run is meant to survive:

* ``min_replicas = groups - tolerated_failures``, in the lighthouse and as the manager's
  ``min_replica_size`` (a step in a smaller quorum is not committed). Without failures to
  tolerate, no quorum lacks a group, however late it is: by construction, not by timing. If a
  group dies in such a run, the others wait for it, up to ``quorum_timeout``, then fail: a
  failure-free reference never goes on quietly with fewer groups. With one tolerated failure the
  survivors go on once the dead group's heartbeats are older than ``heartbeat_timeout``.
* ``join_timeout = 3 × timeout``: in a run that tolerates failures, how long the others wait for a
  live group that has not asked yet. It must cover the longest a live group can be late: a heal
  (the model and optimizer state over the link) plus a step, and, after a peer died, one whole
  collective ``timeout`` spent in a gloo receive from a survivor that had dropped that collective;
  the rest is slack for a loaded machine. A dead group is not waited for: it stops heartbeating.
  Leaving a live group out never saves time: it falls behind and must heal.
* ``heartbeat_timeout = 1 s`` (torchft's default is 5 s): how long a dead group holds up its
  survivors. A live group whose heartbeat thread starves for longer sits out one quorum and heals;
  without tolerated failures it cannot be left out at all.
* ``quorum_timeout = 4 × timeout``: longer than ``join_timeout``, so that groups waiting for a
  straggler do not give up on the quorum before the lighthouse does.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from datetime import timedelta


@dataclass(frozen=True)
class QuorumSettings:
    """The lighthouse's and the managers' quorum settings of one run (see the module docstring)."""

    min_replicas: int
    """Groups a quorum needs (lighthouse) and a step needs to commit (manager): groups − tolerated failures."""
    join_timeout: timedelta
    """How long a quorum waits for a live group that has not asked yet (3 × ``timeout``)."""
    heartbeat_timeout: timedelta
    """A group whose last heartbeat is older is dead to the lighthouse (1 s)."""
    timeout: timedelta
    """One collective or manager call."""
    quorum_timeout: timedelta
    """How long a manager waits for its quorum (4 × ``timeout``: longer than ``join_timeout``)."""
    quorum_tick: timedelta = timedelta(milliseconds=100)
    """How often the lighthouse computes a quorum."""

    @classmethod
    def for_groups(
        cls, groups: int, tolerated_failures: int = 0, timeout: timedelta = timedelta(seconds=60)
    ) -> QuorumSettings:
        """Settings for ``groups`` replica groups that go on without up to ``tolerated_failures`` dead ones.

        Args:
            groups: the replica groups.
            tolerated_failures: how many of them may die with training going on.
            timeout: one collective or manager call; the quorum's timeouts are multiples of it.

        Returns:
            The settings.

        Raises:
            ValueError: ``groups`` < 1, or ``tolerated_failures`` outside [0, ``groups``).
        """
        if groups < 1 or not 0 <= tolerated_failures < groups:
            raise ValueError(f"need groups ≥ 1 and 0 ≤ tolerated_failures < groups, got {groups}, {tolerated_failures}")
        return cls(
            min_replicas=groups - tolerated_failures,
            join_timeout=3 * timeout,
            heartbeat_timeout=timedelta(seconds=1),
            timeout=timeout,
            quorum_timeout=4 * timeout,
        )

    def lighthouse_args(self) -> list[str]:
        """Command-line flags of ``torchft_lighthouse``.

        Returns:
            The flags and their values, in order.
        """
        return [
            "--min_replicas",
            str(self.min_replicas),
            "--join_timeout_ms",
            str(_ms(self.join_timeout)),
            "--heartbeat_timeout_ms",
            str(_ms(self.heartbeat_timeout)),
            "--quorum_tick_ms",
            str(_ms(self.quorum_tick)),
        ]

    def lighthouse_kwargs(self) -> dict:
        """Keyword arguments of ``torchft._torchft.LighthouseServer`` (an in-process lighthouse).

        Returns:
            The keyword arguments.
        """
        return {
            "min_replicas": self.min_replicas,
            "join_timeout_ms": _ms(self.join_timeout),
            "heartbeat_timeout_ms": _ms(self.heartbeat_timeout),
            "quorum_tick_ms": _ms(self.quorum_tick),
        }

    def manager_kwargs(self) -> dict:
        """Keyword arguments of ``torchft.Manager``.

        Returns:
            The keyword arguments.
        """
        return {"min_replica_size": self.min_replicas, "timeout": self.timeout, "quorum_timeout": self.quorum_timeout}


def _ms(duration: timedelta) -> int:
    return int(duration.total_seconds() * 1000)


def launch_local_groups(
    script: str,
    groups: int,
    settings: QuorumSettings,
    group_env: Callable[[int], dict[str, str]] = lambda group: {},
    timeout_s: float = 600,
    args: Sequence[str] = (),
    module: bool = False,
) -> int:
    """Run ``script`` as ``groups`` replica groups on this machine, under a lighthouse in this process.

    Each group is one ``torchrun`` (one process, one restart) with ``REPLICA_GROUP_ID``,
    ``REPLICA_GROUPS`` and ``TORCHFT_LIGHTHOUSE`` set; what is left is killed on the way out.

    Args:
        script: the script's path, or a module's name with ``module``.
        groups: the replica groups to run.
        settings: the lighthouse's settings.
        group_env: more environment variables of one group, given its index.
        timeout_s: how long to wait for each group (s).
        args: command-line arguments that follow the script.
        module: ``script`` names a module, run as ``python -m script``.

    Returns:
        The worst exit status (0 = every group finished).
    """
    from torchft._torchft import LighthouseServer

    lighthouse = LighthouseServer(bind="[::]:0", **settings.lighthouse_kwargs())
    env = {
        **os.environ,
        "TORCHFT_LIGHTHOUSE": lighthouse.address(),
        "OMP_NUM_THREADS": "1",
        "REPLICA_GROUPS": str(groups),
    }
    procs = []
    try:
        for group in range(groups):
            with socket.socket() as s:  # a free port for the group's store
                s.bind(("127.0.0.1", 0))
                port = s.getsockname()[1]
            argv = [
                sys.executable,
                "-m",
                "torch.distributed.run",
                "--nproc_per_node",
                "1",
                "--max-restarts",
                "1",
                "--master_addr",
                "127.0.0.1",
                "--master_port",
                str(port),
                *(["--module"] if module else []),
                script,
                *args,
            ]
            procs.append(subprocess.Popen(argv, env={**env, "REPLICA_GROUP_ID": str(group), **group_env(group)}))
        return max(p.wait(timeout=timeout_s) for p in procs)
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
        lighthouse.shutdown()
