"""The compared methods as per-stage rank schedules, and a whole run as a sum over windows."""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field

from .dac import align_stage_ranks, profile_r_max
from .iteration import BREAKDOWN_KEYS, IterationModel, IterationResult
from .rank_schedule import DeltaMapping, Window

METHODS = ("none", "powersgd", "optimus-cc", "edgc")
METHOD_LABELS = {
    "none": "uncompressed",
    "powersgd": "PowerSGD (static)",
    "optimus-cc": "Optimus-CC (selective)",
    "edgc": "EDGC",
}


@dataclass(frozen=True)
class MethodConfig:
    """Knobs of the baselines (the paper, §3.4) and of EDGC."""

    rank: int = 32  #: static PowerSGD rank, all stages (--grad_comp_rank default in the EDGC code), >= 1
    optimus_rank: int = 128  #: Optimus-CC DP rank (its GPT-2.5B script), >= 1
    optimus_stages: int = 3  #: Optimus-CC compresses the first k stages (--selective_grad_comp_way 3), >= 1
    mapping: DeltaMapping = field(default_factory=DeltaMapping)  #: EDGC window/ISR/warm-up/step
    r_max: int | None = None  #: EDGC rank ceiling; None = profile it from the model (§2.7)

    def __post_init__(self):
        for name in ("rank", "optimus_rank", "optimus_stages"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.r_max is not None and self.r_max < 0:
            raise ValueError(f"r_max must be >= 0, got {self.r_max}")


@dataclass(frozen=True)
class RunResult:
    """A method over a whole run."""

    method: str  #: key in METHODS
    iterations: int  #: iterations simulated
    total_s: float  #: run wall time, seconds
    dp_sync_s: float  #: DP gradient-sync latency per iteration (stage mean), run average, seconds
    breakdown: dict  #: BREAKDOWN_KEYS -> seconds per iteration along stage 0, run average
    ranks: str  #: human summary of the ranks used
    steady: IterationResult  #: the iteration the run spends most time in

    @property
    def iteration_s(self) -> float:
        return self.total_s / self.iterations


def r_max_of(model: IterationModel, cfg: MethodConfig) -> int:
    if cfg.r_max is not None:
        return cfg.r_max
    return profile_r_max(lambda r: model.sync_cost(0, r).total_s)


def stage_rank_windows(
    method: str, model: IterationModel, iterations: int, cfg: MethodConfig, stage0: Sequence[Window] = ()
) -> list:
    """(iterations, per-stage ranks) pieces that make up the run of `method`; `stage0` is EDGC's
    stage-0 rank schedule."""
    P = model.P
    plain = (None,) * P
    warm = math.floor(cfg.mapping.warmup_frac * iterations)
    if method == "none":
        return [(iterations, plain)]
    if method == "powersgd":
        return [(warm, plain), (iterations - warm, (cfg.rank,) * P)]
    if method == "optimus-cc":
        ranks = tuple(cfg.optimus_rank if p < cfg.optimus_stages else None for p in range(P))
        return [(warm, plain), (iterations - warm, ranks)]
    if method == "edgc":
        r_max = r_max_of(model, cfg)
        t_b = [model.backward_micro_batch_s(p) for p in range(P)]
        sync = lambda p, r: model.sync_cost(p, r).total_s  # noqa: E731
        aligned: dict = {}
        pieces = []
        for w in stage0:
            if w.rank is None:
                pieces.append((w.length, plain))
                continue
            if w.rank not in aligned:
                aligned[w.rank] = align_stage_ranks(w.rank, sync, t_b, r_max)
            pieces.append((w.length, aligned[w.rank]))
        return pieces
    raise ValueError(f"method must be one of {METHODS}, got {method!r}")


def simulate_run(method: str, model: IterationModel, pieces: Sequence[tuple]) -> RunResult:
    """Sum the iterations of every piece (iterations with equal ranks cost the same)."""
    time_in: Counter = Counter()
    for length, ranks in pieces:
        if length > 0:
            time_in[tuple(ranks)] += length
    iterations = sum(time_in.values())
    results = {ranks: model.iteration(ranks) for ranks in time_in}
    total = sum(n * results[r].iteration_s for r, n in time_in.items())
    dp = sum(n * results[r].dp_sync_mean_s for r, n in time_in.items()) / iterations
    breakdown = {k: sum(n * results[r].breakdown[k] for r, n in time_in.items()) / iterations for k in BREAKDOWN_KEYS}
    steady = results[max(time_in, key=time_in.get)]
    return RunResult(method, iterations, total, dp, breakdown, summarize_ranks(time_in), steady)


def summarize_ranks(time_in: Counter) -> str:
    """e.g. '32/32/32/32' for a static schedule, 'stage0 12..52; most: 12/16/24/-' for EDGC."""
    fmt = lambda ranks: "/".join("-" if r is None else str(r) for r in ranks)  # noqa: E731
    compressed = [r for r in time_in if any(x is not None for x in r)]
    if not compressed:
        return fmt(next(iter(time_in)))
    if len(compressed) == 1:
        return fmt(compressed[0])
    r0 = [r[0] for r in compressed if r[0] is not None]
    most = max(compressed, key=time_in.get)
    return f"stage0 {min(r0)}..{max(r0)}; most: {fmt(most)}"


def simulate_methods(
    model: IterationModel, iterations: int, methods: Sequence[str], cfg: MethodConfig, stage0_schedule
) -> tuple:
    """Run every method over `iterations`. `stage0_schedule(r_max) -> [Window]` builds EDGC's stage-0
    windows once r_max is known. Returns (r_max, [RunResult])."""
    r_max = r_max_of(model, cfg)
    stage0 = stage0_schedule(r_max) if "edgc" in methods else ()
    return r_max, [simulate_run(m, model, stage_rank_windows(m, model, iterations, cfg, stage0)) for m in methods]
