"""Runs of the diloco experiment: ``replicas`` processes on gloo (127.0.0.1) training DiLoCo
(`edgc.integrations.diloco.DiLoCo`, the plain process group) with one arm's outer sync per run.

Each replica is `edgc train`'s single-process training (data, model, AdamW, LR schedule, clipping)
on its own shard of the data (`BlockSampler`, rank r of R), as its inner loop; every ``sync_every``
inner steps the outer step averages the pseudo-gradients through EDGC (or uncompressed: every
matrix sent raw, by a compression rate nothing meets) and Nesterov SGD steps the global weights.
Rank 0 reports the validation loss over the whole validation split after the last outer step, the
bytes one replica sent, and per outer step the rank, the bytes and the relative compression error
‖M − Ĝ‖/‖M‖ (with the error feedback's norm against the pseudo-gradient's, ‖e‖/‖Δ‖). A
``per_step`` arm is per-step EDGC instead: every step's gradients averaged at ``rank``, one AdamW.
"""

from __future__ import annotations

import json
import math
import os
import socket
import tempfile
import time
from datetime import timedelta
from pathlib import Path
from typing import Any

from edgc.integrations import torchft_adapter

# DiLoCo's outer learning rate (Douillard et al., 2023) with less than its 0.9 Nesterov momentum:
# at tens of inner steps per outer step and rank 2, 0.9 ended 0.66 nats worse than 0.5 (one seed, 160 steps).
OUTER_LR, OUTER_MOMENTUM = 0.7, 0.5
UNCOMPRESSED = 1e12  # a compression rate no matrix meets: everything is sent raw


def arm_config(arm: dict, outer_steps: int) -> dict:
    """The `EDGCConfig` fields of an arm (`EDGCConfig.from_dict`'s): a static rank from the first outer step, or
    none at all."""
    fields = dict(
        total_steps=max(1, outer_steps),
        warmup_fraction=0.0,
        min_warmup_steps=0,
        warmup_error_test=False,
        iteration_sample_ratio=1.0,
        window=1,
    )
    if arm.get("rank") is None:
        return {**fields, "r_max": 1, "r_min": 1, "adaptive": False, "engine": {"min_compression_rate": UNCOMPRESSED}}
    return {**fields, "r_max": arm["rank"], "r_min": arm["rank"], "adaptive": False, **arm.get("edgc", {})}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def train_runs(
    setting, arms: list[dict], seed: int, replicas: int = 2, timeout_s: float = 3600, shape: dict | None = None
) -> list[dict]:
    """Train each of ``arms`` (``sync_every``, ``rank`` (None: uncompressed), optional ``power_iterations``,
    ``outer_lr``, ``outer_momentum``, ``per_step``, ``edgc``) at ``seed``, one after the other in the
    same ``replicas`` processes (their start-up costs as much as a short run); rank 0's reports.
    ``shape``: `TrainConfig` model fields over the preset's (``n_layer``, ``n_embd``, ``n_head``)."""
    return run_replicas(
        _worker, (setting, arms, seed), (shape or {},), replicas, timeout_s, f"diloco runs at seed {seed}"
    )


def run_replicas(worker, before: tuple, after: tuple, replicas: int, timeout_s: float, what: str):
    """``worker(rank, replicas, port, *before, out, *after)`` in ``replicas`` spawned processes (gloo on a
    free port); what rank 0 wrote to ``out`` (JSON). ``what`` names the runs in the error if one fails."""
    import torch.multiprocessing as mp

    with tempfile.TemporaryDirectory(prefix="edgc-diloco-") as tmp:
        out = Path(tmp) / "result.json"
        context = mp.get_context("spawn")
        port = free_port()
        processes = [
            context.Process(target=worker, args=(rank, replicas, port, *before, str(out), *after))
            for rank in range(replicas)
        ]
        for p in processes:
            p.start()
        deadline = time.monotonic() + timeout_s
        for p in processes:
            p.join(max(1.0, deadline - time.monotonic()))
        alive = [p for p in processes if p.is_alive()]
        for p in alive:
            p.kill()
        codes = [p.exitcode for p in processes]
        if alive or any(codes) or not out.exists():
            raise RuntimeError(f"{what} failed (exit codes {codes}{', timed out' if alive else ''})")
        return json.loads(out.read_text())


def _worker(rank: int, world: int, port: int, setting, arms: list[dict], seed: int, out: str, shape: dict) -> None:
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world, timeout=timedelta(seconds=300))
    try:
        results = [_train(rank, world, setting, arm, seed, shape) for arm in arms]
        if rank == 0:
            Path(out).write_text(json.dumps(results))
    finally:
        dist.barrier()
        dist.destroy_process_group()


