"""``edgc train --moe-experts E --ep P``: the mixture-of-experts GPT (moe.py), expert parallel over the
mesh's ``ep`` dimension, its dense parameters and its experts each synced over their own group.

The mesh is (dp_replicate = world / P, pp 1, dp_shard 1, ep P, tp 1) (`edgc.distributed.mesh.init_parallel_mesh`):
consecutive P ranks (one host) split every layer's experts and exchange tokens, and the ranks with the
same ``ep`` coordinate are the expert-data-parallel replicas. After backward, the dense parameters are
synced over every rank by one state and the experts over ``mesh["dp_replicate"]`` by another, each
expert its own matrix (`edgc.distributed.experts`), both with ``synchronize`` (the Megatron-style sync after
backward: one call of the same tensors every step, so a resumed run continues bit for bit; DDP's
buckets, rebuilt after its first step, would not). Each rank's loss is the mean over its own tokens, and
the experts' state scales their gradients by 1/ep (`edgc.distributed.scaling`): the same gradients at any
ep. Compressors:

==============  ===========================================================================
``allreduce``   our uncompressed all-reduce of both groups (`edgc.AllReduceState`)
``powersgd``    PowerSGD at ``--powersgd-rank`` for both (two `edgc.EDGCState`, static)
``edgc``        EDGC for both, each state deciding its own rank over its own group
==============  ===========================================================================

Each train line carries the bytes of each group (``dense_bytes_sent`` …, ``expert_bytes_sent`` …)
beside their sums, the load-balancing loss (``aux_loss``; ``loss`` is the next-token loss alone), and the
experts' load of rank 0's tokens (``expert_max_share``: the busiest expert's share of a layer's routed
tokens; ``experts_idle``: a layer's experts that got none; both averaged over the layers).

Checkpoints: one model and optimizer file per ``ep`` rank (``model_ep{i}.pt``), written by its replica
0; each rank's compressor file holds both states. Replicas are verified before each checkpoint and at
the end: the experts over their expert-data-parallel group, the dense parameters over every rank.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from .compressors import METRIC_KEYS, Compressor
from .model import build_model, count_parameters, model_shape
from .moe import make_moe
from .rendezvous import dist_timeout
from .runner import DataParallelRunner, ShardFiles, evaluate_in_lockstep, seed_everything
from .sampler import BlockSampler

SUMMED = ("elements_sent", "elements_raw", "bytes_sent", "bytes_raw", "compress_time_s", "comm_time_s", "collectives")


def _add(a, b):
    return b if a is None else a if b is None else a + b


class MoECompressor(Compressor):
    """The dense state, over every rank, and the experts' state, over their replicas (``edp_group``)."""

    def __init__(self, name: str, model, config, edp_group):
        import edgc
        from edgc.distributed.experts import dense_parameters, expert_parameters

        self.name, self._module = name, model
        if name == "allreduce":
            self.dense = edgc.AllReduceState(None, model=model)
            self.experts = edgc.AllReduceState(edp_group, model=model)
        else:
            self.dense = edgc.EDGCState(None, config, model=model)
            self.experts = edgc.EDGCState(edp_group, config, model=model)
        self.parameters = dense_parameters, expert_parameters

    def after_backward(self) -> None:
        dense, experts = self.parameters
        self.dense.synchronize(dense(self._module))
        self.experts.synchronize(experts(self._module))

    def group_metrics(self) -> dict[str, Any]:
        """Each group's elements and bytes of the last step, as ``dense_…`` and ``expert_…``."""
        out = {}
        for prefix, state in (("dense", self.dense), ("expert", self.experts)):
            m = state.last_step_metrics
            for key in ("elements_sent", "elements_raw", "bytes_sent", "bytes_raw"):
                out[f"{prefix}_{key}"] = int(m.get(key) or 0)
            out[f"{prefix}_rank"] = m.get("rank")
        return out

    def step_metrics(self) -> dict[str, Any]:
        experts, dense = self.experts.last_step_metrics, self.dense.last_step_metrics
        groups = self.group_metrics()
        out = {k: dense.get(k, experts.get(k)) for k in METRIC_KEYS}
        for key in SUMMED:
            out[key] = _add(dense.get(key), experts.get(key))
        for key in ("elements_sent", "elements_raw", "bytes_sent", "bytes_raw"):
            out[key] = groups[f"dense_{key}"] + groups[f"expert_{key}"]
        out["comm_wait_s"] = _add(dense.get("comm_wait_s"), experts.get("comm_wait_s"))
        out["ranks"] = {**(dense.get("ranks") or {}), **(experts.get("ranks") or {})}
        out["collective_s"] = (dense.get("collective_s") or []) + (experts.get("collective_s") or [])
        return out

    def state_dict(self) -> dict:
        return {
            "format": "moe/1",
            "dense": self.dense.state_dict(),
            "experts": self.experts.state_dict(),
        }

    def load_state_dict(self, sd) -> None:
        if not isinstance(sd, dict) or sd.get("format") != "moe/1":
            raise ValueError("not a mixture-of-experts compressor state")
        self.dense.load_state_dict(sd["dense"])
        self.experts.load_state_dict(sd["experts"])


