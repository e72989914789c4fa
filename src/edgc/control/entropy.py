"""GDS — the gradient data sampler: cheap gradient-entropy estimates.

Two levels of down-sampling (paper §2.4): the entropy is estimated only on every
round(1/α)-th optimizer step, and only on a β fraction of the gradient elements.

Element choice: every k-th element (k = round(1/β)) of each flattened gradient tensor, starting at element 0. A fixed
stride (as in the authors' code) is deterministic, needs no random generator, is identical on every run and resume,
and does not depend on how DDP groups tensors into buckets. Non-finite values are dropped from the sample and counted.

Where a rank decision reads the samples, the sample holds at most ``entropy_sample_cap`` elements
(2²² by default): on a GPU the histogram's integer index-add into a thousand bins is one atomic per
element, and at GPT-2 XL the whole β sample (~390M elements) made that one kernel most of a sampled
step's device time, with the sample and its bin index held beside the engine's state (docs/gpu.md).
The histogram reads and writes ~60 B per sampled element (gather, range, bin index, index-add): at
2²² a sampled step at GPT-2 XL moves under 32 B per compressed element, as a static step does
(docs/concepts/engine.md), where 2²⁴ added 0.6 B. A larger sample buys little: over the sample's own
[min, max] the estimate's spread is set by the sample's extremes, and for a Gaussian or a
heavy-tailed (Student-t, ν = 4) sample it is about the same at 2²² as at 2²⁴.
Every sampled step of a run then reads a sample of the same size, so the estimates a decision
compares stay comparable (a histogram over the sample's own [min, max] depends on its size).

Where no rank decision reads the samples (a hand-set schedule, the budget's ``schedule`` signal), they are for the
report only, and the estimate uses at most ``REPORT_SAMPLE_CAP`` elements: a 1000-bin histogram of 7M elements costs
~40 ms of a step on one CPU core (the ``small`` bench preset), of 1M about 6 ms, and its entropy moves by far less
than the step-to-step changes the report shows. The thinning is applied to the stride itself (every c·k-th element of
each tensor, c = ⌈β-sample size / cap⌉, from the element count of the step before), so the full β sample is never
gathered: gathering and concatenating it cost more than the histogram (~30 ms on that preset). On the first sampled
step, before any count, each bucket's β sample is gathered and thinned before they are joined.

Experts (`edgc.distributed.experts`): an expert that received no token has an exactly zero gradient, and a layer with
dead experts would pile their zeros into the histogram and pull the estimate (and the rank) down. The exact zeros of
the experts' matrices are left out of the sample (`add(..., experts=…)`): one more read of the step's count of them,
at the step's end, where the estimate reads anyway. A live expert's gradient has next to no exact zeros; a dense
parameter's zeros (an embedding's unused rows) stay, as the paper's estimator has them.
"""

from __future__ import annotations

import math
import time
from collections.abc import Iterable
from dataclasses import dataclass

import torch

from ..config import EDGCConfig
from ..device import timing
from ..device.finite import all_finite
from ..policies.signals import get_signal

REPORT_SAMPLE_CAP = 1 << 20  # elements in a report-only estimate


def histogram_counts(values: torch.Tensor, bins: int, bounds: tuple | None = None) -> torch.Tensor:
    """Counts (int64) of finite fp32 ``values`` in ``bins`` equal bins over their own [min, max].

    The same counts as ``torch.histc(values, bins, min, max)`` on CPU: bin ⌊(x − min)·bins/(max − min)⌋
    in fp32 arithmetic, the top edge in the last bin, a constant sample all in the first. Built from
    arithmetic and an integer index-add, so it is deterministic and reads nothing to the host on
    every device: ``histc`` on CUDA refuses ``torch.use_deterministic_algorithms(True)`` and needs
    the range as host numbers, and ``bincount`` on CUDA reads its size to the host. ``bounds``: the
    values' ``torch.aminmax``, where the caller has it (a pass over the values fewer).
    """
    low, high = torch.aminmax(values) if bounds is None else bounds
    span = high - low
    span = torch.where(span > 0, span, torch.ones_like(span))  # a constant sample: every element in bin 0
    # A range past ~10³⁵ overflows this fp32 product (in histc too, where it is undefined): such
    # elements land in an end bin, never outside.
    index = (values - low).mul_(bins).div_(span).to(torch.int32).clamp_(0, bins - 1)
    # Counted in int32 below 2³¹ elements (half the bytes of the index-add's source), returned as int64.
    dtype = torch.int32 if values.numel() < 2**31 else torch.int64
    one = torch.ones((), dtype=dtype, device=values.device)
    counts = torch.zeros(bins, dtype=dtype, device=values.device).index_add_(0, index, one.expand(index.shape))
    return counts.to(torch.int64)


