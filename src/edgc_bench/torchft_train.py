"""One replica group's worker for `edgc bench --torchft` (run by torchrun inside a host's namespace).

The training is edgc train's (same GPT-2 preset, data, sampler, AdamW, lr schedule, clipping and
validation blocks), with the gradient sync of one of:

* ``--mode torchft --compressor none``: torchft's own DistributedDataParallel (its defaults);
* ``--mode torchft --compressor edgc``: `edgc.integrations.torchft.DistributedDataParallel`;
* ``--mode ddp --compressor edgc``: EDGC on plain torch DDP (torchrun's process group), no torchft.

The quorum settings are `QuorumSettings.for_groups(--replicas, --tolerated-failures, --timeout)`,
the lighthouse's too (torchft_bench.py).

Each process writes ``<out>/group<G>.jsonl``: a ``start`` line (pid, restart count), one line per
optimizer step (wall time, step time, the step it was (after a heal), committed or not, the
quorum's participants, whether this group was one of them, whether it healed from a peer during
the step, EDGC phase and rank) and a ``final`` line (validation loss over edgc train's validation
blocks for ``--replicas`` ranks, a digest of the parameters' bytes).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import socket
import time
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F

from edgc import EDGCConfig, EDGCState, edgc_hook
from edgc_train.config import TrainConfig
from edgc_train.data import prepare_data
from edgc_train.model import build_model, model_shape
from edgc_train.sampler import BlockSampler, val_batches
from edgc_train.train import lr_lambda, make_optimizer, seed_everything


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--mode", choices=("torchft", "ddp"), required=True)
    p.add_argument("--compressor", choices=("none", "edgc"), required=True)
    add_worker_flags(p)
    return p.parse_args(argv)


def add_worker_flags(p: argparse.ArgumentParser) -> None:
    """The flags of both bench workers (this one and diloco_train.py): the log folder, the replica
    group, edgc train's training settings and the torchft timeouts."""
    p.add_argument("--out", required=True)
    p.add_argument(
        "--group",
        type=int,
        default=int(os.environ.get("REPLICA_GROUP_ID", 0)),
        help="replica group (torchft) = data shard (default: $REPLICA_GROUP_ID, as launch_local_groups sets)",
    )
    p.add_argument("--replicas", type=int, default=2, help="replica groups of the run (data shards, validation)")
    p.add_argument("--advertise", default=None, help="address peers reach this host at (torchft servers)")
    p.add_argument("--preset", default="tiny")
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("--micro-batch", type=int, default=2)
    p.add_argument("--seq-len", type=int, default=128)
    p.add_argument("--vocab-size", type=int, default=4096)
    p.add_argument("--eval-batches", type=int, default=4)
    p.add_argument("--seed", type=int, default=1337)
    p.add_argument("--data", default=None)
    p.add_argument("--max-chars", type=int, default=None)
    p.add_argument("--edgc", default="{}", help="EDGCConfig fields as JSON")
    p.add_argument("--timeout", type=float, default=60.0, help="seconds for a collective or manager call")
    p.add_argument(
        "--tolerated-failures",
        type=int,
        default=0,
        help="dead replica groups the others go on without (QuorumSettings.for_groups)",
    )


def train_config(args: argparse.Namespace) -> TrainConfig:
    """edgc train's configuration of a worker's flags (no compressor: the worker syncs itself)."""
    return TrainConfig(
        preset=args.preset,
        steps=args.steps,
        micro_batch=args.micro_batch,
        seq_len=args.seq_len,
        vocab_size=args.vocab_size,
        eval_batches=args.eval_batches,
        seed=args.seed,
        compressor="none",
        data=args.data,
        max_chars=args.max_chars,
    )


def validation_loss(model, data, cfg: TrainConfig, replicas: int) -> float:
    """edgc train's `evaluate` over all ranks' validation blocks, computed in one process."""
    model.eval()
    loss_sum, tokens = 0.0, 0
    with torch.no_grad():
        for rank in range(replicas):
            for x, y in val_batches(data.val, cfg.seq_len, cfg.micro_batch, cfg.eval_batches, rank, replicas):
                x, y = torch.from_numpy(x), torch.from_numpy(y)
                logits = model(input_ids=x).logits
                loss_sum += F.cross_entropy(logits.flatten(0, 1).float(), y.flatten(), reduction="sum").item()
                tokens += y.numel()
    model.train()
    return loss_sum / tokens


