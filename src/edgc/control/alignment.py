"""DAC stage alignment: per-pipeline-stage ranks so all stages finish gradient sync together.

In a 1F1B schedule stage 0 finishes its backward last, so its data-parallel sync is on the
critical path; stage p finishes about p micro-batch backward times t_b earlier (paper §2.9).
Stage 0 takes the entropy-driven rank r_0 and its predicted sync time T_0 = T_0(r_0). Stage p
may then spend up to the budget B_p = T_0 + p·t_b(p):

* if its uncompressed sync fits in B_p, it is not compressed at all (rank None);
* otherwise it takes the largest rank (a multiple of ``granularity``) whose predicted time
  fits in B_p, clamped to [r_min, r_max] of that stage — a stage whose budget is smaller than
  even its cheapest rank still compresses at r_min, the fastest it can go.

The rule is a pure function of the agreed timing tables; the training loop agrees the result
over each stage's data-parallel replicas (maximum) before using it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from .profiling import SyncTimeTable


@dataclass(frozen=True)
class StageTiming:
    """What stage p knows about itself."""

    table: SyncTimeTable
    """{rank → sync time} and the uncompressed sync time of this stage, seconds."""

    backward_time: float
    """t_b: one micro-batch backward on this stage, seconds. ≥ 0."""

    r_min: int
    """Smallest rank this stage may use. ≥ 1."""

    r_max: int
    """Largest rank this stage may use (its profiled ceiling). ≥ r_min."""


@dataclass(frozen=True)
class StageRank:
    rank: int | None  # None = uncompressed
    budget: float  # seconds the stage may spend on sync
    predicted: float  # predicted sync time at that rank (or uncompressed), seconds
    at_floor: bool = False  # even r_min does not fit the budget: the stage syncs at r_min, over budget


def align_stage_ranks(stage0_rank: int, stages: list[StageTiming], granularity: int = 4) -> list[StageRank]:
    """Ranks for stages 0..P-1 given stage 0's rank (see the module docstring)."""
    if not stages:
        raise ValueError("align_stage_ranks needs at least stage 0")
    first = stages[0]
    stage0_time = first.table.rank_to_time(stage0_rank)
    plans = [StageRank(stage0_rank, stage0_time, stage0_time)]
    for p, stage in enumerate(stages[1:], start=1):
        budget = stage0_time + p * stage.backward_time
        uncompressed = stage.table.uncompressed
        if uncompressed is not None and uncompressed <= budget:
            plans.append(StageRank(None, budget, uncompressed))
            continue
        fitting = stage.table.time_to_rank(budget)
        # the epsilon keeps 23.999… (float noise on an exact fit) from rounding down to 20
        rank = int(math.floor(fitting / granularity + 1e-9) * granularity)
        rank = min(max(rank, stage.r_min), stage.r_max)
        plans.append(StageRank(rank, budget, stage.table.rank_to_time(rank), at_floor=fitting < stage.r_min))
    return plans
