"""The paper's rank rules (DAC, §2.5) and the noise gate that makes them follow the entropy trend.

Pure functions of an entropy series, and `PaperRules`, the rank rule that applies them: the one
`edgc.control.rank_control.WindowController` follows at window boundaries when no byte budget is set
(``EDGCConfig.rank_budget = None``, the ``paper`` mode; `edgc.control.budget.BudgetRule` is the other).
What a boundary maps to the next rank is a `RankMapping`, registered by name (``delta``, ``cqm``,
``error-band``; `register_rank_mapping` adds one) and named by ``EDGCConfig.rank_mapping``.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

from ..registry import Registry
from .plans import ControllerView, DecisionInputs
from .rank_model import ErrorModel, cqm_target_rank


def limit_rank(target: float, previous: int, r_min: int, r_max: int, step_limit: int, granularity: int) -> int:
    """Round ``target`` down to the granularity, then move from ``previous`` by at most ``step_limit``.

    Args:
        target: the rank a mapping asked for.
        previous: the rank in force.
        r_min: the lowest rank allowed.
        r_max: the highest.
        step_limit: the most the rank moves in one decision.
        granularity: ranks are multiples of it (r_min aside).

    Returns:
        The new rank, within [r_min, r_max].
    """
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
    regime) keeps the rank near r_max; a stable entropy lets it decay to r_min.

    Args:
        entropies: the entropy samples of the run so far, in step order.
        per_window: samples per window.
        r_min: the lowest rank.
        r_max: the highest.

    Returns:
        The target rank; r_max with fewer than two windows of history.
    """
    means = window_means(entropies, per_window)
    if means is None:
        return r_max
    return delta_rank(abs(means[1] - means[0]), reference_change(entropies, per_window), r_min, r_max)


