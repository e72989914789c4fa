"""One replica group's worker for `edgc bench --torchft` (run by torchrun inside a host's namespace).

The training is edgc train's (same GPT-2 preset, data, sampler, AdamW, lr schedule, clipping and
validation blocks), with the gradient sync of one of:

* ``--mode torchft --compressor none``: torchft's own DistributedDataParallel (its defaults);
* ``--mode torchft --compressor edgc``: `edgc.integrations.torchft.DistributedDataParallel`;
* ``--mode ddp --compressor edgc``: EDGC on plain torch DDP (torchrun's process group), no torchft.

Each process writes ``<out>/group<G>.jsonl``: a ``start`` line (pid, restart count), one line per
optimizer step (wall time, step time, committed or not, participants, EDGC phase and rank) and a
``final`` line (validation loss over edgc train's validation blocks for ``--replicas`` ranks).
"""
from __future__ import annotations

import argparse
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
from edgc_train.data import BlockSampler, prepare_data, val_batches
from edgc_train.model import build_model, model_shape
from edgc_train.train import lr_lambda, make_optimizer, seed_everything


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", required=True)
    p.add_argument("--mode", choices=("torchft", "ddp"), required=True)
    p.add_argument("--compressor", choices=("none", "edgc"), required=True)
    p.add_argument("--group", type=int, default=0, help="replica group (torchft) = data shard")
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
    return p.parse_args(argv)


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
    cfg = TrainConfig(preset=args.preset, steps=args.steps, micro_batch=args.micro_batch, seq_len=args.seq_len,
                      vocab_size=args.vocab_size, eval_batches=args.eval_batches, seed=args.seed,
                      compressor="none", data=args.data, max_chars=args.max_chars)
    data = prepare_data(args.data, args.vocab_size, 0.1, args.max_chars, None, log=lambda *a, **k: None)
    seed_everything(cfg.seed)
    module = build_model(model_shape(cfg.preset, data.vocab_size, cfg.seq_len))
    optimizer = make_optimizer(module, cfg, torch.device("cpu"))
    schedule = lr_lambda(cfg)
    edgc_config = EDGCConfig(total_steps=args.steps, **json.loads(args.edgc))
    manager = None
    if args.mode == "ddp":
        dist.init_process_group("gloo", timeout=timedelta(seconds=args.timeout))
        model = torch.nn.parallel.DistributedDataParallel(module)
        state = EDGCState(None, edgc_config, model=model)
        model.register_comm_hook(state, edgc_hook)
        step_of = lambda: state.step  # noqa: E731
    else:
        from torchft import Manager, ProcessGroupGloo

        holder = {"optim": optimizer}
        manager = Manager(
            pg=ProcessGroupGloo(timeout=timedelta(seconds=args.timeout)), min_replica_size=1,
            load_state_dict=lambda s: (module.load_state_dict(s["model"]), holder["optim"].load_state_dict(s["optim"])),
            state_dict=lambda: {"model": module.state_dict(), "optim": holder["optim"].state_dict()},
            replica_id=f"group{group}", hostname=args.advertise or socket.gethostname(),
            use_async_quorum=args.compressor == "none",  # torchft's default; EDGC needs the quorum first
            timeout=timedelta(seconds=args.timeout), quorum_timeout=timedelta(seconds=3 * args.timeout))
        if args.compressor == "edgc":
            from edgc.integrations.torchft import DistributedDataParallel

            model = DistributedDataParallel(manager, module, edgc_config)
            state = model.edgc_state
        else:
            from torchft.ddp import DistributedDataParallel as TorchFTDDP

            model, state = TorchFTDDP(manager, module), None
        step_of = manager.current_step
    if manager is not None and os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") == "0":
        # Start with every group in the quorum: one that started first would train alone for a step
        # or two, and runs that should be alike would differ from their first steps on.
        deadline = time.time() + 3 * args.timeout
        manager.start_quorum()
        while manager.num_participants() < args.replicas and time.time() < deadline:
            time.sleep(0.2)
            manager.start_quorum()
    sampler = BlockSampler(data.train, cfg.seq_len, cfg.micro_batch, group, args.replicas, cfg.seed)
    attempts = 0
    while step_of() < args.steps:
        start = time.perf_counter()
        if manager is not None:
            manager.start_quorum()  # (and, for a restarted group, the heal)
        optimizer.zero_grad()
        step = step_of()
        # A fresh batch on every attempt, as from a data loader (a discarded step's gradient is kept).
        epoch, batch = divmod(step + attempts, sampler.batches_per_epoch)
        sampler.load_state_dict({**sampler.state_dict(), "epoch": epoch, "batch": batch})
        x, y = (torch.from_numpy(a) for a in sampler.next_batch())
        loss = F.cross_entropy(model(input_ids=x).logits.flatten(0, 1).float(), y.flatten())
        loss.backward()
        if cfg.grad_clip > 0:
            torch.nn.utils.clip_grad_norm_(module.parameters(), cfg.grad_clip)
        committed = manager.should_commit() if manager is not None else True
        if committed:
            # The step being applied: a group that healed this step (async quorum) knows it only now.
            applied = manager.current_step() - 1 if manager is not None else step
            for param_group in optimizer.param_groups:
                param_group["lr"] = cfg.lr * schedule(applied)
            optimizer.step()
        attempts += not committed
        metrics = state.last_step_metrics if state is not None else {}
        write(kind="step", step=step, t=time.time(), step_s=time.perf_counter() - start, committed=committed,
              loss=loss.item(), participants=manager.num_participants() if manager else None,
              phase=metrics.get("phase"), rank=metrics.get("rank"), bytes_sent=metrics.get("bytes_sent"))
    checksum = torch.cat([p.detach().reshape(-1) for p in module.parameters()]).double().sum().item()
    write(kind="final", t=time.time(), val_loss=validation_loss(module, data, cfg, args.replicas),
          checksum=checksum.hex(), heals=getattr(state, "heals", None), discarded=getattr(state, "steps_discarded", None))
    if manager is not None:
        manager.shutdown(wait=False)
    else:
        from edgc import barrier_before_exit

        barrier_before_exit()
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
