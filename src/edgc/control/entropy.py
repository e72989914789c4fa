"""GDS — the gradient data sampler: cheap gradient-entropy estimates.

Two levels of down-sampling (paper §2.4): the entropy is estimated only on every
round(1/α)-th optimizer step, and only on a β fraction of the gradient elements.

Element choice: every k-th element (k = round(1/β)) of each flattened gradient tensor,
starting at element 0. A fixed stride (as in the authors' code) is deterministic, needs no
random generator, is identical on every run and resume, and does not depend on how DDP
groups tensors into buckets. Non-finite values are dropped from the sample and counted.

Where a rank decision reads the samples, the sample holds at most ``entropy_sample_cap`` elements
(2²² by default): at GPT-2 XL the whole β sample (~390M elements), counted with one atomic
index-add into a thousand bins, made that one kernel most of a sampled step's device time, with the
sample and its bin index held beside the engine's state (docs/gpu.md). The histogram is now counted
into private rows without shared counters (`edgc.control.histogram`), and reads and writes ~110 B per
sampled bf16 element (gather, range, bin index, counts): at 2²² a sampled step at GPT-2 XL moves under
32 B per compressed element, as a static step does (docs/concepts/engine.md). A larger sample buys
little: over the sample's own
[min, max] the estimate's spread is set by the sample's extremes, and for a Gaussian or a
heavy-tailed (Student-t, ν = 4) sample it is about the same at 2²² as at 2²⁴.
Every sampled step of a run then reads a sample of the same size, so the estimates a decision
compares stay comparable (a histogram over the sample's own [min, max] depends on its size).

The sample is gathered job by job (a DDP bucket, or the buckets fused into one job) with one ``cat`` of
its tensors' every-k-th-element views (`edgc.control.gather`: one batched copy per 64 views on a GPU),
not a copy per tensor, in the gradients' dtype. Its estimate is made on the device
when the step closes and reaches the host with the step's one read (`edgc.device.totals.StepTotals`):
a sampled step reads the host no more often than a static one.

Where no rank decision reads the samples (a hand-set schedule, the budget's ``schedule`` signal),
they are for the report only, and the estimate uses at most ``REPORT_SAMPLE_CAP`` elements: a
1000-bin histogram of 7M elements costs ~40 ms of a step on one CPU core (the ``small`` bench
preset), of 1M about 6 ms, and its entropy moves by far less than the step-to-step changes the
report shows. The thinning is applied to the stride itself (every c·k-th element of each tensor,
c = ⌈β-sample size / cap⌉, from the element count of the step before), so the full β sample is
never gathered: gathering and concatenating it cost more than the histogram (~30 ms on that
preset). On the first sampled step, before any count, each bucket's β sample is gathered and
thinned before they are joined.

Experts (`edgc.distributed.experts`): an expert that received no token has an exactly zero gradient, and a
layer with dead experts would pile their zeros into the histogram and pull the estimate (and the rank)
down. The exact zeros of the experts' matrices are left out of the sample (`add(..., experts=…)`): one
more read of the step's count of them, at the step's end, where the estimate reads anyway. A live
expert's gradient has next to no exact zeros; a dense parameter's zeros (an embedding's unused rows)
stay, as the paper's estimator has them.
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
from ..device.totals import StepTotals
from ..policies.signals import get_signal
from .gather import SampleBuffers, StepGather, nonzero_values  # noqa: F401 (nonzero_values: its old place)
from .histogram import finite_mask, gaussian_variance_on_device, histogram_entropy_on_device

REPORT_SAMPLE_CAP = 1 << 20  # elements in a report-only estimate


def histogram_entropy(sample: torch.Tensor, bins: int = 1000, bounds: tuple | None = None) -> float:
    """Plug-in Shannon entropy (nats) of a histogram over the finite values' own [min, max]
    (`edgc.control.histogram`): scale-invariant, it measures how concentrated the values are relative to
    their spread. A constant sample has entropy 0; an empty one NaN. One host read: the result.

    Args:
        sample: the values, any shape.
        bins: the histogram's bins.
        bounds: unused, for callers of earlier versions.

    Returns:
        The entropy in nats (NaN for an empty sample).
    """
    if sample.numel() == 0:
        return float("nan")
    entropy, _ = histogram_entropy_on_device(sample.detach(), bins)
    (value,) = timing.to_host(entropy)
    return value + 0.0  # no −0.0


def gaussian_entropy(sample: torch.Tensor) -> float:
    """Differential entropy ½·ln(2πeσ²) (nats) of a Gaussian with the finite values' variance.

    Args:
        sample: the values, any shape.

    Returns:
        The entropy in nats (NaN under two values, −inf for a constant sample).
    """
    if sample.numel() < 2:
        return float("nan")
    variance, _ = gaussian_variance_on_device(sample.detach())
    (value,) = timing.to_host(variance)
    return gaussian_entropy_of(value)


def gaussian_entropy_of(variance: float) -> float:
    """½·ln(2πeσ²) of a variance (−inf for 0, NaN for NaN)."""
    if not variance > 0:
        return float("-inf") if variance == 0 else float("nan")
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


class EntropySampler:
    """Collects the sampled gradient of one step (possibly bucket by bucket) and records its entropy.

    Usage per step: ``begin(step)``; ``add(tensors)`` for each bucket; ``close(totals)`` when the step's
    buckets are all in (its estimate made on the device, into the step's `StepTotals`), ``settle(totals)``
    once they are read (or ``finish()``: both, reading the host at once). On steps that are not due
    (step % ``config.sample_period`` != 0) all of them are no-ops but for ``add`` counting the step's
    elements (a report sample's stride needs them), so the hot path pays nothing.

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
        self._closed: tuple | None = None  # (step, sample size, seconds) of a sample closed, until settled
        self._buffers = SampleBuffers()  # what sampled steps keep: gather indices, the sample's vector

    def due(self, step: int) -> bool:
        """Whether ``step`` is sampled.

        Args:
            step: the optimizer step.

        Returns:
            True when the step is a multiple of the sampling period.
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
        self._gather = self._closed = None
        if not (enabled and self.due(step)):
            return
        stride, cap = self.settings.stride, self.settings.cap
        thinned = cap is not None and bool(self.elements_per_step)
        if thinned:
            stride *= max(1, math.ceil(self.elements_per_step / stride / cap))
        size = math.ceil(self.elements_per_step / stride) + self.tensors_per_step if self.tensors_per_step else None
        self._gather = StepGather(step, stride, thinned, size, self._buffers)  # at most a step's elements

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

    def estimate(self, sample: torch.Tensor) -> float:
        """This sampler's estimate of ``sample`` (one host read).

        Args:
            sample: the values of a step's sample.

        Returns:
            The entropy in nats.
        """
        if self.settings.estimator == "gaussian":
            return gaussian_entropy(sample)
        return histogram_entropy(sample, self.settings.bins)

    def close(self, totals: StepTotals) -> None:
        """The step's sample is complete: its estimate, its finite count and the followed budget signal's
        measure, made on the device and added to the step's ``totals`` (read with the step's one read,
        `settle`). A no-op on a step that was not sampled.

        Args:
            totals: the step's device values, read once at its end.
        """
        gather, self._gather = self._gather, None
        if gather is None:
            return
        start = time.perf_counter()
        sample = gather.sample(self.settings.cap)
        values = {}
        if sample.numel():
            if self.settings.estimator == "gaussian":
                values["entropy"], values["entropy_finite"] = gaussian_variance_on_device(sample)
            else:
                values["entropy"], values["entropy_finite"] = histogram_entropy_on_device(sample, self.settings.bins)
            for signal in self.signals:
                measured = signal.measure(sample.float(), finite_mask(sample))
                if measured is not None:
                    values[f"signal:{signal.name}"] = measured
            totals.add(**values)
        self._closed = (gather.step, sample.numel(), gather.seconds + time.perf_counter() - start)

    def settle(self, totals: StepTotals) -> float | None:
        """The step's estimate, read from ``totals`` (the step's one read), into the history.

        Args:
            totals: the step's values, read.

        Returns:
            The step's entropy in nats, or None when the step was not sampled or nothing it sampled was finite.
        """
        closed, self._closed = self._closed, None
        if closed is None:
            return None
        step, size, seconds = closed
        self.calls += 1
        self.last_seconds = seconds
        self.seconds_total += seconds
        finite = int(totals.get("entropy_finite", 0))
        self.nonfinite_total += size - finite
        if not finite:
            return None
        value = totals["entropy"]
        if self.settings.estimator == "gaussian":
            value = gaussian_entropy_of(value) if finite > 1 else float("nan")
        for signal in self.signals:
            measured = signal.value(totals.get(f"signal:{signal.name}", math.nan))
            if measured is not None and math.isfinite(measured):
                self.series.setdefault(signal.name, []).append((step, measured))
        if math.isfinite(value):
            self.history.append((step, value + 0.0))  # no −0.0
            return value + 0.0
        return None

    def finish(self) -> float | None:
        """`close` and `settle` at once, the host reading the estimate now (where no step record keeps
        the values: the experiments' own loops).

        Returns:
            The step's entropy in nats, or None (as `settle`).
        """
        totals = StepTotals()
        self.close(totals)
        device = totals.device_of_values()
        if device is not None:
            totals.send(device)
        totals.read()
        return self.settle(totals)

    def signal_series(self) -> dict[str, list[tuple[int, float]]]:
        """The series a budget signal can read by name.

        Returns:
            The entropy and each followed signal's own measure by name, each a list of (step, value).
        """
        return {"entropy": self.history, **self.series}

    def values(self) -> list[float]:
        """The entropy estimates so far.

        Returns:
            The estimates in nats, oldest first.
        """
        return [value for _, value in self.history]

    def state_dict(self) -> dict:
        """What a resumed run needs of the sampler.

        Returns:
            The history, the signals' series and the counters, as plain values.
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
        """Continue from a `state_dict`.

        Args:
            state: what `state_dict` returned.
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
