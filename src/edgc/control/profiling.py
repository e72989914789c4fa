"""Sync-time tables: {rank → measured gradient-sync time}, the r_max rule, interpolation.

At start-up EDGC times the data-parallel gradient sync uncompressed and at ranks 2, 4, 8, …
(paper §2.7; from the top down, see `edgc.control.rank_control`; where a quick test already proved the
first candidate faster, ``uncompressed`` is only a lower bound, flagged). The table answers two questions by
piecewise-linear interpolation (with linear extrapolation past the ends): how long does rank r
take (`rank_to_time`), and which rank fits in a time budget (`time_to_rank`). r_max is the
largest rank still faster than uncompressed. The stage-alignment rule of pipeline training uses
the same table.
"""

from __future__ import annotations

from dataclasses import dataclass, field


def _interpolate(xs: list[float], ys: list[float], x: float) -> float:
    """Piecewise-linear y(x) through sorted points, extended linearly past both ends."""
    if len(xs) == 1:
        return ys[0]
    if x <= xs[0]:
        i = 0
    elif x >= xs[-1]:
        i = len(xs) - 2
    else:
        i = next(k for k in range(len(xs) - 1) if xs[k] <= x <= xs[k + 1])
    x0, x1, y0, y1 = xs[i], xs[i + 1], ys[i], ys[i + 1]
    if x1 == x0:
        return y1
    return y0 + (y1 - y0) * (x - x0) / (x1 - x0)


