"""EDGC's rank ceiling (paper.md §2.7) and DAC per-stage alignment (§2.9) on the cost model.

The alignment rule itself is the library's (`edgc.alignment.align_stage_ranks`): the simulator
only turns its analytic sync-time function into the tables that rule reads.
"""
from __future__ import annotations

import math
from typing import Callable, Optional, Sequence

RANK_GRANULARITY = 4  # aligned ranks and r_max are multiples of 4 (paper.md §2.7, §2.9)

SyncTime = Callable[[int, Optional[int]], float]  # (stage, rank or None) -> predicted seconds


def profile_r_max(sync_time: Callable[[Optional[int]], float], max_rank: int = 4096) -> int:
    """Largest rank (multiple of 4) whose compressed sync is still no slower than uncompressed.

    Mirrors the start-up profiler: time ranks 2, 4, 8, ... until one is slower than the plain
    all-reduce, then interpolate rank linearly in time between the last two points. Returns 0 when
    even rank 2 is slower (compression never pays)."""
    t_full = sync_time(None)
    points = []
    rank = 2
    while rank <= max_rank:
        points.append((sync_time(rank), rank))
        if points[-1][0] > t_full:
            break
        rank *= 2
    if len(points) == 1 and points[0][0] > t_full:
        return 0
    if points[-1][0] <= t_full:  # never got slower within max_rank
        return RANK_GRANULARITY * (max_rank // RANK_GRANULARITY)
    (t_a, r_a), (t_b, r_b) = points[-2], points[-1]
    r_est = r_a + (t_full - t_a) * (r_b - r_a) / (t_b - t_a)
    return RANK_GRANULARITY * math.floor(r_est / RANK_GRANULARITY)


def align_stage_ranks(r0: int, sync_time: SyncTime, t_backward: Sequence[float], r_max: int) -> tuple:
    """DAC: stage 0 keeps r0; stage p gets the largest multiple-of-4 rank <= r_max whose predicted
    sync ends within T0 + p * t_b(p), or None (uncompressed) if the plain all-reduce already fits.
    If no rank fits, the stage takes its smallest (fastest) rank. Returns one rank (or None) per stage."""
    from edgc.alignment import StageTiming
    from edgc.alignment import align_stage_ranks as align
    from edgc.profiling import SyncTimeTable

    if r_max < RANK_GRANULARITY:
        raise ValueError(f"r_max must be >= {RANK_GRANULARITY}, got {r_max}")
    candidates = range(RANK_GRANULARITY, r_max + 1, RANK_GRANULARITY)
    timings = [StageTiming(SyncTimeTable(sync_time(p, None), {r: sync_time(p, r) for r in candidates}),
                           t_backward[p], RANK_GRANULARITY, r_max) for p in range(len(t_backward))]
    return tuple(plan.rank for plan in align(r0, timings, RANK_GRANULARITY))
