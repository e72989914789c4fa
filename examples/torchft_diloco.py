"""DiLoCo across torchft replica groups, its outer sync compressed by EDGC: for links too slow for a sync per step.

Each group takes SYNC_EVERY inner steps alone; then the groups average their pseudo-gradients
(θ_global − θ_local) through EDGC (low-rank factors plus each group's error feedback) and an outer
Nesterov SGD steps θ_global. A lighthouse, then one ``torchrun`` per replica group:

    torchft_lighthouse --min_replicas 2 --join_timeout_ms 90000 --heartbeat_timeout_ms 1000 &
    export TORCHFT_LIGHTHOUSE=http://localhost:29510 OMP_NUM_THREADS=1 REPLICA_GROUPS=2
    REPLICA_GROUP_ID=0 torchrun --nproc_per_node 1 --master_port 29600 examples/torchft_diloco.py &
    REPLICA_GROUP_ID=1 torchrun --nproc_per_node 1 --master_port 29601 examples/torchft_diloco.py

(the lighthouse flags are ``QuorumSettings.for_groups(2, 0, 30 s).lighthouse_args()``: every live
group in every quorum), or all of it in one command, the lighthouse in-process, with group 1 killed
(SIGKILL) once at outer step 5, just before its outer sync, and restarted by its torchrun:

    python examples/torchft_diloco.py --launch 2 --kill-at 5

The survivor waits for it in that outer step's quorum; the restarted group heals from the survivor
— model, inner optimizer, θ_global, outer optimizer and EDGC's shared state (step, Q, rank
schedule) — and both go on compressing. (An outer sync that fails once started is not committed:
each group's pseudo-gradient goes back into its error feedback.) Each group prints
``[rank G] edgc: ...`` and a checksum of θ_global: equal checksums = identical replicas.
"""

import argparse
import os
import signal
import sys
from datetime import timedelta

import torch
from torch import nn
from torchft import Manager, ProcessGroupGloo

from edgc import EDGCConfig
from edgc.integrations.torchft import DiLoCo, QuorumSettings  # EDGC: instead of torchft.local_sgd.DiLoCo
from edgc.integrations.torchft_quorum import launch_local_groups

OUTER_STEPS = int(os.environ.get("STEPS", 12))
SYNC_EVERY = 8  # inner steps per outer step (DiLoCo's H; hundreds in a real run)


def quorum() -> QuorumSettings:
    """Every group in every quorum: a short demo would end before a killed group is back, so the
    others wait for it (a long run would tolerate failures and go on without it)."""
    return QuorumSettings.for_groups(int(os.environ.get("REPLICA_GROUPS", 2)), 0, timedelta(seconds=30))


def train() -> None:
    group = int(os.environ["REPLICA_GROUP_ID"])
    holder = {}
    manager = Manager(
        pg=ProcessGroupGloo(timeout=timedelta(seconds=30)),
        replica_id=f"group{group}",
        use_async_quorum=False,
        load_state_dict=lambda s: (
            holder["model"].load_state_dict(s["model"]),
            holder["inner"].load_state_dict(s["inner"]),
        ),
        state_dict=lambda: {"model": holder["model"].state_dict(), "inner": holder["inner"].state_dict()},
        **quorum().manager_kwargs(),
    )
    torch.manual_seed(0)
    module = nn.Sequential(nn.Linear(64, 256), nn.GELU(), nn.Linear(256, 256), nn.GELU(), nn.Linear(256, 8))
    inner = torch.optim.AdamW(module.parameters(), lr=3e-3)
    outer = torch.optim.SGD(module.parameters(), lr=0.7, momentum=0.5, nesterov=True)
    holder.update(model=module, inner=inner)
    # EDGC: every EDGC step is an outer step; the byte budget (a mean rank of 4) is spent over them
    config = EDGCConfig(
        r_max=8,
        rank_budget=4,
        window=3,
        total_steps=OUTER_STEPS,
        warmup_fraction=0.0,
        min_warmup_steps=0,
        warmup_error_test=False,
    )
    diloco = DiLoCo(manager, [module], inner, outer, sync_every=SYNC_EVERY, config=config)
    restarted = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") != "0"
    kill_at = -1 if restarted else int(os.environ.get("KILL_AT", -1))
    batches = 0
    with diloco:
        while manager.current_step() < OUTER_STEPS:
            if manager.current_step() == kill_at and diloco._local_step == SYNC_EVERY - 1:
                os.kill(os.getpid(), signal.SIGKILL)  # just before the inner step that starts the outer sync
            # Fresh data on every attempt: a discarded outer step's pseudo-gradient is in the error
            # feedback already, so training on the same batches again would count them twice.
            generator = torch.Generator().manual_seed(1_000_000 * group + 1000 * int(restarted) + batches)
            batches += 1
            x = torch.randn(32, 64, generator=generator)
            loss = nn.functional.cross_entropy(module(x), x[:, :8].argmax(dim=1))
            loss.backward()
            inner.step()  # every SYNC_EVERY-th: the outer step, committed or discarded by the quorum
            inner.zero_grad()
            outer_step = diloco.last_outer_step
            if diloco._local_step == 0 and outer_step is not None:
                say(
                    f"[group {group}] outer step {manager.current_step()} loss {loss.item():.4f} "
                    f"participants {manager.num_participants()} committed {outer_step['committed']} "
                    f"rank {outer_step['rank']}"
                )
    m, state = diloco.state.last_step_metrics, diloco.state
    say(
        f"[rank {group}] edgc: step {m['step']} phase {m['phase']} rank {m['rank']} "
        f"sent {m['bytes_sent']} of {m['bytes_raw']} bytes"
    )
    checksum = torch.cat([t.reshape(-1) for t in diloco.state_dict()["fragments"][0]["original"]]).double().sum()
    say(
        f"[group {group}] committed {manager.current_step()} discarded {state.steps_discarded} "
        f"heals {state.heals} checksum {checksum.item().hex()}"
    )
    manager.shutdown(wait=False)


def say(line: str) -> None:
    """One line in one write: the groups share the terminal."""
    sys.stdout.write(line + "\n")
    sys.stdout.flush()


def launch(groups: int, kill_at: int) -> int:
    """A lighthouse in this process and one torchrun per group; their exit status (0 = all fine)."""
    os.environ["REPLICA_GROUPS"] = str(groups)  # quorum() reads it
    return launch_local_groups(
        __file__, groups, quorum(), lambda group: {"KILL_AT": str(kill_at if group == 1 else -1)}
    )


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--launch", type=int, metavar="GROUPS", help="start a lighthouse and GROUPS torchrun groups")
    parser.add_argument("--kill-at", type=int, default=-1, help="with --launch: kill group 1 once at this outer step")
    args = parser.parse_args()
    sys.exit(launch(args.launch, args.kill_at) if args.launch else train())
