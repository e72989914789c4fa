"""What EDGC's rank control decides, said through the ``edgc`` logger (`edgc.runner.events`, which
lists every kind of record and how to hear them): ``profiled``, ``notice``, ``warmup_over``, ``decision``,
``rank_set`` and ``nonfinite``.
"""

from __future__ import annotations

import logging

from ..config import EDGCConfig
from ..policies.plans import COMPRESS, WARMUP, Decision, StepPlan
from ..runner.events import say
from .profiling import describe_profiling_verdict
from .rank_control import WindowController


def profiling_over(rank: int, step: int, verdict: dict | None) -> None:
    """Profiling has decided (call once it has; ``verdict``: `WindowController.profiling_verdict`): r_max,
    or why compression is off or at its floor."""
    if verdict is None:  # r_max was given, or a pipeline follower: nothing was profiled
        return
    message = describe_profiling_verdict(verdict)
    found = verdict["status"] == "found"
    record = {
        "kind": "profiled" if found else "notice",
        "step": step,
        "event": f"edgc_{verdict['status']}",
        "message": message,
        **verdict,
    }
    say(rank, logging.INFO if found else logging.WARNING, record, f"step {step}: {message}")


def planned(
    rank: int, before: tuple[str, int | None], plan: StepPlan, controller: WindowController, config: EDGCConfig
) -> None:
    """``controller`` planned ``plan`` where its (phase, rank) were ``before``: say a warm-up's end or a
    hand-set rank change (decided ranks are said where they are decided; followers follow their leader)."""
    phase, old_rank = before
    if plan.phase != COMPRESS or controller.follower or (phase, old_rank) == (COMPRESS, plan.rank):
        return
    if phase == WARMUP:
        warmup_over(rank, plan.step, controller, config)
    else:
        rank_set(rank, plan.step, old_rank, plan.rank)


def warmup_over(rank: int, step: int, controller: WindowController, config: EDGCConfig) -> None:
    """Step ``step`` is the first compressed one."""
    if controller.warmup.error_test_step is not None:
        why = f"the rank-{controller.r_min} error test passed at step {controller.warmup.error_test_step}"
    elif config.warmup_error_test and step >= config.warmup_ceiling():
        why = f"the error test did not pass within its ceiling of {config.warmup_ceiling()} steps"
    else:
        why = f"after its floor of {config.warmup_floor()} uncompressed steps"
    graphs = config.engine.cuda_graphs
    message = (
        f"step {step}: EDGC warm-up is over ({why}): compressing at rank {controller.rank} "
        f"(r_min {controller.r_min}, r_max {controller.r_max})"
        + ("; CUDA graphs on: each stretch of a job is captured once it has run twice at a rank" if graphs else "")
    )
    say(
        rank,
        logging.INFO,
        {
            "kind": "warmup_over",
            "step": step,
            "rank": controller.rank,
            "r_min": controller.r_min,
            "r_max": controller.r_max,
            "cuda_graphs": graphs,
            "message": message,
        },
    )


def rank_set(rank: int, step: int, old: int | None, new: int) -> None:
    """A hand-set ``rank_schedule`` moved the rank at ``step``."""
    message = f"step {step}: EDGC rank {old} → {new} (hand-set rank_schedule)"
    say(rank, logging.INFO, {"kind": "rank_set", "step": step, "old_rank": old, "rank": new, "message": message})


def decision(
    rank: int, plan: StepPlan, taken: Decision, entropy: float | None, config: EDGCConfig, budget: dict | None
) -> dict:
    """A rank decision at the end of ``plan.step``, as a record for people: what was decided, from
    what signal (``entropy``: the last sample, nats; ``budget``: `WindowController.budget_state` of the
    step after, where a rank budget holds), and why. Logged, and returned (`EDGCState.last_decision`)."""
    old, new = plan.rank, taken.rank
    record = {
        "kind": "decision",
        "step": plan.step + 1,
        "old_rank": old,
        "rank": new,
        "need": taken.need,
        "target": taken.target,
        "signal": None,
        "budget": None,
        "mean_rank": None,
    }
    if budget is not None:
        record.update(signal=config.budget_signal, budget=budget["budget"], mean_rank=budget["mean_rank"])
        why = (
            f"budget mean rank {budget['budget']:g}, mean so far {budget['mean_rank']:.2f} over "
            f"{budget['done']}/{budget['total']} compressed steps; signal '{config.budget_signal}' "
            f"need {taken.need:.2f} → target {taken.target:.2f}"
        )
    else:
        why = f"{config.rank_mapping} mapping, noise gate k = {config.entropy_significance:g}"
        if entropy is not None:
            why += f", entropy {entropy:.3f} nats"
    verb = "keeps" if new == old else "moves"
    moved = "" if new == old else f" → {new}"
    record["message"] = f"step {plan.step + 1}: EDGC {verb} rank {old}{moved} ({why})"
    say(rank, logging.INFO, record)
    return record


def nonfinite(rank: int, step: int) -> None:
    """Step ``step``'s averaged gradient held a NaN/Inf (on some rank): the engine's fallback."""
    message = (
        f"step {step}: EDGC's averaged gradient is not finite (a NaN/Inf on some rank): it stays so, for "
        "the optimizer or GradScaler to skip the step; the step's error feedback is cleared, Q is kept"
    )
    say(rank, logging.WARNING, {"kind": "nonfinite", "step": step, "message": message})
