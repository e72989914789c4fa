"""A stage's gradient sync over its data-parallel group (`StageCompressor`) and the per-stage
numbers each step logs (`stage_metrics`)."""

from __future__ import annotations

import math
import time
from typing import Any

import torch
import torch.distributed as dist

import edgc
from edgc.distributed.mesh import local_tensor
from edgc.parallel.interstage import InterStageCompressor
from edgc.parallel.pipeline import StageAligner

from .compressors import METRIC_KEYS, Compressor
from .rank_grid import Grid
from .stage import GPT2Stage
from .tensor_parallel import is_sharded


class StageCompressor(Compressor):
    """A stage's gradient sync over its DP group: ``none``, ``powersgd``, ``optimus-cc`` or ``edgc``."""

    def __init__(self, name: str, module: GPT2Stage, grid: Grid, cfg):
        self.name, self.module, self.grid = name, module, grid
        self.aligner: StageAligner | None = None
        self.replicated_bytes = 0  # --tp: bytes of the replicated parameters' raw DP all-reduce
        # The activation-gradient sender (every stage but the first) when --interstage is on.
        self.interstage = (
            InterStageCompressor(seed=cfg.seed)
            if getattr(cfg, "interstage", "off") != "off" and grid.stage > 0
            else None
        )
        mesh = grid.mesh  # the library takes mesh dimensions where it takes process groups
        compress = name in ("powersgd", "edgc") or (name == "optimus-cc" and grid.stage < cfg.selective_stages)
        if not compress:
            self.state: edgc.GradientReducer = edgc.AllReduceState(mesh["dp_replicate"], model=module)
        elif name == "edgc":
            # With TP, every shard's DP group decides as one: phases and ranks are the stage's.
            self.state = edgc.EDGCState(
                mesh["dp_replicate"],
                cfg.edgc_config,
                model=module,
                follower=grid.stage > 0,
                always_profile=grid.stages > 1,
                decision_group=grid.stage_group,
            )
            self.aligner = StageAligner(
                self.state, grid.stage, grid.stages, mesh["pp"], tp_group=mesh["tp"] if grid.tp > 1 else None
            )
        else:  # one static rank: on every stage (powersgd) or on the first k (optimus-cc)
            self.state = edgc.EDGCState(
                mesh["dp_replicate"],
                cfg.edgc_config,
                model=module,  # static for these two
                decision_group=grid.stage_group,
            )

    def synchronize(self, backward_times: list[float]) -> float:
        start = time.perf_counter()
        if self.grid.tp > 1:
            # The compressor gets this rank's TP shards; replicated parameters (LayerNorms,
            # row-parallel biases, embeddings, LM head) are averaged raw, so the TP ranks' copies
            # stay identical bit for bit (compressed, they would differ by each shard's factors).
            named = list(self.module.named_parameters())
            self.state.synchronize([(n, p) for n, p in named if is_sharded(p)])
            self.replicated_bytes = self._mean_raw([p for _, p in named if not is_sharded(p)])
        else:
            self.state.synchronize(self.module.named_parameters())
        seconds = time.perf_counter() - start
        if self.aligner is not None:
            for sample in backward_times:
                self.aligner.record_backward_time(sample)
            self.aligner.after_sync()
        return seconds

    def _mean_raw(self, parameters: list) -> int:
        """Plain all-reduce-mean of these gradients over the DP group (one flat buffer); its bytes."""
        grads = [local_tensor(p.grad) for p in parameters if p.grad is not None]  # a Replicate DTensor: its full copy
        if not grads:
            return 0
        flat = torch.cat([g.reshape(-1) for g in grads])
        dist.all_reduce(flat, group=self.grid.dp_group)
        flat /= self.grid.replicas
        offset = 0
        for g in grads:
            g.copy_(flat[offset : offset + g.numel()].view_as(g))
            offset += g.numel()
        return flat.numel() * flat.element_size()

    def entropy_rank(self) -> int | None:
        """The pipeline's entropy-driven rank (stage 0's, from the latest DAC window boundary), or
        None while stage 0 does not compress. Not this stage's own DP rank: DAC may leave a
        stage's DP sync raw because it has slack on the DP link, which says nothing about the
        inter-stage link."""
        return self.aligner.leader_rank if self.aligner is not None else None

    def step_metrics(self) -> dict[str, Any]:
        m = self.state.last_step_metrics or {}
        return {k: m.get(k) for k in METRIC_KEYS}

    def state_dict(self) -> Any:
        return {
            "state": self.state.state_dict(),
            "aligner": self.aligner.state_dict() if self.aligner else None,
            "interstage": self.interstage.state_dict() if self.interstage else None,
        }

    def load_state_dict(self, sd: Any) -> None:
        self.state.load_state_dict(sd["state"])
        if self.aligner is not None:
            self.aligner.load_state_dict(sd["aligner"])
        if self.interstage is not None and sd.get("interstage") is not None:
            self.interstage.load_state_dict(sd["interstage"], device=next(self.module.parameters()).device)


