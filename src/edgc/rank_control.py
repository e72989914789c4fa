"""DAC, the window controller: when to compress and at which rank (pure logic, no collectives).

Phases of a run (paper §2.7, §2.8, §2.11):

* ``profile``  – r_max unknown: gradients are synced uncompressed while a compressed sync at
  ranks 2, 4, 8, … is timed beside it; ends with r_max = the largest rank still faster. Profiling
  steps are uncompressed, so they count towards the warm-up floor.
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

The controller only plans steps and turns *agreed* inputs into decisions. The state object
(`edgc.state`) measures, agrees (all-reduce), lets group rank 0 ``propose`` and broadcasts the
proposal, and every rank ``apply``-s the same decision, so ranks never diverge.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Sequence

from .config import EDGCConfig
from .profiling import SyncTimeTable, profile_candidates
from .rank_model import ErrorModel, cqm_target_rank

PROFILE, WARMUP, COMPRESS, OFF = "profile", "warmup", "compress", "off"
PHASES = (PROFILE, WARMUP, COMPRESS, OFF)
PROFILE_START_STEP = 1  # step 0 carries one-off costs (allocation, DDP's bucket rebuild)


# ---------------------------------------------------------------------------- rank mappings
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


def delta_target(entropies: Sequence[float], per_window: int, r_min: int, r_max: int) -> float:
    """The authors' linear map (paper §2.5) of the normalised windowed entropy change.

    ρ = |Δ latest two windows| / |Δ first two windows of training|; target = r_min + (r_max − r_min)·ρ.
    Fast-moving entropy (unstable regime) keeps the rank near r_max; a stable entropy lets it
    decay to r_min. With fewer than two windows of history the target is r_max.
    """
    means = window_means(entropies, per_window)
    if means is None:
        return float(r_max)
    change_now = abs(means[1] - means[0])
    first = entropies[:per_window], entropies[per_window : 2 * per_window]
    change_ref = abs(sum(first[1]) / per_window - sum(first[0]) / per_window)
    if change_ref == 0:
        ratio = 0.0 if change_now == 0 else 1.0
    else:
        ratio = min(change_now / change_ref, 1.0)
    return round(r_min + (r_max - r_min) * ratio)


def describe_profiling_verdict(verdict: dict, suggested_r_max: int = 16, flag: str = "--edgc ") -> str:
    """One line for people: what profiling measured, what it decided, and how to compress anyway."""
    def ms(seconds: float | None) -> str:
        return "?" if seconds is None else f"{1000 * seconds:.2f} ms"

    times = ", ".join(f"r={rank}: {ms(t)}" for rank, t in verdict["compressed_s"].items())
    measured = f"uncompressed all-reduce {ms(verdict['uncompressed_s'])}/step vs compressed sync {times}"
    advice = f"the link is faster than compression here: set {flag}r_max={suggested_r_max} to compress anyway"
    if verdict["status"] == "off":
        return f"EDGC compression is OFF: profiling found no rank faster than uncompressed ({measured}); {advice}."
    return (f"EDGC compresses only at its floor r_max={verdict['r_max']}: no higher rank was faster than "
            f"uncompressed ({measured}); {advice}.")


# ---------------------------------------------------------------------------- plans and decisions
@dataclass(frozen=True)
class StepPlan:
    """What one optimizer step does; identical on every rank because it depends only on agreed state."""

    step: int
    phase: str
    rank: int | None  # compression rank of the real sync; None = uncompressed
    profile_rank: int | None = None  # also time a shadow compressed sync at this rank
    profile_warm: bool = False  # … after an untimed one (first step of a rank: allocation, new Q columns)
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

    def encode(self) -> list[float]:
        def number(value: float | None) -> float:
            return -1.0 if value is None else float(value)

        return [float(PHASES.index(self.phase)), number(self.r_max), number(self.r_min), number(self.rank),
                number(self.error_test_step), number(self.error_at_start)]

    @classmethod
    def decode(cls, values: Sequence[float]) -> "Decision":
        def integer(value: float) -> int | None:
            return None if value < 0 else int(round(value))

        return cls(PHASES[int(round(values[0]))], integer(values[1]), integer(values[2]), integer(values[3]),
                   integer(values[4]), None if values[5] < 0 else float(values[5]))

    SIZE = 6


@dataclass
class Agreed:
    """Measurements averaged over the group at a decision point."""

    profile_time: float = math.nan  # compressed sync at plan.profile_rank, s/step
    uncompressed_time: float = math.nan  # plain all-reduce, s/step
    probe_error: float = math.nan  # squared truncation error at plan.probe_rank
    relative_error: float = math.nan  # window mean of ‖M−Ĝ‖²/‖M‖² over the compressed steps (error-band)

    def encode(self) -> list[float]:
        return [self.profile_time, self.uncompressed_time, self.probe_error, self.relative_error]

    SIZE = 4


class WindowController:
    def __init__(self, config: EDGCConfig, *, follower: bool = False, always_profile: bool = False):
        """``follower``: the rank is set from outside with `follow` (pipeline stages after the first);
        ``always_profile``: measure the sync-time table even when r_max is given (stage alignment needs it)."""
        self.config = config
        self.follower = follower
        self.r_max = config.r_max
        self.r_min = config.r_min if config.r_min is not None else self._default_r_min(config.r_max)
        profile = config.r_max is None or always_profile
        self.phase = PROFILE if profile else WARMUP
        self.rank: int | None = None
        self.schedule: list[tuple[int, int]] = []  # (first step, rank) each time the rank changes; 0 = off
        self.table = SyncTimeTable()
        self.warmup_start = None if profile else 0
        self.error_at_start: float | None = None
        self.error_test_step: int | None = None
        self._error_model: ErrorModel | None = None
        self._candidates = profile_candidates(config.profile_max_rank)

    @staticmethod
    def _default_r_min(r_max: int | None) -> int | None:
        return None if r_max is None else max(1, r_max // 4)

    # ------------------------------------------------------------------ planning
    def _window_end(self, step: int) -> bool:
        return (step + 1) % self.config.window == 0

    def _warmup_over(self, step: int) -> bool:
        if step < self.config.warmup_floor():
            return False
        if not self.config.warmup_error_test or step >= self.config.warmup_ceiling():
            return True
        return self.error_test_step is not None and step >= self.error_test_step

    def plan(self, step: int) -> StepPlan:
        if self.follower:
            return self._plan_follower(step)
        if self.phase == WARMUP and self._warmup_over(step):
            self.phase, self.rank = COMPRESS, self.r_max
            self.schedule.append((step, self.r_max))
        if self.phase == PROFILE:
            return self._plan_profile(step)
        if self.phase == WARMUP:
            probe = None
            if self.config.warmup_error_test:
                if self.error_at_start is None:  # normally just the first warm-up step
                    probe = self.r_max
                elif self.error_test_step is None and self._window_end(step):
                    probe = self.r_min
            return StepPlan(step, WARMUP, None, probe_rank=probe, decision=probe is not None)
        if self.phase == COMPRESS:
            decide = self.config.adaptive and self._window_end(step) and step > self.schedule[-1][0]
            return StepPlan(step, COMPRESS, self.rank, decision=decide)
        return StepPlan(step, OFF, None)

    def _plan_follower(self, step: int) -> StepPlan:
        if self.phase == PROFILE:
            return self._plan_profile(step)
        return StepPlan(step, self.phase, self.rank if self.phase == COMPRESS else None)

    def follow(self, step: int, rank: int | None) -> None:
        """Adopt an externally decided rank from ``step`` on (None = uncompressed). Followers only;
        ignored while the stage is still profiling or when profiling found compression never pays."""
        if not self.follower:
            raise RuntimeError("follow() is for follower controllers (pipeline stages after the first)")
        if self.phase in (PROFILE, OFF):
            return
        if self.phase != COMPRESS or rank != self.rank:
            self.phase, self.rank = COMPRESS, rank
            self.schedule.append((step, rank or 0))

    def agree(self, step: int, rank: int | None) -> None:
        """Adopt ``rank`` from ``step`` on, if compressing: a leader whose peers outside its group
        (the TP ranks of its pipeline stage) agreed on it. Same bookkeeping as a decision."""
        if self.phase == COMPRESS and rank is not None and rank != self.rank:
            self.rank = rank
            self.schedule.append((step, rank))

    def _plan_profile(self, step: int) -> StepPlan:
        offset = step - PROFILE_START_STEP
        if offset < 0:
            return StepPlan(step, PROFILE, None)
        # The paper spends a whole uncompressed "transition" step per candidate rank; a second,
        # untimed shadow call in the candidate's first step absorbs the same one-off costs.
        block = self.config.profile_steps_per_rank
        index, position = divmod(offset, block)
        candidate = self._candidates[min(index, len(self._candidates) - 1)]
        return StepPlan(step, PROFILE, None, profile_rank=candidate, profile_warm=position == 0,
                        decision=position == block - 1)

    # ------------------------------------------------------------------ deciding
    def current(self) -> Decision:
        return Decision(self.phase, self.r_max, self.r_min, self.rank, self.error_test_step, self.error_at_start)

    def propose(self, plan: StepPlan, agreed: Agreed, entropies: Sequence[float],
                shapes: list[tuple[int, int]], sample_steps: Sequence[int] | None = None) -> Decision:
        """Group rank 0's decision at a decision point. Reads state, changes nothing.

        ``sample_steps``: the step of each entropy sample; None = every sample counts as taken since
        the rank last changed."""
        decision = self.current()
        if plan.phase == PROFILE:
            table = SyncTimeTable(self.table.uncompressed, dict(self.table.by_rank))
            self._record_profile(table, plan.profile_rank, agreed)
            last = plan.profile_rank == self._candidates[-1]
            if agreed.profile_time > agreed.uncompressed_time or last:
                measured = table.rank_ceiling(multiple=4 if max(table.by_rank) >= 4 else 1)
                decision.r_max = self.config.r_max if self.config.r_max is not None else measured
                if decision.r_max is None:
                    decision.phase = OFF
                else:
                    decision.phase = WARMUP
                    decision.r_min = self.config.r_min or self._default_r_min(decision.r_max)
                    decision.r_min = min(decision.r_min, decision.r_max)
        elif plan.phase == WARMUP:
            if self.error_at_start is None:
                if math.isfinite(agreed.probe_error):  # a NaN/Inf gradient: measure again next step
                    decision.error_at_start = agreed.probe_error
            elif agreed.probe_error <= self.error_at_start:
                decision.error_test_step = plan.step + 1
        elif plan.phase == COMPRESS:
            if self.config.rank_mapping == "error-band":
                decision.rank = self.band_rank(agreed.relative_error)
            else:
                decision.rank = self.next_rank(entropies, shapes, sample_steps)
        return decision

    def next_rank(self, entropies: Sequence[float], shapes: list[tuple[int, int]],
                  sample_steps: Sequence[int] | None = None) -> int:
        """The rank for the next window: unchanged unless the noise gate accepts an entropy shift."""
        config = self.config
        assert self.rank is not None and self.r_min is not None and self.r_max is not None
        per_window = max(1, config.window // config.sample_every)
        if config.entropy_significance == 0:
            # Gate off: the paper's rule, a new target every window from the last two window means.
            means = window_means(entropies, per_window)
            if means is None:
                return self.rank
            h_ref, h_new = means
            if config.rank_mapping != "cqm":
                target = delta_target(entropies, per_window, self.r_min, self.r_max)
                return limit_rank(target, self.rank, self.r_min, self.r_max, config.rank_step, config.rank_granularity)
        else:
            since = self._samples_since_change(entropies, sample_steps)
            shift = confirmed_shift(since, per_window, config.entropy_significance)
            if shift is None:
                return self.rank
            reference, latest = since[:-per_window], since[-per_window:]
            h_ref, h_new = sum(reference) / len(reference), sum(latest) / len(latest)
        if config.rank_mapping == "cqm":
            if self._error_model is None:
                self._error_model = ErrorModel(samples=config.cqm_mc_samples, seed=config.seed)
            target: float = cqm_target_rank(self._error_model, shapes, self.rank, h_ref, h_new,
                                            config.cqm_exponent, self.r_min, self.r_max)
        else:
            first = entropies[:per_window], entropies[per_window : 2 * per_window]
            change_ref = abs(sum(first[1]) / per_window - sum(first[0]) / per_window) if len(entropies) >= 2 * per_window else 0.0
            ratio = 1.0 if change_ref == 0 else min(abs(h_new - h_ref) / change_ref, 1.0)
            target = round(self.r_min + (self.r_max - self.r_min) * ratio)
        return limit_rank(target, self.rank, self.r_min, self.r_max, config.rank_step, config.rank_granularity)

    def band_rank(self, relative_error: float) -> int:
        """'error-band' mapping: one ``rank_step`` up when the window's mean ‖M−Ĝ‖²/‖M‖² is above the
        band, one down when below, unchanged inside it or when unmeasured (the band is the hysteresis)."""
        assert self.rank is not None and self.r_min is not None and self.r_max is not None
        low, high = self.config.error_band
        target = self.rank
        if math.isfinite(relative_error) and relative_error > high:
            target = self.rank + self.config.rank_step
        elif math.isfinite(relative_error) and relative_error < low:
            target = self.rank - self.config.rank_step
        if target == self.rank:
            return self.rank
        granularity = self.config.rank_granularity
        if target > self.rank:  # round up, so a move up is never swallowed by the granularity
            target = -(-target // granularity) * granularity
        return limit_rank(target, self.rank, self.r_min, self.r_max, self.config.rank_step, granularity)

    def _samples_since_change(self, entropies: Sequence[float], sample_steps: Sequence[int] | None) -> list[float]:
        """The entropy samples taken since the rank last changed (compression start counts as a change)."""
        if sample_steps is None or not self.schedule:
            return list(entropies)
        since = self.schedule[-1][0]
        return [value for step, value in zip(sample_steps, entropies) if step >= since]

    @staticmethod
    def _record_profile(table: SyncTimeTable, rank: int | None, agreed: Agreed) -> None:
        if rank is not None and math.isfinite(agreed.profile_time):
            table.by_rank[rank] = agreed.profile_time
        if math.isfinite(agreed.uncompressed_time):
            # Each candidate block also timed the plain sync; keep the running mean.
            count = len(table.by_rank)
            previous = table.uncompressed if table.uncompressed is not None else agreed.uncompressed_time
            table.uncompressed = previous + (agreed.uncompressed_time - previous) / max(count, 1)

    def apply(self, plan: StepPlan, agreed: Agreed, decision: Decision) -> None:
        """Adopt a decision (the same on every rank) at the end of ``plan.step``."""
        if plan.phase == PROFILE:
            self._record_profile(self.table, plan.profile_rank, agreed)
        self.r_max, self.r_min = decision.r_max, decision.r_min
        self.error_at_start, self.error_test_step = decision.error_at_start, decision.error_test_step
        if decision.phase != self.phase:
            self.phase = decision.phase
            if self.phase == WARMUP:
                self.warmup_start = plan.step + 1
            if self.phase == OFF:
                self.schedule.append((plan.step + 1, 0))
        if self.phase == COMPRESS and decision.rank != self.rank:
            self.rank = decision.rank
            self.schedule.append((plan.step + 1, decision.rank))

    # ------------------------------------------------------------------ saying what profiling found
    def profiling_verdict(self) -> dict | None:
        """Why compression is off, or pinned at its lowest candidate rank, after profiling; None otherwise.

        ``{"status": "off" | "floor", "r_max": …, "uncompressed_s": …, "compressed_s": {rank: s}}``,
        times in seconds per step as measured (averaged over the group). Only a *profiled* r_max
        can be at its floor: a given r_max is the user's choice.
        """
        if self.follower or not self.table.by_rank or self.phase == PROFILE:
            return None
        if self.phase == OFF:
            status = "off"
        elif self.config.r_max is None and self.r_max is not None and self.r_max <= self._candidates[0]:
            status = "floor"
        else:
            return None
        return {"status": status, "r_max": self.r_max, "uncompressed_s": self.table.uncompressed,
                "compressed_s": {int(r): t for r, t in sorted(self.table.by_rank.items())}}

    # ------------------------------------------------------------------ checkpointing
    def state_dict(self) -> dict:
        return {
            "follower": self.follower,
            "phase": self.phase, "r_max": self.r_max, "r_min": self.r_min, "rank": self.rank,
            "schedule": list(self.schedule), "table": self.table.state_dict(),
            "warmup_start": self.warmup_start, "error_at_start": self.error_at_start,
            "error_test_step": self.error_test_step,
        }

    def load_state_dict(self, state: dict) -> None:
        if state["phase"] not in PHASES:
            raise ValueError(f"unknown phase {state['phase']!r} in EDGC controller state")
        if state.get("follower", False) != self.follower:
            raise ValueError("EDGC controller state of a pipeline follower stage cannot load into a leader, or back")
        self.phase, self.r_max, self.r_min, self.rank = state["phase"], state["r_max"], state["r_min"], state["rank"]
        self.schedule = [(int(s), int(r)) for s, r in state["schedule"]]
        self.table.load_state_dict(state["table"])
        self.warmup_start = state["warmup_start"]
        self.error_at_start, self.error_test_step = state["error_at_start"], state["error_test_step"]
