"""DAC, the window controller: when to compress and at which rank (pure logic, no collectives).

Phases of a run (paper §2.7, §2.8, §2.11):

* ``profile``  – r_max unknown: gradients are synced uncompressed while a compressed sync at
  ranks …, 8, 4, 2 is timed beside it, from the top down; ends at the first rank faster than the
  plain sync, r_max = the largest such rank (interpolated between the last two tried). Pipeline
  stages, whose alignment needs every rank's time, go up from 2 until a rank is slower. Profiling
  steps are uncompressed, so they count towards the warm-up floor. Top-down profiling starts with
  a quick test that blocks nothing: the top candidate's shadow sync, timed cold at the step's end
  (an upper bound on its time), against the host's wait for the plain sync after backward (a lower
  bound on the plain sync's). If the candidate is faster even so, it is r_max; where the bounds
  prove nothing (a fast link), the timing above follows, one step later.
* ``warmup``   – uncompressed until t ≥ max(⌊f_w·T⌋, t_e). t_e is the first window boundary where
  the rank-r_min error of today's 2-D gradients is ≤ the rank-r_max error measured when warm-up
  began (squared Frobenius norm, summed over this rank's matrices, averaged over ranks).
* ``compress`` – PowerSGD at the current rank; at each window boundary a new rank from the
  entropy series, at most ``rank_step`` away from the last, within [r_min, r_max], but only when
  the entropy has really moved (the noise gate below).
* the warm-up also ends at ⌊max_warmup_fraction·T⌋ steps, whether or not the error test passed.

The noise gate (what makes a decision follow the entropy trend, not its sampling noise):

* The *reference* is every entropy sample taken since the rank last changed (since compression
  began), except the latest window; the *latest* is the last window's samples.
* The shift ΔH = mean(latest) − mean(reference) counts only if |ΔH| > k·SE, with
  SE = √(s²_ref/n_ref + s²_latest/n_latest) from the samples themselves and k =
  ``entropy_significance``, and only if the window before also passed that test (against the
  samples before it) with the same sign. Otherwise the rank stays where it is.
* Hysteresis: the reference stays put (and grows, so its SE shrinks) until a shift is accepted
  *and* moves the rank; then it restarts at the new level. A stationary stream therefore keeps
  its rank, a lasting step moves the rank once and keeps it there, a falling staircase moves
  it down once per stair.
* The paper's mappings are the target functions applied to an accepted shift: ``cqm`` maps
  (H_ref, H_latest) to r₁ = g⁻¹(e^{c(H_ref−H_latest)}·g(r₀)); ``delta`` maps ρ = |ΔH| / |change
  between the first two windows| linearly to [r_min, r_max].

* ``off``      – profiling found no rank faster than uncompressed: compression never pays.

Who picks the rank while compressing: a hand-set ``rank_schedule`` (no decisions; the rank
follows the step), else the controller's rank rule (`RankRule`), chosen once from the config: the
byte budget (``rank_budget`` set: `edgc.control.budget.BudgetRule` plans the rest of the run at every window
boundary, from the chosen ``budget_signal``) or the paper's rules (`edgc.policies.rank_rules.PaperRules`,
the ``paper`` mode) with the ``rank_mapping``.

The controller only plans steps and turns *agreed* inputs (`edgc.policies.plans.DecisionInputs`) into
decisions. The decision round (`edgc.control.decisions`) measures, agrees (all-reduce), lets group rank 0
``propose`` and broadcasts the proposal, and every rank ``apply``-s the same decision, so ranks
never diverge.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

from ..config import EDGCConfig
from ..policies.plans import (
    COMPRESS,
    OFF,
    PHASES,
    PROFILE,
    PROFILE_START_STEP,
    WARMUP,
    Agreed,
    ControllerView,
    Decision,
    DecisionInputs,
    StepPlan,
)
from ..policies.rank_rules import PaperRules
from ..policies.rank_split import ExpertSplit, rank_split
from .budget import BudgetRule
from .profiling import ProfilingRun, SyncTimeTable, profile_candidates


class RankRule(Protocol):
    """Who picks the rank while compressing (without a hand-set schedule), chosen once per controller:
    `edgc.control.budget.BudgetRule` with a byte budget, `edgc.policies.rank_rules.PaperRules` without one."""

    def default_r_min(self, r_max: int) -> int:
        """r_min when the config leaves it open."""

    def first_rank(self, controller: ControllerView, step: int) -> int:
        """The rank of the first compressed window, which starts at ``step``."""

    def may_decide(self, step: int) -> bool:
        """Whether the window boundary at the end of ``step`` decides (given the controller's own rules)."""

    def budget_state(self, schedule: Sequence[tuple[int, int]], step: int) -> dict | None:
        """The byte budget and what has been spent of it by ``step``; None without a budget."""

    def propose(self, controller: ControllerView, inputs: DecisionInputs) -> tuple[int, float | None, float | None]:
        """(rank, need, target) for the next window, from the agreed measurements and the series."""


def rank_rule(config: EDGCConfig) -> RankRule:
    """The rank rule ``config`` asks for: the byte budget when it sets one, else the paper's rules."""
    return BudgetRule(config) if config.rank_budget is not None else PaperRules(config)


@dataclass
class WarmupTest:
    """The warm-up and its error test: the step it began at (None while profiling runs), the rank-r_max
    error measured then (E_max; None until measured), and t_e, the step after the first window end
    whose rank-r_min error was at most E_max (None until then)."""

    start: int | None
    error_at_start: float | None = None
    error_test_step: int | None = None


class WindowController:
    """DAC's controller of one `EDGCState` (see the module docstring): plans each step and turns agreed
    measurements into decisions; pure logic, no collectives.

    Args:
        config: the `EDGCConfig` (window, warm-up, r_max/r_min, rank rule).
        follower: the rank is set from outside with `follow` (pipeline stages after the first).
        always_profile: measure the sync-time table even when r_max is given (stage alignment needs it).
    """

    def __init__(self, config: EDGCConfig, *, follower: bool = False, always_profile: bool = False):
        self.config = config
        self.rule = rank_rule(config)
        self.follower = follower
        self.always_profile = always_profile
        self.r_max = config.r_max
        self.r_min = config.r_min if config.r_min is not None else self._default_r_min(config.r_max)
        profile = config.r_max is None or always_profile
        self.phase = PROFILE if profile else WARMUP
        self.rank: int | None = None
        self.schedule: list[tuple[int, int]] = []  # (first step, rank) each time the rank changes; 0 = off
        # The order candidates are timed in: from the top down (unless stage alignment needs every
        # rank's time), where the first rank faster than the plain sync ends profiling, so where
        # compression pays (a slow link, where each profiling step is expensive) one candidate
        # usually suffices; where it does not, steps are cheap.
        self.profiling = ProfilingRun(profile_candidates(config.profile_max_rank), top_down=not always_profile)
        self.warmup = WarmupTest(start=None if profile else 0)
        self.error_windows: list[tuple[int, float]] = []  # (step, window mean of ‖M−Ĝ‖²/‖M‖²), agreed
        self.split = ExpertSplit(rank_split(config.rank_split))  # how the rank is shared among experts

    def _default_r_min(self, r_max: int | None) -> int | None:
        return None if r_max is None else self.rule.default_r_min(r_max)

    def budget_state(self, step: int) -> dict | None:
        """The byte budget's account at ``step``.

        Args:
            step: the optimizer step.

        Returns:
            The budget, the compressed steps planned and done, and the mean rank so far; None without a budget.
        """
        return self.rule.budget_state(self.schedule, step)

    def _scheduled_rank(self, step: int) -> int | None:
        """The hand-set rank in force at ``step`` (None before its first entry)."""
        rank = None
        for start, value in self.config.rank_schedule or ():
            if start <= step:
                rank = value
        return None if rank is None else min(rank, self.r_max or rank)

    # ------------------------------------------------------------------ planning
    def _window_end(self, step: int) -> bool:
        return (step + 1) % self.config.window == 0

    def _warmup_over(self, step: int) -> bool:
        if step < self.config.warmup_floor():
            return False
        if not self.config.warmup_error_test or step >= self.config.warmup_ceiling():
            return True
        return self.warmup.error_test_step is not None and step >= self.warmup.error_test_step

    def plan(self, step: int) -> StepPlan:
        """Plan ``step``: its phase and rank, what it profiles or probes, whether it ends in a decision.

        Args:
            step: the optimizer step about to run.

        Returns:
            The step's plan.
        """
        if self.follower:
            return self._plan_follower(step)
        if self.phase == WARMUP and self._warmup_over(step):
            self.phase = COMPRESS
            self.rank = self.rule.first_rank(self, step)
            self.schedule.append((step, self.rank))
        if self.phase == COMPRESS and self.config.rank_schedule is not None:
            scheduled = self._scheduled_rank(step)
            if scheduled is not None and scheduled != self.rank:
                self.rank = scheduled
                self.schedule.append((step, scheduled))
        if self.phase == PROFILE:
            return self._plan_profile(step)
        if self.phase == WARMUP:
            probe = None
            if self.config.warmup_error_test:
                if self.warmup.error_at_start is None:  # normally just the first warm-up step
                    probe = self.r_max
                elif self.warmup.error_test_step is None and self._window_end(step):
                    probe = self.r_min
            return StepPlan(step, WARMUP, None, probe_rank=probe, decision=probe is not None)
        if self.phase == COMPRESS:
            decide = (
                self.config.adaptive
                and self.config.rank_schedule is None
                and self._window_end(step)
                and step > self.schedule[-1][0]
                and self.rule.may_decide(step)
            )
            return StepPlan(step, COMPRESS, self.rank, decision=decide)
        return StepPlan(step, OFF, None)

    def _plan_follower(self, step: int) -> StepPlan:
        if self.phase == PROFILE:
            return self._plan_profile(step)
        return StepPlan(step, self.phase, self.rank if self.phase == COMPRESS else None)

    def follow(self, step: int, rank: int | None) -> None:
        """Adopt an externally decided rank. Followers only; ignored while the stage is still profiling
        or when profiling found compression never pays.

        Args:
            step: the first step of the rank.
            rank: the rank (None = uncompressed).

        Raises:
            RuntimeError: not a follower.
        """
        if not self.follower:
            raise RuntimeError("follow() is for follower controllers (pipeline stages after the first)")
        if self.phase in (PROFILE, OFF):
            return
        if self.phase != COMPRESS or rank != self.rank:
            self.phase, self.rank = COMPRESS, rank
            self.schedule.append((step, rank or 0))

    def agree(self, step: int, rank: int | None) -> None:
        """Adopt a rank, if compressing: a leader whose peers outside its group (the TP ranks of its
        pipeline stage) agreed on it. Same bookkeeping as a decision.

        Args:
            step: the first step of the rank.
            rank: the agreed rank (None: no change).
        """
        if self.phase == COMPRESS and rank is not None and rank != self.rank:
            self.rank = rank
            self.schedule.append((step, rank))

    def _plan_profile(self, step: int) -> StepPlan:
        offset = step - PROFILE_START_STEP
        if offset < 0:
            return StepPlan(step, PROFILE, None)
        profiling = self.profiling
        if profiling.top_down:
            # The quick test: the first candidate timed at the step's end (cold, so an upper bound)
            # against the plain sync's wait after backward (a lower bound), nothing blocking. If it
            # pays even so, r_max is found at the cost of one shadow sync; else the full timing below.
            if offset == 0:
                return StepPlan(step, PROFILE, None, profile_rank=profiling.order[0], profile_bound=True, decision=True)
            offset -= 1
        # The paper spends a whole uncompressed "transition" step per candidate rank. Here one-off
        # costs (cold code paths, first allocations) fall on the run's first shadow call only (the
        # quick test's, when there was one), so only that one gets an untimed call before it; and the
        # plain sync, whose time does not depend on the candidate, is timed (blocking) in the first
        # candidate's steps only: later profiling steps overlap it with backward like a warm-up step
        # and cost only their shadow sync.
        block = self.config.profile_steps_per_rank
        index, position = divmod(offset, block)
        candidate = profiling.order[min(index, len(profiling.order) - 1)]
        return StepPlan(
            step,
            PROFILE,
            None,
            profile_rank=candidate,
            profile_warm=offset == 0 and not profiling.top_down,
            profile_raw=index == 0,
            decision=position == block - 1,
        )

    # ------------------------------------------------------------------ deciding
    def current(self) -> Decision:
        """The decision in force: phase, r_max and r_min, rank and the warm-up's error test.

        Returns:
            The decision, a new object.
        """
        warmup = self.warmup
        return Decision(self.phase, self.r_max, self.r_min, self.rank, warmup.error_test_step, warmup.error_at_start)

    def propose(self, inputs: DecisionInputs) -> Decision:
        """Group rank 0's decision at a decision point. Reads state, changes nothing.

        Args:
            inputs: the plan, the agreed measurements, the series (`edgc.policies.plans.DecisionInputs`).

        Returns:
            The decision, for every rank to `apply`.
        """
        plan, agreed, profiling = inputs.plan, inputs.agreed, self.profiling
        decision = self.current()
        if plan.phase == PROFILE:
            table = SyncTimeTable(profiling.table.uncompressed, dict(profiling.table.by_rank))
            self._record_profile(table, plan, agreed)
            last = plan.profile_rank == profiling.order[-1] and not plan.profile_bound
            uncompressed = table.uncompressed if table.uncompressed is not None else math.nan
            found = (
                agreed.profile_time <= uncompressed
                if profiling.top_down  # the largest rank that pays
                else agreed.profile_time > uncompressed
            )  # going up: the first rank that does not
            if found or last:
                measured = table.rank_ceiling()
                decision.r_max = self.config.r_max if self.config.r_max is not None else measured
                if decision.r_max is None:
                    decision.phase = OFF
                else:
                    decision.phase = WARMUP
                    decision.r_min = self.config.r_min or self._default_r_min(decision.r_max)
                    decision.r_min = min(decision.r_min, decision.r_max)
        elif plan.phase == WARMUP:
            if self.warmup.error_at_start is None:
                if math.isfinite(agreed.probe_error):  # a NaN/Inf gradient: measure again next step
                    decision.error_at_start = agreed.probe_error
            elif agreed.probe_error <= self.warmup.error_at_start:
                decision.error_test_step = plan.step + 1
        elif plan.phase == COMPRESS:
            decision.rank, decision.need, decision.target = self.rule.propose(self, inputs)
        return decision

    @staticmethod
    def _record_profile(table: SyncTimeTable, plan: StepPlan, agreed: Agreed) -> None:
        if plan.profile_bound:  # the quick test counts only where it proves the candidate pays
            if agreed.profile_time <= agreed.uncompressed_bound:  # False with a NaN
                table.by_rank[plan.profile_rank] = agreed.profile_time  # type: ignore[index]
                table.uncompressed, table.uncompressed_is_bound = agreed.uncompressed_bound, True
            return
        if plan.profile_rank is not None and math.isfinite(agreed.profile_time):
            table.by_rank[plan.profile_rank] = agreed.profile_time
        if math.isfinite(agreed.uncompressed_time):  # timed in the first candidate's block only (`_plan_profile`)
            table.uncompressed, table.uncompressed_is_bound = agreed.uncompressed_time, False

    def apply(self, inputs: DecisionInputs, decision: Decision) -> None:
        """Adopt a decision (the same on every rank) at the end of ``inputs.plan.step``.

        Args:
            inputs: the round's, as `propose` read them.
            decision: the decision group rank 0 proposed.
        """
        plan, agreed = inputs.plan, inputs.agreed
        if plan.phase == PROFILE:
            self._record_profile(self.profiling.table, plan, agreed)
        self.r_max, self.r_min = decision.r_max, decision.r_min
        self.warmup.error_at_start, self.warmup.error_test_step = decision.error_at_start, decision.error_test_step
        if decision.phase != self.phase:
            self.phase = decision.phase
            if self.phase == WARMUP:
                self.warmup.start = plan.step + 1
            if self.phase == OFF:
                self.schedule.append((plan.step + 1, 0))
        if plan.phase == COMPRESS and math.isfinite(agreed.relative_error):
            self.error_windows.append((plan.step, agreed.relative_error))
        if self.phase == COMPRESS and decision.rank != self.rank:
            self.rank = decision.rank
            self.schedule.append((plan.step + 1, decision.rank))

    # ------------------------------------------------------------------ saying what profiling found
    def profiling_verdict(self) -> dict | None:
        """What profiling found, once it is over; None while it runs, or when r_max was given.

        ``{"status": "off" | "floor" | "found", "r_max": …, "uncompressed_s": …, "uncompressed_is_bound": …,
        "compressed_s": {rank: s}}``, times in seconds per step as measured (averaged over the group).
        ``off``: no rank pays, compression is off; ``floor``: r_max is the lowest candidate rank;
        ``found``: a higher one. Only a *profiled* r_max can be at its floor: a given r_max is the
        user's choice.

        Returns:
            The verdict, or None.
        """
        table = self.profiling.table
        if self.follower or not table.by_rank or self.phase == PROFILE or self.config.r_max is not None:
            return None
        if self.phase == OFF:
            status = "off"
        elif self.r_max is not None and self.r_max <= min(self.profiling.candidates):
            status = "floor"
        else:
            status = "found"
        return {
            "status": status,
            "r_max": self.r_max,
            "uncompressed_s": table.uncompressed,
            "uncompressed_is_bound": table.uncompressed_is_bound,
            "compressed_s": {int(r): t for r, t in sorted(table.by_rank.items())},
        }

    # ------------------------------------------------------------------ checkpointing
    def state_dict(self) -> dict:
        """The phase, ranks, schedule, sync-time table, warm-up test and the experts' split.

        Returns:
            The state, for `load_state_dict`.
        """
        return {
            "follower": self.follower,
            "phase": self.phase,
            "r_max": self.r_max,
            "r_min": self.r_min,
            "rank": self.rank,
            "schedule": list(self.schedule),
            "table": self.profiling.table.state_dict(),
            "warmup_start": self.warmup.start,
            "error_at_start": self.warmup.error_at_start,
            "error_test_step": self.warmup.error_test_step,
            "error_windows": list(self.error_windows),
            "split_weights": dict(self.split.weights),
        }

    def load_state_dict(self, state: dict) -> None:
        """Restore what `state_dict` returned.

        Args:
            state: a controller's state, a follower's for a follower.

        Raises:
            ValueError: an unknown phase, or a follower's state for a leader (or back).
        """
        if state["phase"] not in PHASES:
            raise ValueError(f"unknown phase {state['phase']!r} in EDGC controller state")
        if state.get("follower", False) != self.follower:
            raise ValueError("EDGC controller state of a pipeline follower stage cannot load into a leader, or back")
        self.phase, self.r_max, self.r_min, self.rank = state["phase"], state["r_max"], state["r_min"], state["rank"]
        self.schedule = [(int(s), int(r)) for s, r in state["schedule"]]
        self.profiling.table.load_state_dict(state["table"])
        self.warmup = WarmupTest(state["warmup_start"], state["error_at_start"], state["error_test_step"])
        self.error_windows = [(int(s), float(v)) for s, v in state.get("error_windows", [])]
        self.split.weights = {str(name): float(v) for name, v in state.get("split_weights", {}).items()}
