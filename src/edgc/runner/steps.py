"""One optimizer step as a `GradientReducer` keeps it: a `StepRecord`, and the metrics of a settled one.

A record lives from the step's first bucket until the next step begins: what the sync method
planned for it, what its jobs sent (`edgc.runner.stats.ReduceStats`), the values it needs on the host
(`StepTotals`: added by name, sent as one device tensor at its end, read once when it is settled),
its collectives' and jobs' stamps, and once settled its metrics (`step_metrics`, plus the method's
own). With ``defer_commit`` it also keeps the snapshot of the state from before it until the step is
committed or rolled back.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

from ..device.timing import Clock
from ..device.totals import StepTotals
from ..distributed.comm import StepCollectives
from .stats import ReduceStats


@dataclass
class StepRecord:
    """One optimizer step, from its first bucket until it is settled (`GradientReducer.settle`)."""

    step: int
    snapshot: dict | None = None  # with defer_commit: the state before the step, until committed or rolled back
    plan: Any = None  # what the method planned for the step (`_plan_step`; EDGC: a `edgc.policies.plans.StepPlan`)
    always_timed: bool = False  # take device timestamps whatever the cadence (EDGC's profiling)
    fusion_mb: float | None = 0  # MB of buckets one job syncs; 0: each its own; None: the device's (`edgc.runner.jobs`)
    stats: ReduceStats = field(default_factory=ReduceStats)
    totals: StepTotals = field(default_factory=StepTotals)  # the values it needs on the host, by name
    busy: list[tuple] = field(default_factory=list)  # (start, end) stamps of the jobs' time, on their stream
    collectives: StepCollectives | None = None
    local_done: bool = False
    shared_done: bool = False
    metrics: dict = field(default_factory=dict)  # once settled locally
    job_values: dict = field(default_factory=dict)  # name → each job's device value (`add`)

    def add(self, stats: ReduceStats) -> None:
        """What one job sent and measured, into the step's totals: counts added now, its device values
        (flag, errors) kept to be summed on the host once the step's values are read (`measured`), so
        that a job costs the step no device op."""
        total = self.stats
        for key in ("elements_raw", "elements_sent", "bytes_raw", "bytes_sent"):
            setattr(total, key, getattr(total, key) + getattr(stats, key))
        for key in ("nonfinite", "error_sq", "norm_sq"):
            scale = 1.0 if key == "nonfinite" else stats.measured_scale
            self.job_values.setdefault(key, []).append((getattr(stats, key), scale))
        total.ranks.update(stats.ranks)

    def measured(self) -> dict[str, tuple[list, list]]:
        """Per name (``nonfinite``, ``error_sq``, ``norm_sq``) what every job of the step gave, the step's own
        record's value first, and what each is weighted by: numbers, or device tensors of one element
        (`StepTotals.add_sum`)."""
        own = self.stats
        measured = {}
        for key in ("nonfinite", "error_sq", "norm_sq"):
            pairs = [(getattr(own, key), 1.0), *self.job_values.get(key, [])]
            measured[key] = ([value for value, _ in pairs], [scale for _, scale in pairs])
        return measured


def step_metrics(record: StepRecord) -> dict:
    """The metrics every sync method reports of a settled step (its `StepTotals` read)."""
    stats, totals = record.stats, record.totals
    error_sq, norm_sq = totals.get("error_sq"), totals.get("norm_sq")
    durations = record.collectives.durations() if record.collectives is not None else []
    timed = all(d is not None for d in durations)
    waited = record.collectives.wait_seconds() if record.collectives is not None else None
    busy = Clock.total(record.busy)
    return {
        "step": record.step,
        "elements_raw": stats.elements_raw,
        "elements_sent": stats.elements_sent,
        "bytes_raw": stats.bytes_raw,
        "bytes_sent": stats.bytes_sent,
        "timed": timed and busy is not None,  # False: an untimed step on an accelerator (edgc.device.timing)
        "comm_time_s": sum(durations) if timed else None,  # type: ignore[arg-type]
        "comm_wait_s": waited,
        "collectives": len(durations),
        "collective_s": durations if timed else None,
        "compress_time_s": max(0.0, busy - (waited or 0.0)) if busy is not None else None,
        "relative_error": math.sqrt(error_sq / norm_sq) if norm_sq > 0 else None,
        "nonfinite": bool(totals.get("nonfinite")),
        "ranks": dict(stats.ranks),
    }
