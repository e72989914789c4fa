"""The byte budget: spend a mean rank over the compressed steps, more of it early (pure logic).

The user states a budget B as a mean rank over the N compressed steps of the run (the factor
bytes of a step are linear in the rank, so this is a bytes-per-step target). At each window
boundary the controller has spent S rank-steps in the first d compressed steps and asks for the
rank of the next window:

    even   = (B·N − S) / (N − d)              the rate that spends the rest evenly
    target = even · (1 + (front_load − 1)·need)

clamped so that the rest of the run can still be paid at r_min … r_max, and rounded to the
nearest rank of the grid. ``need`` ∈ [0, 1] says how much the current moment is still the
"early", critical regime in which a higher rank pays. The fixed ``schedule`` signal sets need =
the fraction of compressed steps still to come: with front_load = 2 the rank then falls from 2B
through B to about B/2 (B = 4: 8, 6, 4, 2 over 40, 80, 80, 160 steps of 360), the staircase
that beat static PowerSGD at equal bytes in a first prototype. With need ≡ 1 the target would decay to r_min; with need
= 0 the
budget is spent evenly. Whatever ``need`` does, the budget is kept: every window re-plans the
remainder, so a rounding or an early surge is paid back later, and the last window spends what
is left (up to the grid's rounding).

Why early: a first prototype (tiny GPT-2, 3 seeds) found that at equal bytes a
decreasing schedule beats static PowerSGD and an increasing one loses (docs/results/pareto.md);
the paper's premise (entropy falls, so a lower rank suffices later) and
Accordion's critical regime say the same.

``need`` comes from the budget signal the config names (`edgc.policies.signals`): a fixed schedule, or the
normalised, noise-gated trend of a per-window series (entropy, log gradient norm, relative
compression error). `BudgetRule` is the controller's rank rule with a budget.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

from ..config import EDGCConfig
from ..policies.plans import ControllerView, DecisionInputs
from ..policies.signals import get_signal


def rank_grid(r_min: int, r_max: int, granularity: int) -> list[int]:
    """The ranks the budget controller may choose: r_min, r_max and the multiples of the granularity between."""
    return sorted({r_min, r_max, *range(granularity * math.ceil(r_min / granularity), r_max + 1, granularity)})


def spent_rank_steps(schedule: Sequence[tuple[int, int]], step: int) -> tuple[int, int]:
    """(Σ rank over the compressed steps before ``step``, number of those steps) from a schedule of
    (first step, rank) entries; rank 0 entries (compression off) count as uncompressed."""
    spent = steps = 0
    for (start, rank), nxt in zip(schedule, [*schedule[1:], (step, 0)]):
        length = max(0, min(nxt[0], step) - start)
        if rank > 0:
            spent += rank * length
            steps += length
    return spent, steps


def budget_target(
    *,
    budget: float,
    total: int,
    done: int,
    spent: float,
    window: int,
    need: float,
    front_load: float,
    r_min: int,
    r_max: int,
) -> float:
    """The rank the next window should run at (before rounding to the grid); see the module docstring."""
    left = max(1, total - done)
    remaining = budget * total - spent
    even = remaining / left
    target = even * (1.0 + (front_load - 1.0) * min(1.0, max(0.0, need)))
    span = min(window, left)
    # The rest of the run (after this window) must still be payable within [r_min, r_max].
    highest = (remaining - r_min * (left - span)) / span
    lowest = (remaining - r_max * (left - span)) / span
    return min(max(target, lowest, r_min), highest, r_max) if highest >= r_min else float(r_min)


def nearest_rank(target: float, grid: Sequence[int]) -> int:
    """The grid rank nearest to ``target`` (the lower one on a tie: a tie spends less)."""
    return min(grid, key=lambda r: (abs(r - target), r))


class BudgetRule:
    """The byte budget's rank rule (``EDGCConfig.rank_budget`` set): r_min = 1, and every window
    boundary, the first one included, re-plans the rest of the run from the signal's ``need``."""

    def __init__(self, config: EDGCConfig):
        self.config = config
        self.signal = get_signal(config.budget_signal)

    def default_r_min(self, r_max: int) -> int:
        return 1  # a budget bounds the bytes itself; its plan may go down to rank 1 late in the run

    def first_rank(self, controller: ControllerView, step: int) -> int:
        """The first compressed window's rank: early by definition (need = 1)."""
        return self.plan(controller, [(step, controller.r_max)], step, need=1.0)[0]

    def may_decide(self, step: int) -> bool:
        return step + 1 < (self.config.total_steps or 0)  # nothing left to spend after the last planned step

    def budget_state(self, schedule: Sequence[tuple[int, int]], step: int) -> dict | None:
        """The budget, the compressed steps planned and done, and the mean rank so far (None before
        compression starts, or once profiling turned it off)."""
        if not schedule or schedule[0][1] == 0:
            return None
        spent, done = spent_rank_steps(schedule, step)
        total = max(1, (self.config.total_steps or step) - schedule[0][0])
        return {
            "budget": self.config.rank_budget,
            "total": total,
            "done": done,
            "spent": spent,
            "mean_rank": spent / done if done else None,
        }

    def plan(
        self, controller: ControllerView, schedule: Sequence[tuple[int, int]], next_step: int, need: float
    ) -> tuple[int, float]:
        """The rank (on the grid) and the unrounded target for the window starting at ``next_step``."""
        r_min, r_max = controller.r_min, controller.r_max
        assert r_min is not None and r_max is not None
        state = self.budget_state(schedule, next_step)
        assert state is not None
        budget = min(max(self.config.rank_budget, r_min), r_max)  # a profiled r_max may sit below it
        target = budget_target(
            budget=budget,
            total=state["total"],
            done=state["done"],
            spent=state["spent"],
            window=self.config.window,
            need=need,
            front_load=self.config.front_load,
            r_min=r_min,
            r_max=r_max,
        )
        return nearest_rank(target, rank_grid(r_min, r_max, self.config.rank_granularity)), target

    def need(self, signals: dict[str, Sequence[tuple[int, float]]], progress: float) -> float:
        """The chosen signal's verdict in [0, 1]: 1 = still the early regime (spend above the even rate).
        ``signals``: every series by name; ``progress``: the fraction of the compressed steps done."""
        return self.signal.need(
            signals, progress=progress, window=self.config.window, significance=self.config.entropy_significance
        )

    def propose(self, controller: ControllerView, inputs: DecisionInputs) -> tuple[int, float, float]:
        """(rank, need, target) for the window after ``inputs.plan.step``."""
        step, error = inputs.plan.step, inputs.agreed.relative_error
        errors = list(controller.error_windows)  # the error signal's series, as apply() will record it
        if math.isfinite(error):
            errors.append((step, error))
        state = self.budget_state(controller.schedule, step + 1)
        progress = state["done"] / state["total"] if state else 0.0
        need = self.need({**inputs.signals, "error": errors}, progress)
        rank, target = self.plan(controller, controller.schedule, step + 1, need)
        return rank, need, target