class PaperRules:
    """The paper's rank rule: r_min = r_max // 4, compression starts at r_max, and each window
    boundary maps the entropy trend (or, with ``error-band``, the compression error) to a new rank
    through the registered ``rank_mapping`` (`RankMapping`), at most ``rank_step`` away
    (`edgc.control.rank_control`'s docstring)."""

    def __init__(self, config):
        self.config = config  # the EDGCConfig
        self.mapping = rank_mapping(config.rank_mapping)
        self._error_model: ErrorModel | None = None  # the cqm mapping's g(r; m, n), built on first use

    def default_r_min(self, r_max: int) -> int:
        return max(1, r_max // 4)

    def first_rank(self, controller: ControllerView, step: int) -> int:
        return controller.r_max

    def may_decide(self, step: int) -> bool:
        return True

    def budget_state(self, schedule: Sequence[tuple[int, int]], step: int) -> None:
        return None  # no budget to report

    def propose(self, controller: ControllerView, inputs: DecisionInputs) -> tuple[int, None, None]:
        """(rank, need, target) for the next window; the paper's rules have no need and no target."""
        return self.mapping.next_rank(self, controller, inputs), None, None

    @property
    def per_window(self) -> int:
        """Entropy samples per window."""
        return max(1, self.config.window // self.config.sample_every)

    def entropy_levels(self, controller: ControllerView, inputs: DecisionInputs) -> tuple[float, float] | None:
        """(H before, H now) of an entropy move the rule acts on, or None (the rank stays). Gate off
        (``entropy_significance`` 0): the paper's rule, the last two window means, every window.
        Gate on: the reference since the last rank change against the latest window, when the noise
        gate confirms the shift."""
        per_window, entropies = self.per_window, inputs.entropies
        if self.config.entropy_significance == 0:
            return window_means(entropies, per_window)
        last_change = controller.schedule[-1][0] if controller.schedule else None
        since = samples_since(entropies, inputs.sample_steps, last_change)
        if confirmed_shift(since, per_window, self.config.entropy_significance) is None:
            return None
        reference, latest = since[:-per_window], since[-per_window:]
        return sum(reference) / len(reference), sum(latest) / len(latest)

    def error_model(self) -> ErrorModel:
        """The cqm mapping's error model g(r; m, n), of this config's draws and seed."""
        if self._error_model is None:
            self._error_model = ErrorModel(samples=self.config.cqm_mc_samples, seed=self.config.engine.seed)
        return self._error_model

    def limit(self, target: float, controller: ControllerView) -> int:
        """``target`` on the rank grid, at most ``rank_step`` from the rank in force (`limit_rank`)."""
        return limit_rank(
            target,
            controller.rank,
            controller.r_min,
            controller.r_max,  # type: ignore[arg-type]
            self.config.rank_step,
            self.config.rank_granularity,
        )


# ---------------------------------------------------------------------------- rank mappings
class RankMapping:
    """What the paper's rule maps a window to (``EDGCConfig.rank_mapping`` names one registered
    here): by default an entropy move that `PaperRules.entropy_levels` accepts, through `target`.
    ``entropy_estimator`` is what ``entropy_estimator='auto'`` means under it. A new mapping is one
    class and one `register_rank_mapping`."""

    name: str = ""
    entropy_estimator: str = "histogram"

    def next_rank(self, rules: PaperRules, controller: ControllerView, inputs: DecisionInputs) -> int:
        """The rank for the next window: unchanged unless the entropy moved (see the class docstring)."""
        assert controller.rank is not None and controller.r_min is not None and controller.r_max is not None
        levels = rules.entropy_levels(controller, inputs)
        if levels is None:
            return controller.rank
        target = self.target(rules, controller, *levels, entropies=inputs.entropies, shapes=list(inputs.shapes))
        return rules.limit(target, controller)

    def target(
        self,
        rules: PaperRules,
        controller: ControllerView,
        before: float,
        now: float,
        *,
        entropies: Sequence[float],
        shapes: list[tuple[int, int]],
    ) -> float:
        """The unrounded rank for an entropy move from ``before`` to ``now`` (nats)."""
        raise NotImplementedError


class DeltaMapping(RankMapping):
    """The authors' linear map of the entropy change (`delta_rank`)."""

    name = "delta"

    def target(self, rules, controller, before, now, *, entropies, shapes) -> float:
        change_ref = reference_change(entropies, rules.per_window)
        return delta_rank(abs(now - before), change_ref, controller.r_min, controller.r_max)  # type: ignore[arg-type]


class CQMMapping(RankMapping):
    """CQM: the rank whose truncation error follows the entropy move (`edgc.policies.rank_model.cqm_target_rank`)."""

    name = "cqm"
    entropy_estimator = "gaussian"  # its error model reads entropy differences as log-scale changes (paper §2.5)

    def target(self, rules, controller, before, now, *, entropies, shapes) -> float:
        config = rules.config
        return cqm_target_rank(
            rules.error_model(),
            shapes,
            controller.rank,
            before,
            now,
            config.cqm_exponent,
            controller.r_min,
            controller.r_max,
        )  # type: ignore[arg-type]


class ErrorBandMapping(RankMapping):
    """Keeps the window's mean ‖M−Ĝ‖²/‖M‖² in ``EDGCConfig.error_band``: one ``rank_step`` up above the
    band, one down below it, unchanged inside it or when unmeasured (the band is the hysteresis)."""

    name = "error-band"

    def next_rank(self, rules, controller, inputs) -> int:
        return self.rank_for_error(rules, controller, inputs.agreed.relative_error)

    def rank_for_error(self, rules: PaperRules, controller: ControllerView, error: float) -> int:
        """The next rank where the window's mean relative error was ``error`` (NaN: unmeasured)."""
        config, rank = rules.config, controller.rank
        assert rank is not None
        low, high = config.error_band
        target = rank
        if math.isfinite(error) and error > high:
            target = rank + config.rank_step
        elif math.isfinite(error) and error < low:
            target = rank - config.rank_step
        if target == rank:
            return rank
        if target > rank:  # round up, so a move up is never swallowed by the granularity
            target = -(-target // config.rank_granularity) * config.rank_granularity
        return rules.limit(target, controller)


RANK_MAPPINGS: Registry[RankMapping] = Registry("rank mapping")


def register_rank_mapping(mapping: RankMapping) -> RankMapping:
    """Make a mapping available as ``EDGCConfig.rank_mapping = mapping.name``.

    Args:
        mapping: the `RankMapping`, registered under its ``name``.

    Returns:
        ``mapping``.

    Raises:
        ValueError: not a `RankMapping`, or its name is empty or taken.
    """
    if not isinstance(mapping, RankMapping):
        raise ValueError(f"a rank mapping is a RankMapping, got {mapping!r}")
    return RANK_MAPPINGS.add(mapping.name, mapping)


def rank_mapping_names() -> tuple[str, ...]:
    """The registered mappings' names, in registration order."""
    return RANK_MAPPINGS.names()


def rank_mapping(name: str) -> RankMapping:
    return RANK_MAPPINGS.find(name)


for _mapping in (DeltaMapping(), CQMMapping(), ErrorBandMapping()):
    register_rank_mapping(_mapping)


def samples_since(entropies: Sequence[float], sample_steps: Sequence[int] | None, since: int | None) -> list[float]:
    """The entropy samples taken from step ``since`` on (all of them without steps or a start): the
    noise gate's reference restarts where the rank last changed (compression start counts as a change)."""
    if sample_steps is None or since is None:
        return list(entropies)
    return [value for step, value in zip(sample_steps, entropies) if step >= since]