def replica_manager(
    args: argparse.Namespace, group: int, module, optimizer, heals: list, use_async_quorum: bool, init_sync: bool = True
):
    """torchft's Manager of one replica group, with `QuorumSettings.for_groups` of the flags: a heal
    loads the model and ``optimizer`` from a peer and appends the step to ``heals`` (torchft calls
    ``load_state_dict`` only to heal). ``init_sync``: torchft's heal of every group from one at
    step 0 (needless where all build the same model)."""
    from torchft import Manager, ProcessGroupGloo

    from edgc.integrations.torchft_quorum import QuorumSettings

    quorum = QuorumSettings.for_groups(args.replicas, args.tolerated_failures, timedelta(seconds=args.timeout))

    def load(state: dict) -> None:
        module.load_state_dict(state["model"])
        optimizer.load_state_dict(state["optim"])
        heals.append(manager.current_step())

    manager = Manager(
        pg=ProcessGroupGloo(timeout=quorum.timeout),
        load_state_dict=load,
        state_dict=lambda: {"model": module.state_dict(), "optim": optimizer.state_dict()},
        replica_id=f"group{group}",
        hostname=args.advertise or socket.gethostname(),
        use_async_quorum=use_async_quorum,
        init_sync=init_sync,
        **quorum.manager_kwargs(),
    )
    return manager


def torchft_sync(
    args: argparse.Namespace,
    module,
    optimizer,
    edgc_config: EDGCConfig,
    group: int,
    heals: list,
    init_sync: bool = True,
):
    """(model, EDGC state or None, manager) of one torchft replica group (`replica_manager`)."""
    # torchft's default async quorum without EDGC; EDGC needs the quorum first
    manager = replica_manager(args, group, module, optimizer, heals, args.compressor == "none", init_sync)
    if args.compressor == "edgc":
        from edgc.integrations.torchft import DistributedDataParallel

        model = DistributedDataParallel(manager, module, edgc_config)
        return model, model.edgc_state, manager
    from torchft.ddp import DistributedDataParallel as TorchFTDDP

    return TorchFTDDP(manager, module), None, manager


def wait_for_every_group(manager, replicas: int, timeout_s: float) -> None:
    """Start with every group in the quorum: one that started first would train alone for a step
    or two, and runs that should be alike would differ from their first steps on."""
    deadline = time.time() + timeout_s
    manager.start_quorum()
    while manager.num_participants() < replicas and time.time() < deadline:
        time.sleep(0.2)
        manager.start_quorum()


def main(argv: list[str] | None = None) -> None:
    args = parse(argv)
    if args.advertise:  # torchft's servers advertise socket.gethostname(): make it this namespace's address
        socket.gethostname = lambda: args.advertise  # type: ignore[assignment]
    out = Path(args.out)
    group = int(os.environ.get("RANK", 0)) if args.mode == "ddp" else args.group
    log = open(out / f"group{group}.jsonl", "a", buffering=1)

    def write(**record) -> None:
        log.write(json.dumps(record) + "\n")

    write(kind="start", pid=os.getpid(), t=time.time(), restart=int(os.environ.get("TORCHELASTIC_RESTART_COUNT", 0)))
    cfg = train_config(args)
    data = prepare_data(args.data, args.vocab_size, 0.1, args.max_chars, None, log=lambda *a, **k: None)
    seed_everything(cfg.seed)
    module = build_model(model_shape(cfg.preset, data.vocab_size, cfg.seq_len))
    optimizer = make_optimizer(module, cfg, torch.device("cpu"))
    edgc_config = EDGCConfig.from_dict({"total_steps": args.steps, **json.loads(args.edgc)})
    manager, heals = None, []
    if args.mode == "ddp":
        dist.init_process_group("gloo", timeout=timedelta(seconds=args.timeout))
        model = torch.nn.parallel.DistributedDataParallel(module)
        state = EDGCState(None, edgc_config, model=model)
        model.register_comm_hook(state, edgc_hook)
    else:
        model, state, manager = torchft_sync(args, module, optimizer, edgc_config, group, heals)
        if os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") == "0":
            wait_for_every_group(manager, args.replicas, 3 * args.timeout)
    train(model, module, optimizer, state, manager, data, cfg, group, args.replicas, heals, write)
    write(
        kind="final",
        t=time.time(),
        val_loss=validation_loss(module, data, cfg, args.replicas),
        checksum=parameter_digest(module),
        heals=getattr(state, "heals", None),
        discarded=getattr(state, "steps_discarded", None),
    )
    if manager is not None:
        manager.shutdown(wait=False)
    else:
        from edgc import barrier_before_exit

        barrier_before_exit()
        dist.destroy_process_group()


