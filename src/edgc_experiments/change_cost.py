"""What one rank change costs the compression, measured on the very matrices the run compresses.

A rank change (`EDGCConfig.engine.rank_change`) replaces the warm start of PowerSGD's power iteration; what
it throws away shows as a higher compression error in the steps after it. A second run that never
changes rank would see other matrices (its trajectory, its error feedback), and its noise would
drown the difference. So `Shadows` follows the run instead: for each rank of an alternation it
keeps a twin of the run's compressor at that rank, never resized, and each step the twin
compresses the same M = G + e as the run (G: this step's gradient, e: the run's error feedback).
It only measures; training never sees it.

Twins come in two kinds (`twin`):

* ``'run'``: the twin starts where the run started (the run's first Q, same seed, cut to the
  twin's rank or extended by the columns the run itself would append). The power iteration
  orthonormalises P column by column, so the first r columns of a rank-R iteration are a rank-r
  iteration of their own: the twin at the run's first rank *is* the run until the first change,
  and every twin is the run's power iteration had its rank never changed. At a change's first
  step the run and the twin at the new rank see the same M and differ only by what the change did
  to Q: that first step's excess is what the change threw away.
* ``'independent'`` (another seed): an iteration that never shared the run's Q. It measures what
  any two distinct power iterations differ by on the run's matrices, once settled. The run's own Q
  sees less of the run's own residual than another iteration's Q does (e = (I − PPᵀ)M and Q = MᵀP
  give e·Q = (I − PPᵀ)MMᵀP, which vanishes as P converges), so on M = G + e an outsider captures
  part of e that the run cannot, and scores a lower error. After a change the run's Q is another
  iteration than its twin's, so the excess settles near this level, whichever rule made the change.

The summary gives per change the first step's excess and the excess summed from the change to the
next one (of which the settled level above is most), rises and falls apart; `summarise` compares
two rules per seed, and new − ½·old below 0 means the new rule at least halves what a change costs.
"""

from __future__ import annotations

import dataclasses
import math
from statistics import mean

import torch

from edgc.distributed.comm import Communicator
from edgc.engine.factors import matrix_shape
from edgc.engine.lowrank import LowRankCompressor

from .common import fmt_interval, t_interval

TWINS = ("run", "independent")


class Shadows:
    """Never-resized twins of the run's compressor at fixed ranks, applied to the run's own M each step.

    Each twin is the engine itself (`LowRankCompressor`, the run's config without error feedback) at
    one rank: one warm-started power iteration per matrix per step, on a copy of M, in a world of one.
    ``twin``: 'run' (from the run's first Q) or 'independent' (another seed; see the module docstring).
    """

    def __init__(self, compressor: LowRankCompressor, ranks: list[int], twin: str = "independent"):
        if twin not in TWINS:
            raise ValueError(f"twin must be one of {TWINS}, got {twin!r}")
        self.compressor, self.twin = compressor, twin
        # M already holds the run's e; 'truncate': a twin's first Q is cut or extended as the run's would be
        seed = compressor.config.seed + (twin == "independent")
        config = dataclasses.replace(compressor.config, error_feedback=False, rank_change="truncate", seed=seed)
        self.twins = {r: LowRankCompressor(config) for r in sorted(set(ranks))}
        self._comm = Communicator()  # no process group: a mean over one process
        self._m: dict[str, torch.Tensor] = {}
        self.records: list[tuple[int, int, float, dict[int, float]]] = []  # (step, rank, run's error, {rank: twin's})

    def before_sync(self, named) -> None:
        """Capture M = G + e of every matrix (call after backward, before the sync changes grad and e)."""
        self._m = {}
        for name, p in named:
            if p.grad is None or (shape := matrix_shape(p.grad)) is None:
                continue
            gradient = p.grad.detach().reshape(shape).float()
            error = self.compressor.error.get(name)
            if error is not None and error.numel() == gradient.numel():
                self._m[name] = error.reshape(shape).float() + gradient  # the compressor's own sum: e + G
            else:
                self._m[name] = gradient.clone()

    def after_sync(self, named, step: int, rank: int) -> None:
        """Record the run's error (M against the synced gradient: in a world of one, Ĝ) and each twin's."""
        grads = {name: p.grad.detach() for name, p in named}
        error = norm = 0.0
        for name, matrix in self._m.items():
            if self.compressor.compressed_rank(tuple(matrix.shape), rank):  # raw-sent matrices have no error
                error += float((matrix - grads[name].reshape(matrix.shape).float()).square().sum())
                norm += float(matrix.square().sum())
        twins, names = {}, list(self._m)
        for r, twin in self.twins.items():
            if self.twin == "run":
                self._start_where_the_run_did(twin, rank)
            stats = twin.reduce(names, [self._m[n].clone() for n in names], r, self._comm, measure_error=True)
            twins[r] = float(stats.error_sq / stats.norm_sq) if float(stats.norm_sq) > 0 else math.nan
        self.records.append((step, rank, error / norm if norm > 0 else math.nan, twins))

    def _start_where_the_run_did(self, twin: LowRankCompressor, rank: int) -> None:
        """Give a matrix the twin has not seen the run's first Q: the seeded draw `EngineMemory.resized_q` makes at the
        run's rank (the twin's own `reduce` then cuts or extends it as the run would)."""
        for name, matrix in self._m.items():
            if name not in twin.q:
                twin.q[name] = twin.state.resized_q(name, matrix.shape[1], rank, matrix.device)


