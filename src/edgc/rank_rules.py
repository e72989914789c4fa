"""The paper's rank rules (DAC, §2.5) and the noise gate that makes them follow the entropy trend.

Pure functions of an entropy series, and `PaperRules`, the rank rule that applies them: the one
`edgc.rank_control.WindowController` follows at window boundaries when no byte budget is set
(``EDGCConfig.rank_budget = None``, the ``paper`` mode; `edgc.budget.BudgetRule` is the other).
"""
from __future__ import annotations

import math
from typing import Sequence

from .plans import Agreed, ControllerView, StepPlan
from .rank_model import ErrorModel, cqm_target_rank


def limit_rank(target: float, previous: int, r_min: int, r_max: int, step_limit: int, granularity: int) -> int:
    """Round ``target`` down to the granularity, then move from ``previous`` by at most ``step_limit``."""
    target = min(max(target, r_min), r_max)
    target = max(r_min, int(target // granularity * granularity))
    move = max(-step_limit, min(step_limit, target - previous))
    return int(min(max(previous + move, r_min), r_max))


def window_means(entropies: Sequence[float], per_window: int) -> tuple[float, float] | None:
    """Mean entropy of the previous and of the latest window, or None with < 2 windows of samples."""
    if per_window < 1 or len(entropies) < 2 * per_window:
        return None
    previous = entropies[-2 * per_window : -per_window]
    latest = entropies[-per_window:]
    return sum(previous) / per_window, sum(latest) / per_window


def entropy_shift(reference: Sequence[float], latest: Sequence[float], k: float) -> float | None:
    """mean(latest) − mean(reference) when it exceeds ``k`` standard errors of that difference, else None.

    SE² = s²_ref/n_ref + s²_latest/n_latest (sample variances). Each side needs ≥ 2 samples; with
    fewer, or a shift inside the noise, the answer is None (= no evidence of a change).
    """
    if len(reference) < 2 or len(latest) < 2:
        return None

    def mean_and_sem2(values: Sequence[float]) -> tuple[float, float]:
        mean = sum(values) / len(values)
        variance = sum((v - mean) ** 2 for v in values) / (len(values) - 1)
        return mean, variance / len(values)

    ref_mean, ref_sem2 = mean_and_sem2(reference)
    new_mean, new_sem2 = mean_and_sem2(latest)
    shift = new_mean - ref_mean
    noise = k * math.sqrt(ref_sem2 + new_sem2)
    floor = 1e-9 * max(1.0, abs(ref_mean))  # rounding error is not a shift
    return shift if abs(shift) > max(noise, floor) else None


def confirmed_shift(samples: Sequence[float], per_window: int, k: float) -> float | None:
    """The latest window's `entropy_shift` against all earlier ``samples``, if the window before it
    already showed a significant shift of the same sign against the samples before *it*; else None.

    Asking two consecutive windows turns a k-SE false alarm (likely somewhere in 50 windows of
    10 samples) into a pair of them, and delays a real step by one window.
    """
    if per_window < 1 or len(samples) < 2 * per_window + 2:
        return None
    latest = entropy_shift(samples[:-per_window], samples[-per_window:], k)
    before = entropy_shift(samples[: -2 * per_window], samples[-2 * per_window : -per_window], k)
    if latest is None or before is None or (latest > 0) != (before > 0):
        return None
    return latest


def delta_ratio(change_now: float, change_ref: float) -> float:
    """ρ of the paper's ``delta`` map (§2.5): the latest change of the window means over the reference
    change, Δ_now / Δ_ref, clipped to [0, 1] (both changes are absolute values).

    Where Δ_ref = 0 (the reference windows have equal means) the ratio takes its limit: a series that
    moves now but did not move then moves faster than the reference, ρ = 1 (the rank stays high
    while the entropy is unstable); one that moves neither then nor now is stable, ρ = 0 (the rank
    may decay). Δ_now = 0 (the latest two windows have equal means) is ρ = 0 whatever Δ_ref.
    """
    if change_now == 0:
        return 0.0
    if change_ref == 0:
        return 1.0
    return min(change_now / change_ref, 1.0)


def delta_rank(change_now: float, change_ref: float, r_min: float, r_max: float) -> int:
    """The ``delta`` map's target rank, round(r_min + (r_max − r_min)·ρ) with ρ = `delta_ratio`
    (before the granularity and the step limit)."""
    return round(r_min + (r_max - r_min) * delta_ratio(change_now, change_ref))


def reference_change(entropies: Sequence[float], per_window: int) -> float:
    """Δ_ref: |change of the mean| between the first two windows of the series (0 before there are two)."""
    if per_window < 1 or len(entropies) < 2 * per_window:
        return 0.0
    first, second = entropies[:per_window], entropies[per_window : 2 * per_window]
    return abs(sum(second) / per_window - sum(first) / per_window)


def delta_target(entropies: Sequence[float], per_window: int, r_min: int, r_max: int) -> int:
    """The authors' linear map (paper §2.5) of the normalised windowed entropy change.

    ρ = ‖Δ latest two windows‖ / ‖Δ first two windows of training‖ (changes of the window means,
    `delta_ratio`); target = r_min + (r_max − r_min)·ρ, rounded. Fast-moving entropy (unstable
    regime) keeps the rank near r_max; a stable entropy lets it decay to r_min. With fewer than two
    windows of history the target is r_max.
    """
    means = window_means(entropies, per_window)
    if means is None:
        return r_max
    return delta_rank(abs(means[1] - means[0]), reference_change(entropies, per_window), r_min, r_max)


class PaperRules:
    """The paper's rank rule: r_min = r_max // 4, compression starts at r_max, and each window
    boundary maps the entropy trend (or, with ``error-band``, the compression error) to a new rank
    through ``rank_mapping``, at most ``rank_step`` away (`edgc.rank_control`'s docstring)."""

    def __init__(self, config):
        self.config = config  # the EDGCConfig
        self._error_model: ErrorModel | None = None  # the cqm mapping's g(r; m, n), built on first use

    def default_r_min(self, r_max: int) -> int:
        return max(1, r_max // 4)

    def first_rank(self, controller: ControllerView, step: int) -> int:
        return controller.r_max

    def may_decide(self, step: int) -> bool:
        return True

    def budget_state(self, schedule: Sequence[tuple[int, int]], step: int) -> None:
        return None  # no budget to report

    def propose(self, controller: ControllerView, plan: StepPlan, agreed: Agreed, entropies: Sequence[float],
                shapes: list[tuple[int, int]], sample_steps: Sequence[int] | None,
                signals: dict) -> tuple[int, None, None]:
        """(rank, need, target) for the next window; the paper's rules have no need and no target."""
        if self.config.rank_mapping == "error-band":
            return self.band_rank(controller, agreed.relative_error), None, None
        return self.next_rank(controller, entropies, shapes, sample_steps), None, None

    def next_rank(self, controller: ControllerView, entropies: Sequence[float], shapes: list[tuple[int, int]],
                  sample_steps: Sequence[int] | None = None) -> int:
        """The rank for the next window: unchanged unless the noise gate accepts an entropy shift."""
        config, rank, r_min, r_max = self.config, controller.rank, controller.r_min, controller.r_max
        assert rank is not None and r_min is not None and r_max is not None
        per_window = max(1, config.window // config.sample_every)
        if config.entropy_significance == 0:
            # Gate off: the paper's rule, a new target every window from the last two window means.
            means = window_means(entropies, per_window)
            if means is None:
                return rank
            h_ref, h_new = means
            if config.rank_mapping != "cqm":
                target = delta_target(entropies, per_window, r_min, r_max)
                return limit_rank(target, rank, r_min, r_max, config.rank_step, config.rank_granularity)
        else:
            since = samples_since(entropies, sample_steps, controller.schedule[-1][0] if controller.schedule else None)
            shift = confirmed_shift(since, per_window, config.entropy_significance)
            if shift is None:
                return rank
            reference, latest = since[:-per_window], since[-per_window:]
            h_ref, h_new = sum(reference) / len(reference), sum(latest) / len(latest)
        if config.rank_mapping == "cqm":
            if self._error_model is None:
                self._error_model = ErrorModel(samples=config.cqm_mc_samples, seed=config.seed)
            target: float = cqm_target_rank(self._error_model, shapes, rank, h_ref, h_new,
                                            config.cqm_exponent, r_min, r_max)
        else:
            target = delta_rank(abs(h_new - h_ref), reference_change(entropies, per_window), r_min, r_max)
        return limit_rank(target, rank, r_min, r_max, config.rank_step, config.rank_granularity)

    def band_rank(self, controller: ControllerView, relative_error: float) -> int:
        """'error-band' mapping: one ``rank_step`` up when the window's mean ‖M−Ĝ‖²/‖M‖² is above the
        band, one down when below, unchanged inside it or when unmeasured (the band is the hysteresis)."""
        rank, r_min, r_max = controller.rank, controller.r_min, controller.r_max
        assert rank is not None and r_min is not None and r_max is not None
        low, high = self.config.error_band
        target = rank
        if math.isfinite(relative_error) and relative_error > high:
            target = rank + self.config.rank_step
        elif math.isfinite(relative_error) and relative_error < low:
            target = rank - self.config.rank_step
        if target == rank:
            return rank
        granularity = self.config.rank_granularity
        if target > rank:  # round up, so a move up is never swallowed by the granularity
            target = -(-target // granularity) * granularity
        return limit_rank(target, rank, r_min, r_max, self.config.rank_step, granularity)


def samples_since(entropies: Sequence[float], sample_steps: Sequence[int] | None, since: int | None) -> list[float]:
    """The entropy samples taken from step ``since`` on (all of them without steps or a start): the
    noise gate's reference restarts where the rank last changed (compression start counts as a change)."""
    if sample_steps is None or since is None:
        return list(entropies)
    return [value for step, value in zip(sample_steps, entropies) if step >= since]
