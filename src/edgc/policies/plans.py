"""What the controller plans for a step and what a decision carries (pure data, no logic).

`StepPlan` is identical on every rank (it depends only on agreed state); `Agreed` holds the
measurements averaged over the group at a decision point; `DecisionInputs` is everything a decision
reads besides the controller, built once per round; `Decision` is group rank 0's proposal,
broadcast as a float64 vector so that every rank applies the same one; `ControllerView` is what a
rank rule reads of the controller.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Protocol

PROFILE, WARMUP, COMPRESS, OFF = "profile", "warmup", "compress", "off"
PHASES = (PROFILE, WARMUP, COMPRESS, OFF)
PROFILE_START_STEP = 1  # step 0 carries one-off costs (allocation, DDP's bucket rebuild)


@dataclass(frozen=True)
class StepPlan:
    """What one optimizer step does; identical on every rank because it depends only on agreed state."""

    step: int
    phase: str
    rank: int | None  # compression rank of the real sync; None = uncompressed
    profile_rank: int | None = None  # also time a shadow compressed sync at this rank
    profile_warm: bool = False  # … after an untimed one (the run's first profiled step: cold code paths, allocation)
    profile_raw: bool = False  # time the plain sync too, blocking; otherwise it overlaps backward as in warm-up
    profile_bound: bool = False  # the quick test: the plain sync's wait after backward bounds its time from below
    probe_rank: int | None = None  # measure the local rank-r error of the 2-D gradients
    decision: bool = False  # agree measurements and broadcast a decision at the end of the step


@dataclass
class Decision:
    """The outcome of a decision point; broadcast from group rank 0 as a float64 vector."""

    phase: str
    r_max: int | None
    r_min: int | None
    rank: int | None
    error_test_step: int | None  # t_e
    error_at_start: float | None  # E_max
    need: float | None = None  # budget mode: the signal's verdict in [0, 1] (1 = still early)
    target: float | None = None  # budget mode: the unrounded rank the plan asked for

    def encode(self) -> list[float]:
        def number(value: float | None) -> float:
            return -1.0 if value is None else float(value)

        return [
            float(PHASES.index(self.phase)),
            number(self.r_max),
            number(self.r_min),
            number(self.rank),
            number(self.error_test_step),
            number(self.error_at_start),
            number(self.need),
            number(self.target),
        ]

    @classmethod
    def decode(cls, values: Sequence[float]) -> Decision:
        def integer(value: float) -> int | None:
            return None if value < 0 else int(round(value))

        def real(value: float) -> float | None:
            return None if value < 0 else float(value)

        return cls(
            PHASES[int(round(values[0]))],
            integer(values[1]),
            integer(values[2]),
            integer(values[3]),
            integer(values[4]),
            real(values[5]),
            real(values[6]),
            real(values[7]),
        )


@dataclass(frozen=True)
class Agreed:
    """Measurements averaged over the group at a decision point."""

    profile_time: float = math.nan  # compressed sync at plan.profile_rank, s/step
    uncompressed_time: float = math.nan  # plain all-reduce, s/step
    probe_error: float = math.nan  # squared truncation error at plan.probe_rank
    relative_error: float = math.nan  # window mean of ‖M−Ĝ‖²/‖M‖² over the compressed steps (error-band)
    uncompressed_bound: float = math.nan  # plain all-reduce, a lower bound: its wait after backward, s/step

    def encode(self) -> list[float]:
        return [
            self.profile_time,
            self.uncompressed_time,
            self.probe_error,
            self.relative_error,
            self.uncompressed_bound,
        ]


Series = tuple[tuple[int, float], ...]  # (step, value) samples, oldest first


@dataclass(frozen=True)
class DecisionInputs:
    """What a decision reads besides its controller, as plain values: built once per decision round from
    the state's parts, with the agreed measurements (`edgc.control.decisions.DecisionRound.agree`), and handed
    to `WindowController.propose`, its rank rule (`edgc.control.rank_control.RankRule.propose`) and
    `WindowController.apply` (`edgc.control.decisions.DecisionRound.run`). Sequences given as lists are kept
    as tuples."""

    plan: StepPlan  # the decision step's plan
    agreed: Agreed = field(default_factory=Agreed)  # the measurements averaged over the decision group
    entropies: tuple[float, ...] = ()  # the entropy series (nats), oldest first
    sample_steps: tuple[int, ...] | None = None  # the step of each entropy sample; None: all since the last change
    signals: Mapping[str, Series] = field(default_factory=dict)  # the budget signals' series by name (not 'error')
    shapes: tuple[tuple[int, int], ...] = ()  # (m, n) of the matrices compressed at r_max (the cqm mapping's)

    def __post_init__(self) -> None:
        plain = {
            "entropies": tuple(self.entropies),
            "sample_steps": None if self.sample_steps is None else tuple(self.sample_steps),
            "signals": {name: tuple(series) for name, series in self.signals.items()},
            "shapes": tuple(tuple(shape) for shape in self.shapes),
        }
        for name, value in plain.items():
            object.__setattr__(self, name, value)


class ControllerView(Protocol):
    """What a rank rule (`edgc.control.rank_control.RankRule`) reads of its controller."""

    rank: int | None  # the rank in force; None = uncompressed
    r_min: int | None
    r_max: int | None
    schedule: list[tuple[int, int]]  # (first step, rank) each time the rank changed; 0 = off
    error_windows: list[tuple[int, float]]  # (step, window mean of ‖M−Ĝ‖²/‖M‖²), agreed