def histogram_entropy(sample: torch.Tensor, bins: int = 1000, bounds: tuple | None = None) -> float:
    """Plug-in Shannon entropy (nats) of a histogram over the sample's own [min, max].

    Because the bin edges adapt to the range, this is scale-invariant: it measures how
    concentrated the values are relative to their spread. A constant sample has entropy 0.
    One host read: the result.

    Args:
        sample: the values, any shape.
        bins: the histogram's bins.
        bounds: the sample's ``torch.aminmax``, if the caller has it.

    Returns:
        The entropy in nats (NaN for an empty sample).
    """
    x = sample.detach().reshape(-1).float()
    if x.numel() == 0:
        return float("nan")
    p = histogram_counts(x, bins, bounds) / x.numel()
    (value,) = timing.to_host(-torch.xlogy(p, p).sum())  # xlogy(0, 0) = 0: empty bins add nothing
    return value + 0.0  # no −0.0


def gaussian_entropy(sample: torch.Tensor) -> float:
    """Differential entropy ½·ln(2πeσ²) (nats) of a Gaussian with the sample's variance.

    Args:
        sample: the values, any shape.

    Returns:
        The entropy in nats (NaN under two values, −inf for a constant sample).
    """
    x = sample.detach().reshape(-1).double()
    if x.numel() < 2:
        return float("nan")
    (variance,) = timing.to_host(x.var())
    if variance <= 0:
        return float("-inf")
    return 0.5 * math.log(2 * math.pi * math.e * variance)