def _train(rank: int, world: int, setting, arm: dict, seed: int, shape: dict) -> dict[str, Any]:
    import torch

    from edgc_train.data import prepare_data
    from edgc_train.model import build_model, model_shape
    from edgc_train.runner import seed_everything
    from edgc_train.sampler import BlockSampler
    from edgc_train.train import lr_lambda, make_optimizer

    from .pareto_train import validation_loss

    cfg = setting.train_config(seed=seed, **shape)
    data = prepare_data(cfg.data, cfg.vocab_size, cfg.val_fraction, cfg.max_chars, cfg.cache_dir, log=lambda _: None)
    sampler = BlockSampler(data.train, cfg.seq_len, cfg.micro_batch, rank, world, cfg.seed)
    seed_everything(cfg.seed)
    model = build_model(
        model_shape(cfg.preset, data.vocab_size, cfg.seq_len, cfg.n_layer, cfg.n_embd, cfg.n_head), cfg.dropout
    )
    inner = make_optimizer(model, cfg, torch.device("cpu"))
    schedule = torch.optim.lr_scheduler.LambdaLR(inner, lr_lambda(cfg))
    start = time.perf_counter()
    loop = _per_step if arm.get("per_step") else _diloco
    result = loop(model, inner, schedule, sampler, cfg, arm, seed)
    result["wall_s"] = time.perf_counter() - start
    result["val_loss"] = validation_loss(model, data, cfg.seq_len, cfg.micro_batch) if rank == 0 else None
    return result


def _loss(model, sampler):
    import torch
    import torch.nn.functional as F

    x, y = sampler.next_batch()
    logits = model(input_ids=torch.from_numpy(x)).logits
    return F.cross_entropy(logits.flatten(0, 1).float(), torch.from_numpy(y).flatten())


def _diloco(model, inner, schedule, sampler, cfg, arm: dict, seed: int) -> dict:
    """DiLoCo: ``sync_every`` inner steps per outer step, the pseudo-gradients averaged through EDGC."""
    import torch

    from edgc import EDGCConfig
    from edgc.integrations.diloco import DiLoCo

    momentum = arm.get("outer_momentum", OUTER_MOMENTUM)
    outer = torch.optim.SGD(
        model.parameters(), lr=arm.get("outer_lr", OUTER_LR), momentum=momentum, nesterov=momentum > 0
    )
    sync_every = int(arm["sync_every"])
    outer_steps = cfg.steps // sync_every
    config = EDGCConfig.from_dict(arm_config(arm, outer_steps))
    diloco = DiLoCo(None, [model], inner, outer, sync_every, config, power_iterations=arm.get("power_iterations", 1))
    outer_log = []
    with diloco:
        for _ in range(outer_steps * sync_every):
            loss = _loss(model, sampler)
            loss.backward()
            if cfg.grad_clip > 0:
                torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.grad_clip)
            due = torchft_adapter.local_step(diloco) == sync_every - 1
            feedback = feedback_ratio(diloco) if due else None  # before the outer step's sync
            inner.step()  # every sync_every-th: the outer step
            schedule.step()
            inner.zero_grad(set_to_none=True)
            if due:
                outer_log.append(
                    {**diloco.last_outer_step, "error_feedback": feedback, "train_loss": float(loss.detach())}
                )
            if not math.isfinite(float(loss.detach())):
                raise FloatingPointError(
                    f"diverged at inner step {diloco.state.step * sync_every} ({arm}, seed {seed})"
                )
    sent = diloco.state.totals["bytes_sent"]
    return {
        "bytes": sent,
        "bytes_per_outer_step": sent / max(1, outer_steps),
        "outer_steps": outer_steps,
        "outer": outer_log,
    }


def _per_step(model, inner, schedule, sampler, cfg, arm: dict, seed: int) -> dict:
    """Per-step EDGC for comparison: every step's gradients averaged through EDGC at ``rank`` (as the
    DDP hook does), before clipping and one AdamW step that every replica takes alike."""
    import torch

    from edgc import EDGCConfig
    from edgc.state import EDGCState

    state = EDGCState(None, EDGCConfig.from_dict(arm_config(arm, cfg.steps)), model=model)
    named = [(name, p) for name, p in model.named_parameters() if p.requires_grad]
    errors = []
    for step in range(cfg.steps):
        loss = _loss(model, sampler)
        loss.backward()
        state.reduce_tensors([n for n, _ in named], [p.grad for _, p in named], last=True)
        if cfg.grad_clip > 0:
            torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.grad_clip)
        inner.step()
        schedule.step()
        inner.zero_grad(set_to_none=True)
        errors.append(state.last_step_metrics.get("relative_error"))
        if not math.isfinite(float(loss.detach())):
            raise FloatingPointError(f"diverged at step {step} ({arm}, seed {seed})")
    sent = state.totals["bytes_sent"]
    outer = [{"rank": arm.get("rank"), "relative_error": e} for e in errors[-1:]]
    return {"bytes": sent, "bytes_per_outer_step": sent / cfg.steps, "outer_steps": cfg.steps, "outer": outer}


def feedback_ratio(diloco) -> float | None:
    """‖e‖/‖Δ‖ over the compressed matrices, just before an outer step: how much the error feedback
    holds against what the outer step brings (Δ = θ_global − θ, the inner step not yet taken)."""
    import torch

    errors = diloco.state.compressor.error
    if not errors:
        return None
    feedback = math.sqrt(sum(float(torch.dot(e.reshape(-1), e.reshape(-1))) for e in errors.values()))
    fragment = torchft_adapter.fragments(diloco)[0]
    delta = math.sqrt(
        sum(
            float((b - p.detach()).square().sum())
            for name, b, p in zip(fragment.names, fragment.original, fragment.params)
            if name in errors
        )
        or 0.0
    )
    return feedback / delta if delta > 0 else None