@dataclass
class SyncTimeTable:
    """Measured sync times of one data-parallel group (seconds per optimizer step)."""

    uncompressed: float | None = None
    """Time of the plain averaged all-reduce of all gradients."""

    by_rank: dict[int, float] = field(default_factory=dict)
    """Time of the compressed sync (compress + P/Q all-reduces + decompress + raw tensors) per rank."""

    uncompressed_is_bound: bool = False
    """``uncompressed`` is a lower bound (the quick test: the plain sync's wait after backward)."""

    def _monotone_points(self) -> tuple[list[float], list[float]]:
        # Time should grow with rank; a running maximum removes measurement noise that would
        # otherwise make time → rank ambiguous.
        ranks = sorted(self.by_rank)
        times, running = [], float("-inf")
        for rank in ranks:
            running = max(running, self.by_rank[rank])
            times.append(running)
        return [float(r) for r in ranks], times

    def rank_to_time(self, rank: float) -> float:
        ranks, times = self._monotone_points()
        if not ranks:
            raise ValueError("SyncTimeTable has no compressed measurements")
        return max(0.0, _interpolate(ranks, times, rank))

    def time_to_rank(self, seconds: float) -> float:
        """The largest (fractional) rank predicted to sync within ``seconds``: max{r : time(r) ≤ seconds}."""
        ranks, times = self._monotone_points()
        if not ranks:
            raise ValueError("SyncTimeTable has no compressed measurements")
        rising = [
            (ranks[i], times[i], ranks[i + 1], times[i + 1]) for i in range(len(ranks) - 1) if times[i + 1] > times[i]
        ]
        if not rising:  # every measured rank takes the same time
            return ranks[-1] if seconds >= times[0] else 0.0
        if seconds < times[0]:  # below the cheapest measurement: extend the first rising segment
            r0, t0, r1, t1 = rising[0]
            return max(0.0, r0 - (t0 - seconds) * (r1 - r0) / (t1 - t0))
        for r0, t0, r1, t1 in rising:
            if t0 <= seconds < t1:
                return r0 + (seconds - t0) * (r1 - r0) / (t1 - t0)
        # At or above the slowest measurement: from the last rank, extend the last rising slope.
        r0, t0, r1, t1 = rising[-1]
        return ranks[-1] + (seconds - times[-1]) * (r1 - r0) / (t1 - t0)

    def rank_ceiling(self, multiple: int | None = None) -> int | None:
        """r_max: largest rank (a multiple of ``multiple``) predicted faster than uncompressed.

        ``multiple`` None: 4 (paper §2.7) once a rank ≥ 4 was measured, else 1 (only rank 2 timed).
        None when even the smallest measured rank is not faster: compression does not pay here.
        """
        if self.uncompressed is None or not self.by_rank:
            raise ValueError("SyncTimeTable needs the uncompressed time and ≥ 1 compressed time")
        if multiple is None:
            multiple = 4 if max(self.by_rank) >= 4 else 1
        smallest = min(self.by_rank)
        if self.by_rank[smallest] >= self.uncompressed:
            return None
        # Never extrapolate above the largest rank actually measured.
        rank = int(min(self.time_to_rank(self.uncompressed), max(self.by_rank)) // multiple * multiple)
        if rank < multiple:  # only ranks below the rounding unit pay off
            rank = max(r for r, t in self.by_rank.items() if t < self.uncompressed)
        return rank

    def state_dict(self) -> dict:
        return {
            "uncompressed": self.uncompressed,
            "by_rank": dict(self.by_rank),
            "uncompressed_is_bound": self.uncompressed_is_bound,
        }

    def load_state_dict(self, state: dict) -> None:
        self.uncompressed = state["uncompressed"]
        self.by_rank = {int(r): float(t) for r, t in state["by_rank"].items()}
        self.uncompressed_is_bound = bool(state.get("uncompressed_is_bound", False))  # saved before it existed


def profile_candidates(max_rank: int) -> list[int]:
    """Ranks tried when profiling: 2, 4, 8, … ≤ max_rank."""
    ranks, rank = [], 2
    while rank <= max_rank:
        ranks.append(rank)
        rank *= 2
    return ranks


@dataclass
class ProfilingRun:
    """One controller's r_max profiling: the candidate ranks (`profile_candidates`), the order they are
    timed in, and the table of their times (`SyncTimeTable`)."""

    candidates: list[int]
    top_down: bool  # from the top down: the first rank faster than the plain sync ends it; else from 2 up
    table: SyncTimeTable = field(default_factory=SyncTimeTable)

    @property
    def order(self) -> list[int]:
        """The candidates in the order they are timed."""
        return self.candidates[::-1] if self.top_down else self.candidates


def describe_profiling_verdict(verdict: dict, suggested_r_max: int = 16) -> str:
    """One line for people: what profiling measured, what it decided, and (where it did not compress
    fully) how to compress anyway."""

    def ms(seconds: float | None) -> str:
        return "?" if seconds is None else f"{1000 * seconds:.2f} ms"

    times = ", ".join(f"r={rank}: {ms(t)}" for rank, t in verdict["compressed_s"].items())
    at_least = "≥ " if verdict.get("uncompressed_is_bound") else ""
    measured = f"uncompressed all-reduce {at_least}{ms(verdict['uncompressed_s'])}/step vs compressed sync {times}"
    if verdict["status"] == "found":
        how = (
            "by the quick test: one shadow sync at a step's end against the plain sync's wait after backward"
            if verdict.get("uncompressed_is_bound")
            else "with the plain sync timed blocking"
        )
        return f"EDGC profiled r_max={verdict['r_max']} on this link ({measured}; {how})."
    advice = (
        f"the link is faster than compression here: set r_max={suggested_r_max} in EDGCConfig "
        f"(--edgc r_max={suggested_r_max} with edgc train) to compress anyway"
    )
    if verdict["status"] == "off":
        return f"EDGC compression is OFF: profiling found no rank faster than uncompressed ({measured}); {advice}."
    return (
        f"EDGC compresses only at its floor r_max={verdict['r_max']}: no higher rank was faster than "
        f"uncompressed ({measured}); {advice}."
    )


def profile_seconds(saved: list) -> list:
    """Profiling sums as `EDGCState` keeps them; a state saved with one step count for both
    ([compressed s, uncompressed s, steps]) is read as such."""
    if len(saved) == 3:
        compressed, uncompressed, steps = saved
        return [float(compressed), int(steps), float(uncompressed), int(steps)]
    return [float(saved[0]), int(saved[1]), float(saved[2]), int(saved[3])]