class MoERunner(DataParallelRunner):
    """`runner.DataParallelRunner` for the MoE GPT with expert parallelism (see the module docstring)."""

    def __init__(self, cfg, data, rank: int, world: int, local_rank: int, device: torch.device):
        from edgc.distributed.experts import mark_experts
        from edgc.distributed.mesh import init_parallel_mesh

        self.cfg, self.data, self.rank, self.world, self.device = cfg, data, rank, world, device
        self.mesh = init_parallel_mesh(device.type, ep=cfg.ep, timeout=dist_timeout())
        self.sampler = BlockSampler(data.train, cfg.seq_len, cfg.micro_batch, rank, world, cfg.seed)
        seed_everything(cfg.seed)  # the same dense model and the same E experts on every rank
        self.shape = model_shape(cfg.preset, data.vocab_size, cfg.seq_len, cfg.n_layer, cfg.n_embd, cfg.n_head)
        self.module = build_model(self.shape, cfg.dropout)
        ep_group = self.mesh.get_group("ep") if cfg.ep > 1 else None
        self.layers = make_moe(self.module, cfg.moe_experts, cfg.moe_top_k, ep_group)
        self.module.to(device)
        edp = self.mesh["dp_replicate"]
        for layer in self.layers:
            mark_experts(layer.experts, edp, first=layer.first, ep=cfg.ep, tokens=layer.tokens)
        self.n_params = count_parameters(self.module)
        self.compressor = MoECompressor(cfg.compressor, self.module, cfg.edgc_config, edp)
        ep_rank, replica = self.mesh["ep"].get_local_rank(), self.mesh["dp_replicate"].get_local_rank()
        self.files = ShardFiles(f"_ep{ep_rank}", replica == 0, tuple(f"_ep{i}" for i in range(cfg.ep)))
        self.dp_group = edp.get_group()  # the experts' replicas; the dense ones are verified over all ranks

    @property
    def ddp(self) -> torch.nn.Module:
        """What train_step runs forward through: no DDP, both groups synced after backward."""
        return self.module

    def train_step(self) -> tuple[float, dict]:
        """`DataParallelRunner.train_step`, each layer's token counter reset first: the model counts a step's
        tokens, the experts' state reads them (`edgc.distributed.expert_tokens`)."""
        for layer in self.layers:
            layer.tokens.zero_()
            layer.routed = torch.zeros_like(layer.routed)
        return super().train_step()

    def auxiliary_loss(self) -> torch.Tensor:
        return self.cfg.moe_aux_weight * sum(layer.aux_loss for layer in self.layers)

    def clip_gradients(self, max_norm: float) -> None:
        """Clip the whole model's gradient norm: the dense part (the same on every rank) and every expert,
        each EP rank holding others (their squares summed over the EP group), so all ranks clip alike."""
        from edgc.distributed.experts import dense_parameters, expert_parameters

        grads = [
            [p.grad for _, p in named(self.module) if p.grad is not None]
            for named in (dense_parameters, expert_parameters)
        ]
        squares = torch.stack(
            [
                torch.stack([g.float().square().sum() for g in part]).sum()
                if part
                else torch.zeros((), device=self.device)
                for part in grads
            ]
        )
        if self.cfg.ep > 1:
            dist.all_reduce(squares[1:], group=self.mesh.get_group("ep"))
        total = squares.sum().sqrt()
        scale = (max_norm / (total + 1e-6)).clamp(max=1.0)
        torch._foreach_mul_(grads[0] + grads[1], scale)

    def step_extra(self) -> dict:
        """The load-balancing loss, each group's bytes, and the experts' load of this rank's tokens, as the
        mean over layers of the busiest expert's share of the routed tokens and of the experts that got none."""
        layers = max(1, len(self.layers))
        aux = sum(float(layer.aux_loss.detach()) for layer in self.layers) / layers
        loads = [layer.routed.tolist() for layer in self.layers]
        share = sum(max(load) / max(1, sum(load)) for load in loads) / layers
        idle = sum(load.count(0) for load in loads) / layers
        return {"aux_loss": aux, "expert_max_share": share, "experts_idle": idle, **self.compressor.group_metrics()}

    def verify_replicas(self, verify) -> None:
        """The experts (and everything) over their expert-data-parallel group, the dense parameters over all."""
        from edgc.distributed.experts import dense_parameters

        verify(self.module, self.dp_group)
        verify(_Named(dense_parameters(self.module)), None)

    def evaluate(self) -> float:
        return evaluate_in_lockstep(self.module, self.data, self.cfg, self.rank, self.world, self.device)


class _Named:
    """(name, tensor) pairs seen as a module's ``state_dict()`` (what `train.verify_replicas` reads)."""

    def __init__(self, named):
        self.named = named

    def state_dict(self) -> dict:
        return dict(self.named)
