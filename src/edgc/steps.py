"""One optimizer step as a `GradientReducer` keeps it: a `StepRecord`, and the metrics of a settled one.

A record lives from the step's first bucket until the next step begins: what the sync method
planned for it, what its jobs sent (`edgc.lowrank.ReduceStats`), the values it needs on the host
(`StepTotals`: added by name, sent as one device tensor at its end, read once when it is settled),
its collectives' and jobs' stamps, and once settled its metrics (`step_metrics`, plus the method's
own). With ``defer_commit`` it also keeps the snapshot of the state from before it until the step is
committed or rolled back.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from .comm import StepCollectives
from .lowrank import ReduceStats
from .timing import Clock, HostCopy, device_scalar


class StepTotals:
    """The values a step needs on the host, by name. Each part adds its own: the reducer the non-finite
    flag, ‖M−Ĝ‖² and ‖M‖² (``nonfinite``, ``error_sq``, ``norm_sq``), a method its extras (EDGC's
    warm-up probe), as Python numbers, 0-dim device tensors (`add`) or the elements of a 1-D float64
    one (`add_vector`). Adding touches no tensor: at the step's end `send` stacks them, on the stream
    where they were computed, into one float64 device tensor that goes to the host behind an event
    (`edgc.timing.HostCopy`), and `read` reads it, once, when the step is settled. Then they are read
    by name: ``totals[name]``, ``name in totals``, ``totals.get(name)`` (0.0 for a name not added: a
    step that saw no device sends nothing)."""

    def __init__(self) -> None:
        self._names: list[str] = []
        self._parts: list[tuple[bool, float | bool | torch.Tensor]] = []  # (a vector, its value), in name order
        self._copy: HostCopy | None = None
        self._host: dict[str, float] | None = None

    def add(self, **values: float | bool | torch.Tensor) -> None:
        """Named scalars for the host."""
        self._take(list(values), [(False, value) for value in values.values()])

    def add_vector(self, names: Sequence[str], vector: torch.Tensor) -> None:
        """The elements of a 1-D float64 device tensor for the host, one name each, in order."""
        if vector.dim() != 1 or vector.numel() != len(names):
            raise ValueError(f"StepTotals: {len(names)} names for a tensor of shape {tuple(vector.shape)}")
        self._take(list(names), [(True, vector)])

    def _take(self, names: list[str], parts: list[tuple[bool, float | bool | torch.Tensor]]) -> None:
        if self._copy is not None or self._host is not None:
            raise RuntimeError(f"StepTotals: {names} added after the step's values were sent")
        twice = sorted(set(self._names) & set(names))
        if twice or len(set(names)) < len(names):
            raise ValueError(f"StepTotals: {twice or names} added twice")
        self._names += names
        self._parts += parts

    def send(self, device: torch.device) -> None:
        """Stack what was added into one float64 tensor on ``device``, made on the current stream (where
        the values were computed), and start its copy to the host."""
        values: list[torch.Tensor] = []
        for vector, value in self._parts:
            values += value.unbind() if vector else [device_scalar(value, device)]  # type: ignore[union-attr]
        if values:
            self._copy = HostCopy(torch.stack(values))

    def read(self) -> None:
        """Read the sent values: the step's one host read, which waits for their copy alone. Once."""
        if self._host is None:
            values = self._copy.values() if self._copy is not None else []
            self._host = dict(zip(self._names, values))
            self._parts, self._copy = [], None

    def _values(self) -> dict[str, float]:
        if self._host is None:
            raise RuntimeError("StepTotals: read only once the step is settled (`read`)")
        return self._host

    def __getitem__(self, name: str) -> float:
        return self._values()[name]

    def __contains__(self, name: str) -> bool:
        return name in self._values()

    def get(self, name: str, default: float = 0.0) -> float:
        return self._values().get(name, default)


@dataclass
class StepRecord:
    """One optimizer step, from its first bucket until it is settled (`GradientReducer.settle`)."""

    step: int
    snapshot: dict | None = None  # with defer_commit: the state before the step, until committed or rolled back
    plan: Any = None  # what the method planned for the step (`_plan_step`; EDGC: a `edgc.plans.StepPlan`)
    always_timed: bool = False  # take device timestamps whatever the cadence (EDGC's profiling)
    stats: ReduceStats = field(default_factory=ReduceStats)
    totals: StepTotals = field(default_factory=StepTotals)  # the values it needs on the host, by name
    busy: list[tuple] = field(default_factory=list)  # (start, end) stamps of the jobs' time, on their stream
    collectives: StepCollectives | None = None
    local_done: bool = False
    shared_done: bool = False
    metrics: dict = field(default_factory=dict)  # once settled locally

    def add(self, stats: ReduceStats) -> None:
        """What one job sent and measured, into the step's totals."""
        total = self.stats
        for key in ("elements_raw", "elements_sent", "bytes_raw", "bytes_sent", "error_sq", "norm_sq"):
            setattr(total, key, getattr(total, key) + getattr(stats, key))
        total.nonfinite = total.nonfinite | stats.nonfinite
        total.ranks.update(stats.ranks)


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
        "timed": timed and busy is not None,  # False: an untimed step on an accelerator (edgc.timing)
        "comm_time_s": sum(durations) if timed else None,  # type: ignore[arg-type]
        "comm_wait_s": waited,
        "collectives": len(durations),
        "collective_s": durations if timed else None,
        "compress_time_s": max(0.0, busy - (waited or 0.0)) if busy is not None else None,
        "relative_error": math.sqrt(error_sq / norm_sq) if norm_sq > 0 else None,
        "nonfinite": bool(totals.get("nonfinite")),
        "ranks": dict(stats.ranks),
    }
