"""The runner interface and its data-parallel runner (DDP), beneath train.py: fsdp.py and pipeline.py
build their runners on what is here, train.py picks one (`train.make_runner`) and runs the loop.

A runner holds ``module`` (the parameters this rank trains), ``compressor``, ``sampler``,
``train_step()``, ``mean_loss()``, ``evaluate()``, the checkpoint shard this rank writes (``shard``,
``saves_shard``, ``shards``) and the group of its data-parallel replicas (``dp_group``, None = all ranks).
"""

from __future__ import annotations

import contextlib
import random
from dataclasses import dataclass

import numpy as np
import torch
import torch.distributed as dist
import torch.nn.functional as F

from .compressors import build as build_compressor
from .compressors import ddp_kwargs
from .config import TrainConfig
from .model import build_model, count_parameters, model_shape
from .sampler import BlockSampler, val_batches


def seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


@dataclass(frozen=True)
class ShardFiles:
    """The checkpoint files of a runner's model and optimizer state: this rank's shard's suffix,
    whether this rank writes them (one rank per shard), and every shard's suffix (a checkpoint is
    complete when each is there)."""

    mine: str
    saves: bool
    every: tuple[str, ...]


@torch.no_grad()
def evaluate(model: torch.nn.Module, data, cfg: TrainConfig, rank: int, world: int, device: torch.device) -> float:
    """Mean next-token loss over the fixed validation blocks, averaged over all ranks' tokens."""
    model.eval()
    totals = torch.zeros(2, dtype=torch.float64, device=device)  # (sum of losses, tokens)
    for x, y in val_batches(data.val, cfg.seq_len, cfg.micro_batch, cfg.eval_batches, rank, world):
        x, y = torch.from_numpy(x).to(device), torch.from_numpy(y).to(device)
        logits = model(input_ids=x).logits
        totals[0] += F.cross_entropy(logits.flatten(0, 1).float(), y.flatten(), reduction="sum").double()
        totals[1] += y.numel()
    dist.all_reduce(totals)
    model.train()
    return (totals[0] / totals[1]).item()


class DataParallelRunner:
    """The whole model on every rank, wrapped in DDP; gradients synchronised by the compressor's hook."""

    def __init__(self, cfg: TrainConfig, data, rank: int, world: int, local_rank: int, device: torch.device):
        self.cfg, self.data, self.rank, self.world, self.device = cfg, data, rank, world, device
        self.sampler = BlockSampler(data.train, cfg.seq_len, cfg.micro_batch, rank, world, cfg.seed)
        seed_everything(cfg.seed)  # same init on every rank (DDP also broadcasts rank 0's weights)
        self.shape = model_shape(cfg.preset, data.vocab_size, cfg.seq_len, cfg.n_layer, cfg.n_embd, cfg.n_head)
        self.module = build_model(self.shape, cfg.dropout).to(device)
        self.n_params = count_parameters(self.module)
        self.ddp = torch.nn.parallel.DistributedDataParallel(
            self.module, device_ids=[local_rank] if device.type == "cuda" else None, **ddp_kwargs(cfg.compressor)
        )
        self.compressor = build_compressor(cfg.compressor, self.ddp, cfg)
        self.files = ShardFiles("", rank == 0, ("",))
        self.dp_group = None  # every rank is a replica

    @property
    def shard(self) -> str:
        return self.files.mine

    @property
    def saves_shard(self) -> bool:
        return self.files.saves

    @property
    def shards(self) -> tuple[str, ...]:
        return self.files.every

    @property
    def tokens_per_step(self) -> int:
        return self.world * self.cfg.micro_batch * self.cfg.grad_accum * self.cfg.seq_len

    def train_step(self) -> tuple[float, dict]:
        """Forward/backward over grad_accum micro-batches (synchronised on the last), then clip.
        Returns this rank's mean micro-batch loss and extra metrics for the train line."""
        cfg, loss_sum = self.cfg, 0.0
        for micro in range(cfg.grad_accum):
            x, y = self.sampler.next_batch()
            x, y = torch.from_numpy(x).to(self.device), torch.from_numpy(y).to(self.device)
            # Gradients are synchronised (the hook runs) only on the last micro-batch.
            with self.sync_context(micro == cfg.grad_accum - 1):
                logits = self.ddp(input_ids=x).logits
                loss = F.cross_entropy(logits.flatten(0, 1).float(), y.flatten())
                ((loss + self.auxiliary_loss()) / cfg.grad_accum).backward()
            loss_sum += loss.item()
        self.compressor.after_backward()
        if cfg.grad_clip > 0:
            self.clip_gradients(cfg.grad_clip)
        return loss_sum / cfg.grad_accum, self.step_extra()

    def clip_gradients(self, max_norm: float) -> None:
        """Clip the global gradient norm (every rank holds the whole model: its own norm is the global one)."""
        torch.nn.utils.clip_grad_norm_(self.module.parameters(), max_norm)

    def auxiliary_loss(self) -> torch.Tensor | float:
        """What the last forward adds to the loss it trains on besides the next-token loss (logged alone)."""
        return 0.0

    def step_extra(self) -> dict:
        """Extra fields of the step's train line."""
        return {}

    def sync_context(self, sync: bool):
        """Where the micro-batch's backward runs: with or without the gradient sync."""
        return contextlib.nullcontext() if sync else self.ddp.no_sync()

    def mean_loss(self, local: float | None) -> float:
        """The logged loss: the mean over all ranks' micro-batches (one scalar all-reduce, untimed)."""
        loss = torch.tensor([local], dtype=torch.float64, device=self.device)
        dist.all_reduce(loss)
        return loss.item() / self.world

    def evaluate(self) -> float:
        return evaluate(self.module, self.data, self.cfg, self.rank, self.world, self.device)


@torch.no_grad()
def evaluate_in_lockstep(model: torch.nn.Module, data, cfg: TrainConfig, rank: int, world: int, device) -> float:
    """As `evaluate`, but every rank runs the same number of forwards (FSDP all-gathers, an MoE layer
    exchanges tokens in each): a rank with fewer validation blocks repeats its last batch and does not
    count it."""
    model.eval()
    mine = list(val_batches(data.val, cfg.seq_len, cfg.micro_batch, cfg.eval_batches, rank, world))
    count = torch.tensor([len(mine)], device=device)
    dist.all_reduce(count, op=dist.ReduceOp.MAX)
    totals = torch.zeros(2, dtype=torch.float64, device=device)
    for i in range(int(count)):
        x, y = mine[min(i, len(mine) - 1)]
        x, y = torch.from_numpy(x).to(device), torch.from_numpy(y).to(device)
        logits = model(input_ids=x).logits
        if i < len(mine):
            totals[0] += F.cross_entropy(logits.flatten(0, 1).float(), y.flatten(), reduction="sum").double()
            totals[1] += y.numel()
    dist.all_reduce(totals)
    model.train()
    return (totals[0] / totals[1]).item()
