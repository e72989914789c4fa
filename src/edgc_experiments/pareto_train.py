"""One training run of the pareto instrument: one process, the library's compressor, the whole validation split.

The run is `edgc train`'s single-process training (same data, model, optimizer, LR schedule and
seeds) with its gradients averaged by ``EDGCState.synchronize`` in a world of one process: the
compressor, its error feedback, its Q factors and its controller do exactly what they do in a
group, and a "mean" over one process is the identity, so the run measures what compression
costs the model and nothing else. Bytes are what the compressor would send per process, counted
after the shared warm-up (`EDGCState.totals` after minus before it).
"""

from __future__ import annotations

import math
import time
from typing import Any


def validation_loss(model, data, seq_len: int, micro_batch: int) -> float:
    """Mean next-token loss over every block of the validation split."""
    import torch
    import torch.nn.functional as F

    from edgc_train.sampler import val_batches

    model.eval()
    total, tokens = 0.0, 0
    with torch.no_grad():
        for x, y in val_batches(data.val, seq_len, micro_batch, 1 << 30, 0, 1):
            logits = model(input_ids=torch.from_numpy(x)).logits
            y = torch.from_numpy(y)
            total += float(F.cross_entropy(logits.flatten(0, 1).float(), y.flatten(), reduction="sum"))
            tokens += y.numel()
    model.train()
    return total / tokens


INSTRUMENT_FIELDS = (
    "cold_start",
    "shadow_ranks",
    "shadow_twin",
)  # an arm's fields that are the instrument's, not EDGCConfig's


def compressor_fields(fields: dict[str, Any]) -> dict[str, Any]:
    """An arm's `EDGCConfig` fields: its fields without the instrument's own (`INSTRUMENT_FIELDS`)."""
    return {k: v for k, v in fields.items() if k not in INSTRUMENT_FIELDS}


def redraw_q(q: dict, seed: int, step: int) -> None:
    """Replace every stored Q by Gaussian columns of the same shape (the compressor orthonormalises them)."""
    import torch

    generator = torch.Generator().manual_seed(seed * 1_000_003 + step)
    for name in sorted(q):
        q[name] = torch.randn(q[name].shape, generator=generator, dtype=q[name].dtype)


def train_run(setting, config_fields: dict[str, Any], seed: int) -> dict:
    """Train ``setting`` with an `EDGCConfig` of ``config_fields`` at ``seed``: final validation loss,
    bytes after the warm-up, mean rank, rank schedule, decisions taken and wall time.

    ``config_fields`` may also hold the instrument's own ``cold_start: True``: every step starts
    the power iteration from a newly drawn Q instead of the last step's (no warm start); and
    ``shadow_ranks``: never-resized power iterations at these ranks follow the run's matrices
    (`change_cost.Shadows`; ``shadow_twin``: 'run', from the run's own first Q, or 'independent',
    the default), and the result's ``shadow`` holds their errors beside the run's."""
    import torch
    import torch.nn.functional as F

    from edgc import EDGCConfig, EDGCState
    from edgc.control.budget import spent_rank_steps
    from edgc_train.data import prepare_data
    from edgc_train.model import build_model, model_shape
    from edgc_train.runner import seed_everything
    from edgc_train.sampler import BlockSampler
    from edgc_train.train import lr_lambda, make_optimizer

    from .change_cost import Shadows, shadow_record

    torch.set_num_threads(1)
    cfg = setting.train_config(seed=seed)
    data = prepare_data(cfg.data, cfg.vocab_size, cfg.val_fraction, cfg.max_chars, cfg.cache_dir, log=lambda _: None)
    sampler = BlockSampler(data.train, cfg.seq_len, cfg.micro_batch, 0, 1, cfg.seed)
    seed_everything(cfg.seed)
    model = build_model(
        model_shape(cfg.preset, data.vocab_size, cfg.seq_len, cfg.n_layer, cfg.n_embd, cfg.n_head), cfg.dropout
    )
    optimizer = make_optimizer(model, cfg, torch.device("cpu"))
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lr_lambda(cfg))
    seed_everything(cfg.seed + 1)
    cold_start = bool(config_fields.get("cold_start", False))
    state = EDGCState(None, EDGCConfig.from_dict(compressor_fields(config_fields)), model=model)
    named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    shadows = (
        Shadows(state.compressor, config_fields["shadow_ranks"], config_fields.get("shadow_twin", "independent"))
        if config_fields.get("shadow_ranks")
        else None
    )
    start, bytes_at_warmup_end, decisions = time.perf_counter(), None, 0
    for _ in range(cfg.steps):
        x, y = sampler.next_batch()
        loss = F.cross_entropy(
            model(input_ids=torch.from_numpy(x)).logits.flatten(0, 1).float(), torch.from_numpy(y).flatten()
        )
        loss.backward()
        if cold_start:
            redraw_q(state.compressor.q, seed, state.step)
        if shadows is not None:
            shadows.before_sync(named)
        state.synchronize(named)
        metrics = state.last_step_metrics
        if shadows is not None and metrics["phase"] == "compress":
            shadows.after_sync(named, metrics["step"], metrics["rank"])
        if cfg.grad_clip > 0:
            torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.grad_clip)
        optimizer.step()
        scheduler.step()
        optimizer.zero_grad(set_to_none=True)
        if metrics["phase"] == "compress" and bytes_at_warmup_end is None:
            bytes_at_warmup_end = state.totals["bytes_sent"] - metrics["bytes_sent"]
        decisions += metrics.get("decision") is not None
        if not math.isfinite(float(loss.detach())):
            raise FloatingPointError(f"training diverged at step {state.step} (seed {seed}, {config_fields})")
    schedule = [(int(s), int(r)) for s, r in state.controller.schedule]
    spent, steps_done = spent_rank_steps(schedule, cfg.steps)
    return {
        "val_loss": validation_loss(model, data, cfg.seq_len, cfg.micro_batch),
        "bytes": state.totals["bytes_sent"] - (bytes_at_warmup_end or 0),
        "mean_rank": spent / steps_done if steps_done else None,
        "rank_changes": max(0, len(schedule) - 1),
        "schedule": schedule,
        "wall_s": time.perf_counter() - start,
        "decisions": decisions,
        **({"shadow": shadow_record(shadows)} if shadows is not None else {}),
    }
