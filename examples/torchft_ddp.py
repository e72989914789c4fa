"""EDGC across torchft replica groups: compressed gradients that survive a group failing and coming back.

A lighthouse, then one ``torchrun`` per replica group (here 2 groups of one process, one machine):

    torchft_lighthouse --min_replicas 2 --join_timeout_ms 90000 --heartbeat_timeout_ms 1000 --quorum_tick_ms 100 &
    export TORCHFT_LIGHTHOUSE=http://localhost:29510 OMP_NUM_THREADS=1 REPLICA_GROUPS=2
    REPLICA_GROUP_ID=0 torchrun --nproc_per_node 1 --master_port 29600 --max-restarts 1 examples/torchft_ddp.py &
    REPLICA_GROUP_ID=1 torchrun --nproc_per_node 1 --master_port 29601 --max-restarts 1 examples/torchft_ddp.py

or all of it in one command (the lighthouse in-process), with group 1 killed (SIGKILL, in the
middle of a step's gradient sync) at step 12 and restarted by its torchrun:

    python examples/torchft_ddp.py --launch 2 --kill-at 12

The other group discards the step the kill interrupted (its error feedback keeps that step's
gradient), and the restarted group heals from it — model, optimizer and EDGC's shared state
(step, Q, rank schedule) — and compresses again from its first step. Each group
prints ``[rank G] edgc: ...`` and a checksum of its parameters: equal checksums = identical replicas.
"""

import argparse
import os
import signal
import sys
from datetime import timedelta

import torch
from torch import nn
from torchft import Manager, ProcessGroupGloo
from torchft.optim import OptimizerWrapper

from edgc import EDGCConfig
from edgc.integrations.torchft import DistributedDataParallel  # EDGC: instead of torchft.DistributedDataParallel
from edgc.integrations.torchft_quorum import QuorumSettings, launch_local_groups

STEPS = int(os.environ.get("STEPS", 24))


def quorum(groups: int) -> QuorumSettings:
    """Every live group in every step (`QuorumSettings`' docstring says why): a short demo would end
    before a killed group is back, so the others wait for it rather than go on without it. The
    flags in this module's docstring are ``quorum(2).lighthouse_args()``."""
    return QuorumSettings.for_groups(groups, tolerated_failures=0, timeout=timedelta(seconds=30))


def train() -> None:
    group = int(os.environ["REPLICA_GROUP_ID"])
    holder = {}
    settings = quorum(int(os.environ.get("REPLICA_GROUPS", 2)))
    manager = Manager(
        pg=ProcessGroupGloo(timeout=settings.timeout),
        load_state_dict=lambda s: (
            holder["model"].load_state_dict(s["model"]),
            holder["optim"].load_state_dict(s["optim"]),
        ),
        state_dict=lambda: {"model": holder["model"].state_dict(), "optim": holder["optim"].state_dict()},
        replica_id=f"group{group}",
        use_async_quorum=False,  # EDGC: a healing group loads the rank before its sync
        **settings.manager_kwargs(),
    )
    torch.manual_seed(0)
    module = nn.Sequential(nn.Linear(64, 256), nn.GELU(), nn.Linear(256, 256), nn.GELU(), nn.Linear(256, 8))
    # EDGC: short-demo settings; a real run keeps the defaults (window=1000, r_max profiled)
    config = EDGCConfig(r_max=8, window=5, total_steps=STEPS, warmup_error_test=False)
    model = DistributedDataParallel(manager, module, config, bucket_cap_mb=0.1)
    optimizer = OptimizerWrapper(manager, torch.optim.AdamW(module.parameters(), lr=3e-3))
    holder.update(model=module, optim=optimizer)
    state = model.edgc_state
    kill_at = int(os.environ.get("KILL_AT", -1)) if os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") == "0" else -1
    attempts = 0
    while manager.current_step() < STEPS:
        optimizer.zero_grad()  # starts the quorum; a (re)started group heals here
        step = manager.current_step()
        if step == kill_at:  # die while the last bucket's gradient sync is under way
            module[0].weight.register_hook(lambda grad: os.kill(os.getpid(), signal.SIGKILL))
        # Fresh data on every attempt, as from a data loader: a discarded step's gradient is in the
        # error feedback already, so retrying the same batch would count it twice.
        generator = torch.Generator().manual_seed(1_000_000 * group + attempts)
        attempts += 1
        x = torch.randn(32, 64, generator=generator)
        loss = nn.functional.cross_entropy(model(x), x[:, :8].argmax(dim=1))
        loss.backward()
        optimizer.step()  # commits the step, or discards it (EDGC rolls back) if the quorum failed
        if step % 6 == 0:
            say(
                f"[group {group}] step {step} loss {loss.item():.4f} participants {manager.num_participants()} "
                f"committed {state.last_step_metrics.get('committed')}"
            )
    m = state.last_step_metrics
    say(
        f"[rank {group}] edgc: step {m['step']} phase {m['phase']} rank {m['rank']} "
        f"sent {m['bytes_sent']} of {m['bytes_raw']} bytes"
    )
    checksum = torch.cat([p.detach().reshape(-1) for p in module.parameters()]).double().sum().item()
    say(
        f"[group {group}] committed {manager.current_step()} discarded {state.steps_discarded} "
        f"heals {state.heals} checksum {checksum.hex()}"
    )
    manager.shutdown(wait=False)


def say(line: str) -> None:
    """One line in one write: the groups share the terminal, and print() writes the newline apart,
    so two groups finishing together could otherwise glue their lines."""
    sys.stdout.write(line + "\n")
    sys.stdout.flush()


def launch(groups: int, kill_at: int) -> int:
    """A lighthouse in this process and one torchrun per group; their exit status (0 = all fine)."""
    return launch_local_groups(
        __file__, groups, quorum(groups), lambda group: {"KILL_AT": str(kill_at if group == 1 else -1)}
    )


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--launch", type=int, metavar="GROUPS", help="start a lighthouse and GROUPS torchrun groups")
    parser.add_argument("--kill-at", type=int, default=-1, help="with --launch: kill group 1 at this step once")
    args = parser.parse_args()
    sys.exit(launch(args.launch, args.kill_at) if args.launch else train())
