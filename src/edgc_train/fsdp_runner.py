"""``edgc train --fsdp``: GPT-2 with FSDP2 as HSDP, the replica all-reduce compressed by `edgc.parallel.fsdp`.

Ranks form a (replicas × shard) grid: consecutive ``--fsdp-shard`` ranks (one host) shard every
transformer block and the root (embeddings, final LayerNorm, tied head) with ``fully_shard`` on the
shard dimension; ranks with the same shard index on different hosts are replicas, and the
compressor (``allreduce``, ``powersgd`` or ``edgc``) averages their gradient shards over that
replicate group from FSDP's all-reduce hook. ``none`` is native HSDP: ``fully_shard`` on the 2-D
(replicate, shard) mesh with no hook, FSDP's own replica all-reduce, the reference every ratio is
against. Every rank reads its own data (FSDP is data parallel).

Checkpoints: one model and optimizer file per shard index (``model_shard{s}.pt``), written by
replica 0 of that shard, holding this shard's local tensors (plain tensors, no DTensor or mesh in
the file; `checkpoint.model_and_optimizer_state`); resume wraps them back into the parameters' DTensors. The
compressor's state (error
feedback per local shard, Q, schedule) is per rank as for DDP.
"""

from __future__ import annotations

import contextlib
import os

import torch
from torch.distributed.fsdp import fully_shard

from .compressors import Compressor, EngineCompressor
from .model import build_model, count_parameters, model_shape
from .rendezvous import dist_timeout
from .runner import DataParallelRunner, ShardFiles, evaluate_in_lockstep
from .sampler import BlockSampler


def shard_degree(cfg, world: int) -> int:
    """``--fsdp-shard``, or the processes per host (torchrun's LOCAL_WORLD_SIZE) when 0."""
    shard = cfg.fsdp_shard or int(os.environ.get("LOCAL_WORLD_SIZE", world))
    if world % shard:
        raise ValueError(f"--fsdp-shard {shard} does not divide the world size {world}")
    return shard


class NativeHSDP(Compressor):
    """``none``: FSDP2 on the 2-D mesh with no hook, i.e. HSDP's own replica all-reduce (what users
    run). Bytes are this rank's gradient shard; times are not separable from FSDP's."""

    name = "none"

    def __init__(self, model):
        self.elements = sum(p.to_local().numel() for p in model.parameters() if p.requires_grad)
        self.size = self.elements * next(model.parameters()).element_size()

    def step_metrics(self) -> dict:
        return {
            "phase": "off",
            "rank": None,
            "ranks": {},
            "entropy": None,
            "elements_sent": self.elements,
            "elements_raw": self.elements,
            "bytes_sent": self.size,
            "bytes_raw": self.size,
            "compress_time_s": None,
            "comm_time_s": None,
            "collectives": None,
            "collective_s": None,
            "relative_error": None,
            "entropy_time_s": None,
        }

    def state_dict(self) -> dict:
        return {"format": "native-hsdp/1"}

    def load_state_dict(self, sd) -> None:
        if not isinstance(sd, dict) or sd.get("format") != "native-hsdp/1":
            raise ValueError("not a native HSDP compressor state")


class FSDPCompressor(EngineCompressor):
    """``allreduce`` / ``powersgd`` / ``edgc`` on the replicate group, registered as FSDP's all-reduce hook."""

    def __init__(self, name: str, model, config, replicate_group):  # a group or a mesh dimension
        import edgc
        from edgc.parallel.fsdp import register_fsdp_comm_hook

        self.name = name
        if name == "allreduce":
            self.state = edgc.AllReduceState(process_group=replicate_group)
        else:
            self.state = edgc.EDGCState(process_group=replicate_group, config=config)
        self.hook = register_fsdp_comm_hook(model, self.state)


class FSDPRunner(DataParallelRunner):
    """`runner.DataParallelRunner` for HSDP: its training step, with FSDP's own sync switch."""

    def __init__(self, cfg, data, rank: int, world: int, local_rank: int, device: torch.device):
        from edgc.distributed.mesh import init_parallel_mesh

        self.cfg, self.data, self.rank, self.world, self.device = cfg, data, rank, world, device
        shard = shard_degree(cfg, world)
        # the run's mesh (pp = tp = 1); its (dp_replicate, dp_shard) part is HSDP's
        self.mesh = init_parallel_mesh(device.type, dp_shard=shard, timeout=dist_timeout())["dp_replicate", "dp_shard"]
        self.sampler = BlockSampler(data.train, cfg.seq_len, cfg.micro_batch, rank, world, cfg.seed)
        torch.manual_seed(cfg.seed)  # the same full model on every rank before sharding
        self.shape = model_shape(cfg.preset, data.vocab_size, cfg.seq_len, cfg.n_layer, cfg.n_embd, cfg.n_head)
        self.module = build_model(self.shape, cfg.dropout).to(device)
        self.n_params = count_parameters(self.module)
        # none: HSDP on the 2-D mesh, FSDP's own replica all-reduce. Otherwise the model is sharded
        # on the shard dimension only and the hook averages over the replicate group.
        native = cfg.compressor == "none"
        mesh = self.mesh if native else self.mesh["dp_shard"]
        for block in self.module.transformer.h:
            fully_shard(block, mesh=mesh)
        fully_shard(self.module, mesh=mesh)
        self.dp_group = self.mesh.get_group("dp_replicate")
        if native:
            self.compressor = NativeHSDP(self.module)
        else:
            self.compressor = FSDPCompressor(cfg.compressor, self.module, cfg.edgc_config, self.mesh["dp_replicate"])
        self.files = ShardFiles(
            f"_shard{self.mesh['dp_shard'].get_local_rank()}",
            self.mesh["dp_replicate"].get_local_rank() == 0,
            tuple(f"_shard{s}" for s in range(shard)),
        )

    @property
    def ddp(self) -> torch.nn.Module:
        """What train_step runs forward through: the sharded model itself."""
        return self.module

    def sync_context(self, sync: bool):
        # Reduce-scatter and the replica sync (the hook) only on the last micro-batch.
        self.module.set_requires_gradient_sync(sync)
        return contextlib.nullcontext()

    def evaluate(self) -> float:
        return evaluate_in_lockstep(self.module, self.data, self.cfg, self.rank, self.world, self.device)