def strided_size(tensors: Iterable[torch.Tensor], stride: int) -> int:
    """How many elements `strided_copy` (``tensors``, ``stride``) copies."""
    return sum(-(-t.numel() // stride) for t in tensors)


def strided_copy(tensors: Iterable[torch.Tensor], stride: int, out: torch.Tensor | None = None) -> torch.Tensor:
    """Every ``stride``-th element of each tensor, copied into one fp32 vector (no host read): one
    gather of the strided views, cast as it goes, not a copy per tensor (hundreds of launches for a
    large model's bucket). Into ``out`` (fp32, 1-D, `strided_size` elements) if given."""
    views = [t.detach().reshape(-1)[::stride] for t in tensors]
    if not views:
        return torch.empty(0)
    if out is None:
        out = torch.empty(sum(v.numel() for v in views), dtype=torch.float32, device=views[0].device)
    return torch.cat(views, out=out)


def drop_nonfinite(sample: torch.Tensor, bounds: tuple | None = None) -> tuple[torch.Tensor, int]:
    """The finite elements of ``sample`` and how many were not (reads the device, through
    `edgc.device.timing.to_host`: step end only). ``bounds``: the sample's ``torch.aminmax``, where the caller
    has it: a minimum and a maximum that are finite mean every element is (NaN propagates into both)."""
    if sample.numel() == 0:
        return sample, 0
    if bounds is None:
        flag = ~all_finite(sample)  # the usual case: one reduction
    else:
        flag = ~(torch.isfinite(bounds[0]) & torch.isfinite(bounds[1]))
    if not timing.to_host(flag)[0]:
        return sample, 0
    finite = torch.isfinite(sample)
    (kept,) = timing.to_host(finite.sum())
    return sample[finite], int(sample.numel() - kept)


def nonzero_values(values: torch.Tensor) -> torch.Tensor:
    """The elements of ``values`` that are not exactly zero, in order (one read of their count, through
    `edgc.device.timing.to_host`: step end only; the gather itself reads nothing)."""
    keep = values.ne(0)
    (count,) = timing.to_host(keep.sum())
    return values[torch.nonzero_static(keep, size=int(count)).reshape(-1)]


def strided_sample(tensors: Iterable[torch.Tensor], stride: int) -> tuple[torch.Tensor, int]:
    """Every ``stride``-th element of each tensor, as one fp32 vector, and the non-finite count."""
    return drop_nonfinite(strided_copy(tensors, stride))


@dataclass(frozen=True)
class SamplingSettings:
    """What a sampler follows, from its `EDGCConfig`: when, which elements, how the estimate is made."""

    every: int  # steps between sampled steps, round(1/α)
    stride: int  # every stride-th element of each tensor, round(1/β)
    bins: int  # the histogram's bins
    estimator: str  # 'histogram' or 'gaussian'
    cap: int | None  # about the most elements one estimate reads (None: every stride-th)

    @classmethod
    def of(cls, config: EDGCConfig) -> SamplingSettings:
        # see the module docstring; a decision's sample is capped too, far above a report's
        cap = config.entropy_sample_cap if config.decisions_read_samples else REPORT_SAMPLE_CAP
        return cls(
            config.sample_period, config.element_stride, config.entropy_bins, config.resolved_entropy_estimator, cap
        )


class StepGather:
    """One sampled step's gradient sample, gathered bucket by bucket without a host read.

    Into one vector sized from the step before (no copy of the parts into one at the end); parts
    that do not fit, or the first step's, are kept apart and joined in `sample`."""

    def __init__(self, step: int, stride: int, thinned: bool, room: int | None):
        self.step = step
        self.stride = stride  # this step's stride, the cap folded in where `thinned`
        self.thinned = thinned  # else a report sample is thinned after gathering
        self.room_size = room  # elements the step's sample can hold at most, once a step is known
        self.room: torch.Tensor | None = None
        self.filled = 0
        self.parts: list[torch.Tensor] = []
        self.expert_parts: list[torch.Tensor] = []  # experts' matrices: their exact zeros left out at the end
        self.seconds = 0.0

    def add(self, tensors: list[torch.Tensor], experts: list[torch.Tensor] = ()) -> None:
        if experts:
            self.expert_parts.append(strided_copy(experts, self.stride))
        if not tensors:
            return
        if self.room is None and self.room_size and not self.filled:
            self.room = torch.empty(self.room_size, dtype=torch.float32, device=tensors[0].device)
        size = strided_size(tensors, self.stride)
        if self.room is not None and not self.parts and self.filled + size <= self.room.numel():
            strided_copy(tensors, self.stride, self.room[self.filled : self.filled + size])
            self.filled += size
        else:  # filtered in finish(): no per-bucket read
            self.parts.append(strided_copy(tensors, self.stride))

    def sample(self, cap: int | None) -> torch.Tensor:
        """The step's sample, in the order its buckets came, thinned to ``cap`` if not already."""
        parts = ([self.room[: self.filled]] if self.filled else []) + self.parts
        if self.expert_parts:
            parts.append(nonzero_values(torch.cat(self.expert_parts)))
        size = sum(part.numel() for part in parts)
        if cap is not None and not self.thinned and size > cap:  # thinned before the copy into one
            parts = [part[:: math.ceil(size / cap)] for part in parts]
        if len(parts) == 1 and parts[0].is_contiguous():
            return parts[0]
        return torch.cat(parts) if parts else torch.empty(0)


class EntropySampler:
    """Collects the sampled gradient of one step (possibly bucket by bucket) and records its entropy.

    Usage per step: ``begin(step)``; ``add(tensors)`` for each bucket; ``finish()``. On steps that
    are not due (step % ``config.sample_period`` != 0) all three are no-ops but for ``add`` counting the
    step's elements (a report sample's stride needs them), so the hot path pays nothing.

    Args:
        config: the `EDGCConfig` whose sampling fields (α, β, bins, estimator) it follows.
    """

    def __init__(self, config: EDGCConfig):
        self.settings = SamplingSettings.of(config)
        self.history: list[tuple[int, float]] = []  # (step, entropy in nats)
        # The budget signal's own measure, where the config follows one (`edgc.policies.signals`): (step, value)
        self.signals = (get_signal(config.budget_signal),) if config.rank_budget is not None else ()
        self.series: dict[str, list[tuple[int, float]]] = {}
        self.nonfinite_total = 0
        self.calls = 0
        self.seconds_total = 0.0  # measured cost of sampling + estimation, all calls
        self.last_seconds = 0.0
        self.elements_per_step: int | None = None  # gradient elements of the last complete step
        self.tensors_per_step: int | None = None  # and its tensors
        self._counted = [0, 0]  # elements and tensors of this step so far
        self._gather: StepGather | None = None  # this step's sample, on a sampled step

    def due(self, step: int) -> bool:
        """Whether ``step`` is sampled.

        Args:
            step: the optimizer step.

        Returns:
            True when step % the sampling period is 0.
        """
        return step % self.settings.every == 0

    def begin(self, step: int, enabled: bool = True) -> None:
        """Start a step: gather its sample when it is due and ``enabled``.

        Args:
            step: the optimizer step.
            enabled: False: count the step's elements, sample nothing.
        """
        if self._counted[0]:
            self.elements_per_step, self.tensors_per_step = self._counted
        self._counted = [0, 0]
        self._gather = None
        if not (enabled and self.due(step)):
            return
        stride, cap = self.settings.stride, self.settings.cap
        thinned = cap is not None and bool(self.elements_per_step)
        if thinned:
            stride *= max(1, math.ceil(self.elements_per_step / stride / cap))
        room = math.ceil(self.elements_per_step / stride) + self.tensors_per_step if self.tensors_per_step else None
        self._gather = StepGather(step, stride, thinned, room)  # at most a step's elements

    @property
    def sampling(self) -> bool:
        """Whether this step gathers a sample (`add`'s tensors are read)."""
        return self._gather is not None

    def add(self, tensors: Iterable[torch.Tensor], experts: Iterable[torch.Tensor] = ()) -> None:
        """Count, and on a sampled step gather, one bucket's gradients.

        Args:
            tensors: the gradients.
            experts: experts' matrices, whose exact zeros the sample leaves out (the module docstring).
        """
        tensors, experts = list(tensors), list(experts)
        self._counted[0] += sum(t.numel() for t in tensors) + sum(t.numel() for t in experts)  # the next stride
        self._counted[1] += len(tensors) + len(experts)
        if self._gather is None or not (tensors or experts):
            return
        start = time.perf_counter()
        self._gather.add(tensors, experts)
        self._gather.seconds += time.perf_counter() - start

    def estimate(self, sample: torch.Tensor, bounds: tuple | None = None) -> float:
        """The entropy of ``sample`` by the configured estimator.

        Args:
            sample: the finite values of a step's sample.
            bounds: the sample's ``torch.aminmax``, if the caller has it.

        Returns:
            The entropy in nats.
        """
        if self.settings.estimator == "gaussian":
            return gaussian_entropy(sample)
        return histogram_entropy(sample, self.settings.bins, bounds)

    def finish(self) -> float | None:
        """End the step: record the entropy of its sample, and each followed signal's measure.

        Returns:
            The entropy (nats), or None when the step was not sampled or all was non-finite.
        """
        gather, self._gather = self._gather, None
        if gather is None:
            return None
        start = time.perf_counter()
        sample = gather.sample(self.settings.cap)
        # The histogram's range, read once: it tells the finite check too (NaN or ±Inf reach it)
        bounds = torch.aminmax(sample) if sample.numel() and self.settings.estimator != "gaussian" else None
        sample, nonfinite = drop_nonfinite(sample, bounds)
        value = self.estimate(sample, None if nonfinite else bounds) if sample.numel() else None
        seconds = gather.seconds + time.perf_counter() - start
        self.calls += 1
        self.last_seconds = seconds
        self.seconds_total += seconds
        self.nonfinite_total += nonfinite
        if sample.numel():
            self._measure_signals(gather.step, sample)
        if value is not None and math.isfinite(value):
            self.history.append((gather.step, value))
            return value
        return None

    def _measure_signals(self, step: int, sample: torch.Tensor) -> None:
        """The followed budget signal's own value of this step's sample (`edgc.policies.signals`)."""
        for signal in self.signals:
            value = signal.measure(sample)
            if value is not None and math.isfinite(value):
                self.series.setdefault(signal.name, []).append((step, value))

    def signal_series(self) -> dict[str, list[tuple[int, float]]]:
        """The series a budget signal can read by name.

        Returns:
            Name → (step, value) pairs of ``"entropy"`` and of each followed signal's own measure.
        """
        return {"entropy": self.history, **self.series}

    def values(self) -> list[float]:
        """The recorded entropies.

        Returns:
            The entropies (nats), in step order.
        """
        return [value for _, value in self.history]

    def state_dict(self) -> dict:
        """The recorded series and counters.

        Returns:
            The state, for `load_state_dict`.
        """
        return {
            "history": list(self.history),
            "series": {name: list(values) for name, values in self.series.items()},
            "nonfinite_total": self.nonfinite_total,
            "calls": self.calls,
            "seconds_total": self.seconds_total,
            "elements_per_step": self._counted[0] or self.elements_per_step,  # (between steps: the last one's)
        }

    def load_state_dict(self, state: dict) -> None:
        """Restore what `state_dict` returned (a checkpoint of an earlier version included).

        Args:
            state: the sampler's state.
        """
        self.history = [(int(s), float(v)) for s, v in state["history"]]
        # A checkpoint from before the signals' registry holds the gradient norm's series alone.
        series = state.get("series", {"gradnorm": state.get("norm_history", [])})
        self.series = {name: [(int(s), float(v)) for s, v in values] for name, values in series.items() if values}
        self.nonfinite_total = int(state["nonfinite_total"])
        self.calls = int(state["calls"])
        self.seconds_total = float(state["seconds_total"])
        elements = state.get("elements_per_step")  # absent in checkpoints of earlier versions
        self.elements_per_step = int(elements) if elements else None
        self._counted = [0, 0]