STAGE_FIELDS = (
    "rank",
    "sync_s",
    "backward_end",
    "sync_end",
    "t_b_s",
    "predicted_s",
    "budget_s",
    "at_rank_floor",
    "bytes_sent",
    "bytes_raw",
    "elements_sent",
    "elements_raw",
    "interstage_rank",
    "interstage_bytes_sent",
    "interstage_bytes_raw",
    "interstage_s",
    "interstage_wire_s",
    "interstage_compress_s",
    "forward_s",
    "backward_s",
    "pipeline_s",
)


def own_stage_values(step, timing: dict) -> list:
    """This rank's values of `STAGE_FIELDS`, in their order (None where its stage has none)."""
    grid, compressor = step.grid, step.compressor
    m = compressor.state.last_step_metrics or {}
    plan = compressor.aligner.last_plan if compressor.aligner else None
    return [
        m.get("rank"),
        timing["sync_s"],
        timing["backward_end"],
        timing["sync_end"],
        compressor.aligner.last_backward_time if compressor.aligner else None,
        plan[grid.stage].predicted if plan else None,
        plan[grid.stage].budget if plan else None,
        plan[grid.stage].at_floor if plan else None,
        (m.get("bytes_sent") or 0) + compressor.replicated_bytes,
        (m.get("bytes_raw") or 0) + compressor.replicated_bytes,
        m.get("elements_sent"),
        m.get("elements_raw"),
        step.interstage_rank,
        timing["interstage_bytes_sent"],
        timing["interstage_bytes_raw"],
        timing["interstage_s"],
        timing["interstage_wire_s"],
        timing["interstage_compress_s"],
        timing["forward_s"],
        timing["backward_s"],
        timing["pipeline_s"],
    ]


def stage_metrics(step, timing: dict) -> list[dict]:
    """``step`` (a `schedule.PipelineStep`) in numbers: each stage's for replica 0, TP rank 0 (gathered on every rank; "
    "rank 0 writes them)."""
    grid = step.grid
    mine = own_stage_values(step, timing)
    row = torch.tensor([math.nan if v is None else float(v) for v in mine], dtype=torch.float64, device=step.device)
    rows = [torch.empty_like(row) for _ in range(grid.world)]
    dist.all_gather(rows, row)
    first_backward_end = min(float(rows[grid.global_rank(s, 0, 0)][2]) for s in range(grid.stages))
    out = []
    for s in range(grid.stages):
        values = dict(zip(STAGE_FIELDS, rows[grid.global_rank(s, 0, 0)].tolist()))
        replica_ranks = {str(rows[grid.global_rank(s, d, 0)][0].item()) for d in range(grid.replicas)}
        tp_ranks = {
            str(rows[grid.global_rank(s, d, t)][0].item()) for d in range(grid.replicas) for t in range(grid.tp)
        }
        for key in ("bytes_sent", "bytes_raw", "elements_sent", "elements_raw"):  # all TP ranks' shards
            column = STAGE_FIELDS.index(key)
            values[key] = sum(float(rows[grid.global_rank(s, 0, t)][column]) for t in range(grid.tp))
        out.append(
            {
                "stage": s,
                "rank": None if math.isnan(values["rank"]) else int(values["rank"]),
                "replicas_agree": len(replica_ranks) == 1,  # every replica of the stage used this rank
                "tp_agree": len(tp_ranks) == 1,  # … and every TP rank of every replica (1 when tp = 1)
                "sync_time_s": values["sync_s"],
                # when this stage's backward ended / its sync ended, after the earliest backward end
                "backward_end_s": values["backward_end"] - first_backward_end,
                "sync_finish_s": values["sync_end"] - first_backward_end,
                "t_b_s": None if math.isnan(values["t_b_s"]) else values["t_b_s"],
                "predicted_s": None if math.isnan(values["predicted_s"]) else values["predicted_s"],
                "budget_s": None if math.isnan(values["budget_s"]) else values["budget_s"],
                # the aligned rank is the stage's r_min and still over budget (a slow link for this stage)
                "at_rank_floor": values["at_rank_floor"] == 1.0,
                # the activation gradients this stage sent to stage s − 1 (0 on stage 0); rank None = raw
                "interstage_rank": None if math.isnan(values["interstage_rank"]) else int(values["interstage_rank"]),
                **{
                    k: int(values[k]) if not math.isnan(values[k]) else 0
                    for k in (
                        "bytes_sent",
                        "bytes_raw",
                        "elements_sent",
                        "elements_raw",
                        "interstage_bytes_sent",
                        "interstage_bytes_raw",
                    )
                },
                # seconds this step (edgc.device.timing.Clock): activation-gradient exchanges and, with --interstage
                # on, their payload transfers and compress/decompress (StageLink.spans), forward and
                # backward compute summed over the micro-batches, the whole schedule
                **{
                    k: values[k]
                    for k in (
                        "interstage_s",
                        "interstage_wire_s",
                        "interstage_compress_s",
                        "forward_s",
                        "backward_s",
                        "pipeline_s",
                    )
                },
            }
        )
    return out
