"""The byte budget's signals: what tells the budget controller that the run is still in its early regime.

Each signal is one `BudgetSignal`, registered here under its name; ``EDGCConfig.budget_signal``
names the one a run follows. At every window boundary the budget controller
(`edgc.control.budget.BudgetRule`) asks it for ``need`` ∈ [0, 1], 1 = still early (spend above the even
rate). A signal's need is, unless it says otherwise, the normalised, noise-gated trend of its
series (`trend_need`): |latest window mean − the one before| over |the first such change of the
run| (the ``delta`` map's ratio), where a change counts only when it exceeds ``k`` standard errors
of its two window means.

Where the series come from, all (step, value) pairs handed to `BudgetSignal.need` by name:

* a signal's own ``measure``: a value of each sampled step's GDS sample (every k-th finite element
  of this rank's gradient, fp32), which `edgc.control.entropy.EntropySampler` takes for the signal its
  config follows (none without a budget) and keeps with its checkpoint (``gradnorm``);
* ``entropy``: the GDS entropy of each sampled step (the series the paper's rules read too);
* ``error``: the controller's window means of ‖M−Ĝ‖²/‖M‖², this decision's included;
* none: ``schedule``'s need is the fraction of the compressed steps still to come.

A new signal is one class (a ``measure``, or a ``need`` of its own) and one `register_signal`.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence

import torch

from ..registry import Registry
from .rank_rules import delta_ratio

Series = Sequence[tuple[int, float]]  # (step, value), in step order


def window_stats(samples: Series, window: int) -> list[tuple[float, float, int]]:
    """(mean, squared standard error, count) of the samples in each window [k·w, (k+1)·w), for every
    window up to the last one that has samples; empty windows are (nan, nan, 0)."""
    if not samples:
        return []
    count = max(step for step, _ in samples) // window + 1
    buckets: list[list[float]] = [[] for _ in range(count)]
    for step, value in samples:
        buckets[step // window].append(value)
    stats = []
    for values in buckets:
        n = len(values)
        if n == 0:
            stats.append((math.nan, math.nan, 0))
            continue
        mean = sum(values) / n
        sem2 = sum((v - mean) ** 2 for v in values) / (n - 1) / n if n > 1 else math.nan
        stats.append((mean, sem2, n))
    return stats


def trend_need(windows: Sequence[tuple[float, float, int]], k: float) -> float:
    """How fast the series still moves, in [0, 1]: |Δ of the last two full windows| / |Δ of the first
    two| (the ``delta`` map's ratio, `edgc.policies.rank_rules.delta_ratio`), where a change counts only if it
    exceeds ``k`` standard errors (when those are known).

    0 with fewer than three windows of data (no trend and no reference yet)."""
    full = [w for w in windows if w[2] > 0]
    if len(full) < 3:
        return 0.0

    def change(a, b) -> float:
        delta = abs(b[0] - a[0])
        noise = k * math.sqrt(a[1] + b[1]) if math.isfinite(a[1]) and math.isfinite(b[1]) else 0.0
        return delta if delta > noise else 0.0

    return delta_ratio(change(full[-2], full[-1]), change(full[0], full[1]))


class BudgetSignal:
    """One budget signal: its ``name``, where its series comes from and its ``need``.

    The defaults: no measure of its own (the series is one the decision already has under the
    signal's name) and the noise-gated trend of that series as its need.
    """

    name: str = ""
    reads_samples: bool = True  #: whether its need reads sampled series (else the GDS samples are for the report only)

    def measure(self, sample: torch.Tensor, finite: torch.Tensor) -> torch.Tensor | None:
        """This signal's measure of a sampled step's GDS sample (non-empty, fp32, on the gradient's device;
        ``finite``: where it is finite, the elements to read) as a device tensor of one element, which
        reaches the host with the step's one read (`value` turns it into the series' value); None = not
        measured there. No host read here."""
        return None

    def value(self, measured: float) -> float | None:
        """The series' value of what `measure` gave, read on the host (None: no value this step)."""
        return measured

    def need(self, series: Mapping[str, Series], *, progress: float, window: int, significance: float) -> float:
        """The verdict in [0, 1] at a window boundary. ``series``: every series by name (this one's
        under its name); ``progress``: the fraction of the compressed steps done; ``window``: steps
        per window; ``significance``: k of the noise gate."""
        return trend_need(window_stats(series.get(self.name, ()), window), significance)


class ScheduleSignal(BudgetSignal):
    """A fixed front-loaded schedule: need = the fraction of the compressed steps still to come."""

    name = "schedule"
    reads_samples = False

    def need(self, series: Mapping[str, Series], *, progress: float, window: int, significance: float) -> float:
        return 1.0 - progress


class GradNormSignal(BudgetSignal):
    """ln of the RMS of the sampled gradient: its scale, which falls as training settles."""

    name = "gradnorm"

    def measure(self, sample: torch.Tensor, finite: torch.Tensor) -> torch.Tensor | None:
        return torch.where(finite, sample, 0.0).square().sum() / finite.sum()  # the mean square

    def value(self, measured: float) -> float | None:
        return 0.5 * math.log(measured) if measured > 0 and math.isfinite(measured) else None


class EntropySignal(BudgetSignal):
    """The GDS entropy of the sampled gradient (nats), the paper's signal."""

    name = "entropy"


class ErrorSignal(BudgetSignal):
    """The window means of the relative compression error ‖M−Ĝ‖²/‖M‖² at the rank in force."""

    name = "error"


SIGNALS: Registry[BudgetSignal] = Registry("budget signal")


def register_signal(signal: BudgetSignal) -> BudgetSignal:
    """Make a signal available as ``EDGCConfig.budget_signal = signal.name`` (and to the experiments).

    Args:
        signal: the `BudgetSignal`, registered under its ``name``.

    Returns:
        ``signal``.

    Raises:
        ValueError: not a `BudgetSignal`, or its name is empty or taken.
    """
    if not isinstance(signal, BudgetSignal):
        raise ValueError(f"a budget signal is a BudgetSignal, got {signal!r}")
    return SIGNALS.add(signal.name, signal)


def signal_names() -> tuple[str, ...]:
    """The registered signals' names, in registration order."""
    return SIGNALS.names()


def get_signal(name: str) -> BudgetSignal:
    return SIGNALS.find(name)


for _signal in (ScheduleSignal(), GradNormSignal(), EntropySignal(), ErrorSignal()):
    register_signal(_signal)
