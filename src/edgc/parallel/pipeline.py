"""DAC across pipeline stages: one `EDGCState` per stage, ranks aligned every window.

Usage, on every rank of a pipeline-parallel × data-parallel job (one DP group per stage, one
pipeline group per DP index):

    state = EDGCState(dp_group, config, model=stage_module,
                      follower=stage > 0, always_profile=True)
    aligner = StageAligner(state, stage, n_stages, pipeline_group)
    ... per micro-batch backward: aligner.record_backward_time(seconds)
    ... after the pipeline step:  state.synchronize(stage_module.named_parameters()); aligner.after_sync()

Stage 0 leads: its entropy series chooses its rank (and its warm-up decides when compression
starts). At each window boundary every stage shares, over its pipeline group, its measured
sync-time table, its r_min/r_max and its mean micro-batch backward time t_b; each stage then
applies `edgc.control.alignment.align_stage_ranks` to the same numbers, the replicas of a stage (and,
with tensor parallelism, its TP ranks: ``tp_group``) agree on the maximum (least compression),
and the followers adopt the result from the next step. With ``tp_group``, stage 0's TP ranks
also adopt the maximum of their entropy-driven ranks at each boundary, before the exchange. A
stage whose TP shards should also profile, warm up and change rank at the same steps builds its
state with ``EDGCState(..., decision_group=group_across(mesh, ("dp_replicate", "tp")))``, as
`edgc train --tp` does; the maxima over ``tp_group`` then change nothing.
Followers start compressing at the first window boundary after stage 0 does.

Boundaries depend only on the step number, so every rank joins every collective.
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist

from ..control.alignment import StageRank, StageTiming, align_stage_ranks
from ..control.profiling import SyncTimeTable, profile_candidates
from ..device.timing import host_reads_allowed, to_device, to_host
from ..distributed.comm import Communicator
from ..distributed.mesh import as_process_group
from ..policies.plans import COMPRESS, PHASES
from ..state import EDGCState


class StageAligner:
    """Aligns the ranks of one pipeline stage with the others' at every window boundary (see the
    module docstring): call `record_backward_time` per micro-batch and `after_sync` per step.

    ``state``: this stage's `EDGCState` (``follower=True`` after stage 0, ``always_profile=True``);
    ``stage``, ``n_stages``: this stage's index and the stage count; ``pipeline_group``: the group of
    this DP index's stages (None: the default group); ``granularity``: stage ranks are multiples of
    it; ``tp_group``: with tensor parallelism, the TP ranks of this stage (they agree on the maximum).
    """

    def __init__(
        self, state: EDGCState, stage: int, n_stages: int, pipeline_group=None, granularity: int = 4, tp_group=None
    ):
        if stage > 0 and not state.controller.follower:
            raise ValueError("stages after the first need EDGCState(..., follower=True)")
        if stage == 0 and state.controller.follower:
            raise ValueError("stage 0 leads: build its EDGCState with follower=False")
        self.state, self.stage, self.n_stages = state, stage, n_stages
        self.pipeline = Communicator(pipeline_group)
        self.granularity = granularity
        self.tp_group = as_process_group(tp_group)  # tensor parallelism: the TP ranks of a stage agree too
        self._candidates = profile_candidates(state.config.profile_max_rank)
        self._backward = [0.0, 0]  # seconds, micro-batches in this window
        self.last_plan: list[StageRank] | None = None  # the latest alignment, for metrics
        self.last_backward_time = math.nan
        # Stage 0's entropy-driven rank at the latest window boundary (None while it does not
        # compress): the signal the inter-stage compressor follows (`edgc.parallel.interstage`).
        self.leader_rank: int | None = None

    def record_backward_time(self, seconds: float) -> None:
        """One micro-batch backward on this stage (t_b sample)."""
        self._backward[0] += seconds
        self._backward[1] += 1

    # ------------------------------------------------------------------ the window boundary
    def _encode(self) -> list[float]:
        controller = self.state.controller
        table = controller.profiling.table
        t_b = self._backward[0] / self._backward[1] if self._backward[1] else math.nan

        def number(value: float | None) -> float:
            return math.nan if value is None else float(value)

        return [
            float(PHASES.index(controller.phase)),
            number(controller.rank),
            number(controller.r_min),
            number(controller.r_max),
            t_b,
            number(table.uncompressed),
            *[number(table.by_rank.get(rank)) for rank in self._candidates],
        ]

    def _decode(self, row: list[float]) -> tuple[str, int | None, StageTiming | None]:
        phase = PHASES[int(row[0])]
        rank = None if math.isnan(row[1]) else int(row[1])
        r_min, r_max, t_b, uncompressed = row[2], row[3], row[4], row[5]
        by_rank = {r: t for r, t in zip(self._candidates, row[6:]) if not math.isnan(t)}
        if not by_rank or math.isnan(r_max) or math.isnan(uncompressed):
            return phase, rank, None  # this stage has no table (yet): cannot be aligned
        timing = StageTiming(
            SyncTimeTable(uncompressed, by_rank), 0.0 if math.isnan(t_b) else t_b, int(r_min), int(r_max)
        )
        return phase, rank, timing

    def after_sync(self) -> None:
        """Call once per optimizer step, after ``state.synchronize``; aligns at window boundaries, where
        the host reads what the stages agreed (a decision point, as EDGC's own: `host_reads_allowed`)."""
        step = self.state.step  # steps completed; the next step to run has this index
        if step % self.state.config.window != 0:
            return
        with host_reads_allowed():
            self._align(step)

    def _device_vector(self, values: list[float]) -> torch.Tensor:
        """``values`` as a float64 vector on the state's device (copied from pinned memory, no host wait)."""
        return to_device(torch.tensor(values, dtype=torch.float64), self.state.device or torch.device("cpu"))

    def _align(self, step: int) -> None:
        if self.stage == 0:
            self.state.controller.plan(step)  # apply a warm-up end due at `step` now, so followers see it
            if self.tp_group is not None:
                self._agree_over_tp(step)
        encoded = self._encode()
        rows = self.pipeline.all_gather(self._device_vector(encoded))
        width = len(encoded)
        gathered = to_host(torch.cat(rows))
        decoded = [self._decode(gathered[i * width : (i + 1) * width]) for i in range(len(rows))]
        self.last_backward_time = encoded[4]
        self._backward = [0.0, 0]
        leader_phase, leader_rank, _ = decoded[0]
        self.leader_rank = leader_rank if leader_phase == COMPRESS else None
        timings = [timing for _, _, timing in decoded]
        if leader_phase != COMPRESS or leader_rank is None:
            return  # stage 0 is not compressing yet: everyone stays as they are
        if all(t is not None for t in timings):
            self.last_plan = align_stage_ranks(leader_rank, timings, self.granularity)  # type: ignore[arg-type]
            wanted = self.last_plan[self.stage].rank
        else:
            wanted = leader_rank  # a stage without a table: same rank as stage 0 (documented fallback)
        if self.stage == 0:
            return
        # Replicas of a stage agree on the least compression any of them asked for.
        agreed = self._device_vector([math.inf if wanted is None else float(wanted)])
        self.state.comm.all_reduce(agreed, op=dist.ReduceOp.MAX)
        if self.tp_group is not None:
            dist.all_reduce(agreed, op=dist.ReduceOp.MAX, group=self.tp_group)
        (value,) = to_host(agreed)
        self.state.controller.follow(step, None if math.isinf(value) else int(value))

    def _agree_over_tp(self, step: int) -> None:
        """Stage 0's TP ranks (each led by its own DP group's entropy) adopt the largest rank any of
        them chose, so the TP shards of a stage are compressed alike. Every DP replica sees the same
        maximum (each DP group already agreed), so replicas stay identical."""
        controller = self.state.controller
        mine = float(controller.rank) if controller.phase == COMPRESS and controller.rank is not None else -1.0
        agreed = self._device_vector([mine])
        dist.all_reduce(agreed, op=dist.ReduceOp.MAX, group=self.tp_group)
        (value,) = to_host(agreed)
        if value > 0:
            controller.agree(step, int(value))

    # ------------------------------------------------------------------ checkpointing
    def state_dict(self) -> dict:
        return {"backward": list(self._backward), "leader_rank": self.leader_rank}

    def load_state_dict(self, state: dict) -> None:
        self._backward = [float(state["backward"][0]), int(state["backward"][1])]
        self.leader_rank = state.get("leader_rank")
