"""EDGC's rank ceiling (the paper, §2.7) and DAC per-stage alignment (§2.9) on the cost model.

The alignment rule itself is the library's (`edgc.control.alignment.align_stage_ranks`): the simulator
only turns its analytic sync-time function into the tables that rule reads.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

RANK_GRANULARITY = 4  # aligned ranks and r_max are multiples of 4 (the paper, §2.7, §2.9)

SyncTime = Callable[[int, int | None], float]  # (stage, rank or None) -> predicted seconds


def profile_r_max(sync_time: Callable[[int | None], float], max_rank: int = 4096) -> int:
    """r_max as the library's start-up profiler finds it on this sync-time model; 0 when even the
    smallest candidate is slower than uncompressed (compression never pays).

    The same candidates (`edgc.control.profiling.profile_candidates`), the same top-down order as
    `edgc.control.rank_control` (stop at the first rank faster than uncompressed) and the same rule
    (`SyncTimeTable.rank_ceiling`: interpolated, never above the largest rank timed)."""
    from edgc.control.profiling import SyncTimeTable, profile_candidates

    table = SyncTimeTable(sync_time(None), {})
    for rank in reversed(profile_candidates(max_rank)):
        table.by_rank[rank] = sync_time(rank)
        if table.by_rank[rank] <= table.uncompressed:
            break
    return table.rank_ceiling() or 0


def align_stage_ranks(r0: int, sync_time: SyncTime, t_backward: Sequence[float], r_max: int) -> tuple:
    """DAC: stage 0 keeps r0; stage p gets the largest multiple-of-4 rank <= r_max whose predicted
    sync ends within T0 + p * t_b(p), or None (uncompressed) if the plain all-reduce already fits.
    If no rank fits, the stage takes its smallest (fastest) rank. Returns one rank (or None) per stage."""
    from edgc.control.alignment import StageTiming
    from edgc.control.alignment import align_stage_ranks as align
    from edgc.control.profiling import SyncTimeTable

    if r_max < RANK_GRANULARITY:
        raise ValueError(f"r_max must be >= {RANK_GRANULARITY}, got {r_max}")
    candidates = range(RANK_GRANULARITY, r_max + 1, RANK_GRANULARITY)
    timings = [
        StageTiming(
            SyncTimeTable(sync_time(p, None), {r: sync_time(p, r) for r in candidates}),
            t_backward[p],
            RANK_GRANULARITY,
            r_max,
        )
        for p in range(len(t_backward))
    ]
    return tuple(plan.rank for plan in align(r0, timings, RANK_GRANULARITY))