def change_costs(records: list) -> dict:
    """Per change of one run (records as `shadow_record` writes them): the excess of the run's error
    over the twin's at the new rank, summed over the steps until the next change (``cost``) and at
    the change's first step (``first``), and the mean excess of the windows' last halves (the level
    it settles to: see the module docstring)."""
    changes, settled, window = [], [], []
    opened = previous = None  # opened: (step, rise) of the change that began this window; None for the first

    def close() -> None:
        if opened is not None and window:  # the first window starts from the warm-up, not from a change
            changes.append({"step": opened[0], "rise": opened[1], "cost": sum(window), "first": window[0]})
            settled.extend(window[len(window) // 2 :])

    for step, rank, run, shadows in records:
        if previous is not None and rank != previous:
            close()
            opened, window = (step, rank > previous), []
        window.append(run - shadows[str(rank)])
        previous = rank
    close()
    return {"changes": changes, "settled_excess": mean(settled) if settled else math.nan}


def _interval(values: list[float]) -> dict:
    m, low, high = t_interval(values)
    return {"mean": m, "low": low, "high": high, "per_seed": values}


def summarise(runs: dict[str, dict], seeds: list[int]) -> dict | None:
    """{rule: {seed: run result}} of two alternations → per-seed costs and intervals: summed over each
    window ('all', 'rises', 'falls') and the first step's alone (``first``: the same three); None if
    the runs hold no shadow records (made before this instrument)."""
    if any("shadow" not in runs[rule][str(s)] for rule in runs for s in seeds):
        return None

    def per_seed(costs: dict, key: str) -> dict:
        return {
            "all": _interval([mean(c[key] for c in costs[str(s)]["changes"]) for s in seeds]),
            "rises": _interval([mean(c[key] for c in costs[str(s)]["changes"] if c["rise"]) for s in seeds]),
            "falls": _interval([mean(c[key] for c in costs[str(s)]["changes"] if not c["rise"]) for s in seeds]),
        }

    per_rule = {}
    for rule, by_seed in runs.items():
        costs = {str(s): change_costs(by_seed[str(s)]["shadow"]) for s in seeds}
        per_rule[rule] = {
            **per_seed(costs, "cost"),
            "first": per_seed(costs, "first"),
            "settled": _interval([costs[str(s)]["settled_excess"] for s in seeds]),
            "changes": mean(len(costs[str(s)]["changes"]) for s in seeds),
        }
    return per_rule


def steady_excess(runs: dict, seeds: list[int], rank: int) -> dict | None:
    """A run that never changes rank, against its (independent) twin at that rank: the mean excess
    per step, per seed (the level two distinct iterations settle to); None if the runs hold no twin
    at ``rank``."""
    records = [runs[str(s)].get("shadow") for s in seeds]
    if not all(records) or any(str(rank) not in r[0][3] for r in records):
        return None
    return _interval([mean(run - shadows[str(rank)] for _, _, run, shadows in r) for r in records])


def halving(per_rule: dict, new: str = "warm", old: str = "truncate", first: bool = False) -> dict:
    """new − ½·old per seed (below 0: the new rule at least halves the cost) and the ratio of the
    means; of the window sums, or with ``first`` of the first step after each change."""
    pick = (lambda rule: per_rule[rule]["first"]["all"]) if first else (lambda rule: per_rule[rule]["all"])
    new_costs, old_costs = pick(new)["per_seed"], pick(old)["per_seed"]
    result = _interval([a - 0.5 * b for a, b in zip(new_costs, old_costs)])
    result["ratio"] = mean(new_costs) / mean(old_costs) if mean(old_costs) else math.nan
    return result


def shadow_record(shadows: Shadows) -> list:
    """The records as JSON-friendly lists, errors rounded to 7 digits."""
    return [
        [step, rank, round(run, 7), {str(r): round(e, 7) for r, e in shadow.items()}]
        for step, rank, run, shadow in shadows.records
    ]


def paragraph(b: int, alternations: dict[str, dict], static: dict, stats: dict, seeds: list[int]) -> str:
    """The summary's sentences on a change's cost in compression error (`pareto`'s `--rank-change-cost`):
    ``alternations`` {rule: runs by seed} alternate b/2 ↔ 3b/2 with twins that follow the run,
    ``static`` runs at b with an independent twin; adds 'compression-cost' to ``stats``. Empty if
    the runs hold no shadow records."""
    per_rule = summarise(alternations, seeds)
    if per_rule is None:
        return ""
    halved, halved_first = halving(per_rule), halving(per_rule, first=True)
    stats["compression-cost"] = {
        **per_rule,
        "warm-minus-half-truncate": halved,
        "first-step-warm-minus-half-truncate": halved_first,
    }

    def split(c: dict) -> str:
        return (
            f"rises {fmt_interval(c['rises'], '+.3f')}, falls {fmt_interval(c['falls'], '+.3f')}, "
            f"all {fmt_interval(c['all'], '+.3f')}"
        )

    first = "; ".join(f"{rule}: {split(c['first'])}" for rule, c in per_rule.items())
    sums = "; ".join(f"{rule}: {split(c)}" for rule, c in per_rule.items())
    settled = ", ".join(f"{rule} {fmt_interval(c['settled'], '+.4f')}" for rule, c in per_rule.items())
    text = (
        f" **In compression error** (the relative error ‖M − Ĝ‖²/‖M‖² of each `alt-` run minus that of "
        f"its twins: power iterations at {b // 2} and {b + b // 2} that started from the run's own Q, are "
        f"never resized and see the run's M every step, i.e. the run had it never changed rank). "
        f"*At a change's first step*, where run and twin see the same M and differ only by what the "
        f"change did to Q: {first}; warm over truncate {halved_first['ratio']:.2f}×, warm − ½·truncate "
        f"{fmt_interval(halved_first, '+.4f')} (below 0: the warm rule at least halves it). "
        f"*Summed from a change to the next* (mean per change): {sums}; warm over truncate "
        f"{halved['ratio']:.2f}×, warm − ½·truncate {fmt_interval(halved, '+.3f')}. "
        f"The excess left in the last half of each window (per step): {settled}."
    )
    control = steady_excess(static, seeds, b)
    if control is not None:
        stats["compression-cost"]["static"] = control
        text += (
            f" A static run at {b} sits above an *independent* twin (another seed) by "
            f"{fmt_interval(control, '+.4f')} per step: the level two distinct power iterations settle to "
            f"on the run's matrices, which no change causes and every change reaches."
        )
    return text