def train(
    model, module, optimizer, state, manager, data, cfg: TrainConfig, group: int, replicas: int, heals: list, write
) -> None:
    """The optimizer steps of one group, one ``step`` line each, until the run's last step is committed."""
    schedule = lr_lambda(cfg)
    step_of = manager.current_step if manager is not None else lambda: state.step
    sampler = BlockSampler(data.train, cfg.seq_len, cfg.micro_batch, group, replicas, cfg.seed)
    attempts = 0
    while step_of() < cfg.steps:
        start, heals_before = time.perf_counter(), len(heals)
        if manager is not None:
            manager.start_quorum()  # (and, for a restarted group, the heal)
        step, committed, loss = sync_step(
            model, module, optimizer, manager, sampler, cfg, schedule, step_of(), attempts
        )
        attempts += not committed
        metrics = state.last_step_metrics if state is not None else {}
        write(
            kind="step",
            step=step,
            t=time.time(),
            step_s=time.perf_counter() - start,
            committed=committed,
            loss=loss,
            participants=manager.num_participants() if manager else None,
            participating=manager.participating_rank() is not None if manager else True,
            healed=any(h > 0 for h in heals[heals_before:]),  # at step 0: the initial weight sync
            phase=metrics.get("phase"),
            rank=metrics.get("rank"),
            bytes_sent=metrics.get("bytes_sent"),
        )


def sync_step(
    model, module, optimizer, manager, sampler: BlockSampler, cfg: TrainConfig, schedule, step: int, attempts: int
) -> tuple[int, bool, float]:
    """One optimizer step of a group at ``step`` (after ``manager.start_quorum()``): forward, backward
    and clipping on a fresh batch for every attempt, as from a data loader (a discarded step's gradient
    is kept); the optimizer steps if the manager (None: plain DDP) commits. (The step this attempt
    was, committed, the training loss.)"""
    optimizer.zero_grad()
    x, y = batch(sampler, step + attempts)
    loss = forward_backward(model, module, x, y, cfg)
    committed = manager.should_commit() if manager is not None else True
    # The step this attempt was: a group that healed during it (async quorum) knows it only now.
    step = manager.current_step() - committed if manager is not None else step
    if committed:
        for param_group in optimizer.param_groups:
            param_group["lr"] = cfg.lr * schedule(step)
        optimizer.step()
    return step, committed, loss


def batch(sampler: BlockSampler, index: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The sampler's ``index``-th batch of the run (across epochs)."""
    epoch, position = divmod(index, sampler.batches_per_epoch)
    sampler.load_state_dict({**sampler.state_dict(), "epoch": epoch, "batch": position})
    return tuple(torch.from_numpy(a) for a in sampler.next_batch())


def forward_backward(model, module, x, y, cfg: TrainConfig) -> float:
    """The training loss of ``model`` on (x, y), its gradients in ``module``, clipped as edgc train's."""
    loss = F.cross_entropy(model(input_ids=x).logits.flatten(0, 1).float(), y.flatten())
    loss.backward()
    if cfg.grad_clip > 0:
        torch.nn.utils.clip_grad_norm_(module.parameters(), cfg.grad_clip)
    return loss.item()


def parameter_digest(module: torch.nn.Module) -> str:
    """Equal exactly when the parameters are bit-identical."""
    digest = hashlib.sha256()
    for parameter in module.parameters():
        digest.update(parameter.detach().contiguous().numpy().tobytes())
    return digest.hexdigest()


if __name__ == "__main__":
    main()
