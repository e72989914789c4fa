"""EDGC's stage-0 rank over a whole run: per window, from an entropy series (the paper, §2.5, the
"delta" mapping the released code runs) or replayed from a measured run's metrics.jsonl."""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from edgc.policies.rank_rules import delta_rank


@dataclass(frozen=True)
class Window:
    """A stretch of iterations that share one stage-0 rank."""

    start: int  #: first iteration (>= 0)
    length: int  #: iterations in the window (>= 1)
    rank: int | None  #: stage-0 PowerSGD rank; None = uncompressed (warm-up)


@dataclass(frozen=True)
class DeltaMapping:
    """Knobs of the entropy-change -> rank mapping (defaults from the paper, §2.12)."""

    window: int = 1000  #: w, iterations per rank decision (>= 1)
    alpha: float = 0.1  #: ISR: entropy sampled every int(1/alpha) iterations, (0, 1]
    warmup_frac: float = 0.1  #: uncompressed warm-up as a fraction of the run, [0, 1)
    step: int = 4  #: s, largest rank change per window (>= 1)

    def __post_init__(self):
        if self.window < 1:
            raise ValueError(f"window must be >= 1, got {self.window}")
        if not 0 < self.alpha <= 1:
            raise ValueError(f"alpha must be in (0, 1], got {self.alpha}")
        if not 0 <= self.warmup_frac < 1:
            raise ValueError(f"warmup_frac must be in [0, 1), got {self.warmup_frac}")
        if self.step < 1:
            raise ValueError(f"step must be >= 1, got {self.step}")

    @property
    def stride(self) -> int:
        """Iterations between entropy samples."""
        return int(1 / self.alpha)

    @property
    def samples_per_window(self) -> int:
        return max(1, self.window // self.stride)


def synthetic_entropy(
    iterations: int,
    alpha: float = 0.1,
    start: float = 5.5,
    end: float = 4.0,
    tau: float = 10_000,
    noise: float = 0.002,
    seed: int = 0,
) -> np.ndarray:
    """Observation O1 as a series: histogram entropy (nats) decaying exponentially from `start` to
    `end` with time constant `tau` iterations, plus Gaussian noise; one value per sampled iteration.
    The shape is assumed (the paper's entropy figures were not recovered)."""
    t = np.arange(0, iterations, int(1 / alpha), dtype=float)
    rng = np.random.default_rng(seed)
    return end + (start - end) * np.exp(-t / tau) + noise * rng.standard_normal(t.size)


def map_entropy_change_to_rank(
    entropy: Sequence[float], samples_per_window: int, r_max: int, r_prev: int, step: int = 4
) -> int:
    """One window's stage-0 rank (the released code's `map_entropy_change_to_rank`): the entropy
    change between the last two windows, relative to the change between the first two, sets a target
    in [r_max/4, r_max] (the controller's map, `edgc.policies.rank_rules.delta_rank`); the rank moves toward
    it by at most `step`."""
    n = samples_per_window
    if len(entropy) < 2 * n:
        return r_max
    e = np.asarray(entropy, dtype=float)
    cur = abs(e[-n:].mean() - e[-2 * n : -n].mean())
    ref = abs(e[:n].mean() - e[n : 2 * n].mean())
    r_min = r_max / 4
    target = min(max(delta_rank(cur, ref, r_min, r_max), r_min), r_max)
    target = 2 * math.floor(target / 2)
    return int(r_prev + max(-step, min(step, target - r_prev)))


def delta_rank_schedule(
    entropy: Sequence[float], iterations: int, r_max: int, cfg: DeltaMapping = DeltaMapping()
) -> list:
    """Windows of a whole run: uncompressed through warm-up (rounded up to whole windows), r_max
    in the first window after it, then one mapping per window on the entropy seen so far."""
    t_warm = math.floor(cfg.warmup_frac * iterations)
    windows, r_prev = [], None
    for start in range(0, iterations, cfg.window):
        length = min(cfg.window, iterations - start)
        if start < t_warm or r_max < 4:
            rank = None
        elif r_prev is None:
            rank = r_max
        else:
            seen = entropy[: -(-start // cfg.stride)]  # samples taken at iterations < start
            rank = map_entropy_change_to_rank(seen, cfg.samples_per_window, r_max, r_prev, cfg.step)
        windows.append(Window(start, length, rank))
        r_prev = rank if rank is not None else r_prev
    return windows


def read_metrics(path: str | Path) -> list:
    """The `"kind": "train"` records of an `edgc train` metrics.jsonl, sorted by step."""
    records = []
    with open(path) as fh:
        for lineno, line in enumerate(fh, 1):
            if not line.strip():
                continue
            try:
                rec = json.loads(line)
            except json.JSONDecodeError as exc:
                raise ValueError(f"{path}:{lineno}: not JSON ({exc.msg})") from None
            if rec.get("kind") == "train":
                if "step" not in rec:
                    raise ValueError(f"{path}:{lineno}: train record without 'step'")
                records.append(rec)
    if not records:
        raise ValueError(f'{path}: no records with "kind": "train"')
    return sorted(records, key=lambda r: r["step"])


def schedule_from_metrics(records: Sequence[dict], iterations: int, r_max: int, window: int = 1000) -> list:
    """Replay a measured run's stage-0 rank over the simulated run: the window at fraction f of the
    simulated run takes the rank logged at fraction f of the measured run, scaled by
    r_max / (largest measured rank) because the measured machine had its own rank ceiling."""
    ranks = [r.get("rank") for r in records]
    measured_max = max((r for r in ranks if r is not None), default=None)
    steps = np.array([r["step"] for r in records], dtype=float)
    first, span = steps[0], max(steps[-1] - steps[0], 1.0)
    windows = []
    for start in range(0, iterations, window):
        target = first + span * start / iterations
        rank = ranks[max(0, int(np.searchsorted(steps, target, side="right")) - 1)]
        if rank is not None and measured_max and r_max >= 4:
            rank = min(r_max, max(2, 2 * round(rank * r_max / measured_max / 2)))
        else:
            rank = None
        windows.append(Window(start, min(window, iterations - start), rank))
    return windows
