"""Pipeline × data parallelism for `edgc train --pp P`: GPT-2 split into P stages.

Process grid (`mesh.make_grid`, one DeviceMesh): a whole pipeline (replica d) and its TP ranks sit
on consecutive ranks — one host under ``torchrun --nproc_per_node P·T`` — and each stage's
data-parallel group (``mesh["dp_replicate"]``) spans the hosts, which is where gradient compression
pays. The P stages of replica d form its pipeline (``mesh["pp"]``); stage 0 and stage P−1 share the
tied word embedding. With ``--tp T`` each stage's blocks are sharded over ``mesh["tp"]`` by DTensor
(`tensor_parallel`).

One optimizer step:
1. our own pipeline schedule (1F1B or GPipe, ``batch_isend_irecv``, see `PipelineStep`) runs
   ``grad_accum`` micro-batches forward and backward; activations travel raw, activation
   gradients raw or, with ``--interstage all|cooldown``, as low-rank factors with error feedback
   per micro-batch slot (`edgc.parallel.interstage`; this changes the model's gradient, lazily: what a
   step does not send is added to the same slot's gradient next step);
2. each stage synchronises its gradients over its DP group with its compressor
   (``state.synchronize``, no DDP — DDP around a stage breaks under GPipe: its bucket rebuild asserts);
3. the tied embedding: the DP-averaged gradients of stage 0's ``wte`` and stage P−1's
   ``lm_head`` are summed over the embedding group (uncompressed), so both copies get the
   true gradient and stay identical;
4. the global gradient norm is clipped over the whole pipeline, then AdamW steps per stage.

With ``--compressor edgc``, stage 0 leads (entropy-driven rank) and the other stages follow
the DAC alignment (`edgc.parallel.pipeline.StageAligner`), which needs each stage's measured sync-time
table: every stage profiles at start-up even when r_max is given.
"""

from __future__ import annotations

import numpy as np
import torch
import torch.distributed as dist

from .model import build_model, count_parameters, model_shape
from .rank_grid import make_grid
from .runner import seed_everything
from .sampler import BlockSampler, val_batches
from .schedule import PipelineStep
from .stage import GPT2Stage
from .stage_sync import stage_metrics


class PipelineRunner:
    """`edgc train --pp P`: this rank's stage of the model; same interface as `runner.DataParallelRunner`."""

    def __init__(self, cfg, data, rank: int, world: int, device: torch.device):
        self.cfg, self.data, self.device = cfg, data, device
        self.grid = make_grid(device.type, cfg.pp, cfg.tp)
        # Stages 0 and P−1 of one replica read the same blocks (inputs and targets).
        self.sampler = BlockSampler(
            data.train, cfg.seq_len, cfg.micro_batch, self.grid.replica, self.grid.replicas, cfg.seed
        )
        seed_everything(cfg.seed)  # the full model is built identically everywhere, then cut
        self.shape = model_shape(cfg.preset, data.vocab_size, cfg.seq_len, cfg.n_layer, cfg.n_embd, cfg.n_head)
        full = build_model(self.shape, cfg.dropout)
        self.n_params = count_parameters(full)
        tp_mesh = self.grid.mesh["tp"] if cfg.tp > 1 else None
        self.module = GPT2Stage(full, self.grid.stage, self.grid.stages, tp_mesh).to(device)
        self.step = PipelineStep(cfg, self.grid, self.module, device)
        self.compressor = self.step.compressor
        tp_part = (lambda t: f"_tp{t}") if cfg.tp > 1 else (lambda t: "")
        self.shard = f"_stage{self.grid.stage}{tp_part(self.grid.tp_rank)}"
        self.saves_shard = self.grid.replica == 0
        self.shards = tuple(f"_stage{s}{tp_part(t)}" for s in range(self.grid.stages) for t in range(self.grid.tp))
        self.dp_group = self.grid.dp_group
        self.tokens_per_step = self.grid.replicas * cfg.micro_batch * cfg.grad_accum * cfg.seq_len

    def _batch(self, blocks) -> tuple[torch.Tensor, torch.Tensor]:
        x = torch.from_numpy(np.concatenate([b[0] for b in blocks])).to(self.device)
        y = torch.from_numpy(np.concatenate([b[1] for b in blocks])).to(self.device)
        return x, y

    def train_step(self) -> tuple[float | None, dict]:
        # Every stage advances the sampler so all ranks hold the same position in checkpoints.
        x, y = self._batch([self.sampler.next_batch() for _ in range(self.cfg.grad_accum)])
        loss, timing = self.step.train_step(x, y)
        stages = stage_metrics(self.step, timing)
        totals = {
            k: sum(s[k] for s in stages)
            for k in (
                "bytes_sent",
                "bytes_raw",
                "elements_sent",
                "elements_raw",
                "interstage_bytes_sent",
                "interstage_bytes_raw",
            )
        }
        # bytes of the whole pipeline (replica 0); inter-stage seconds summed over its stages
        return loss, {"stages": stages, **totals, "interstage_time_s": sum(s["interstage_s"] for s in stages)}

    def mean_loss(self, local: float | None) -> float:
        """Mean over replicas of the last stage's mean micro-batch loss."""
        loss = torch.tensor([local if self.grid.last else 0.0], dtype=torch.float64, device=self.device)
        dist.all_reduce(loss)
        return loss.item() / (self.grid.replicas * self.grid.tp)  # every TP rank of the last stage has it

    def evaluate(self) -> float:
        """Validation through the pipeline (forward only), ``grad_accum`` micro-batches at a time."""
        cfg = self.cfg
        totals = torch.zeros(2, dtype=torch.float64, device=self.device)
        chunk: list = []
        for batch in val_batches(
            self.data.val, cfg.seq_len, cfg.micro_batch, cfg.eval_batches, self.grid.replica, self.grid.replicas
        ):
            chunk.append(batch)
            if len(chunk) == cfg.grad_accum:
                x, y = self._batch(chunk)
                loss = self.step.eval_loss(x, y)
                if loss is not None:
                    totals += torch.tensor([loss * y.numel(), y.numel()], dtype=torch.float64, device=self.device)
                chunk = []
        dist.all_reduce(totals)
        return (totals[0] / totals[1]).item()
