"""What EDGC decides, said through Python's `logging`: logger ``edgc``, one record per event.

    import logging
    logging.basicConfig(level=logging.INFO)  # or any handler of yours on the "edgc" logger

The events, each a record whose message is one line starting ``step S:`` (S: the first step it
applies to, counted from 0 as `EDGCState.step` counts):

==================  =========  ================================================================
kind                level      when
==================  =========  ================================================================
``profiled``        INFO       start-up profiling found r_max (what it measured, how)
``notice``          WARNING    … found no rank that pays (compression is off) or only the lowest
``warmup_over``     INFO       the uncompressed warm-up ended: compression starts, at which rank
``decision``        INFO       a rank decision at a window's end (the rank kept or moved, and why)
``rank_set``        INFO       a hand-set ``rank_schedule`` changed the rank
``nonfinite``       WARNING    a synced gradient held a NaN/Inf (what EDGC did about it)
``discarded``       INFO       a step was rolled back (`GradientReducer.rollback_step`), and why
``owner_error``     INFO       a two-stage sync dropped its chunks' error feedback: the group changed
``graph_captured``  INFO       a stretch was captured into a CUDA graph (``cuda_graphs``), and why: its
                               first capture at a layout, a rank change (r → r'), new buffers
``graph_failed``    WARNING    a capture failed: that stretch runs eagerly from then on
==================  =========  ================================================================

WARNING records reach stderr even where logging is not configured (Python's last-resort handler);
INFO records need a handler at INFO. A record carries its data as ``record.edgc`` (a dict with
``kind``, ``step`` and ``message``; a decision's is `EDGCState.last_decision`), which is how
``edgc train`` prints them and writes them to ``metrics.jsonl``: the same records, not a second
mechanism.

Every rank of a group takes the same decisions, so by default only the group's rank 0 speaks: the
``edgc`` logger has the filter `GROUP_RANK_ZERO` (a pipeline's stages each have a group, so each
stage's rank 0 speaks for its stage). To hear every rank,
``logging.getLogger("edgc").removeFilter(edgc.control.events.GROUP_RANK_ZERO)``; ``record.edgc_rank`` is
the rank in the group that decides.

Each event takes that rank (``rank``: the sync state's `GradientReducer.settings_group`'s) and the
plain values it reports.
"""

from __future__ import annotations

import logging

from ..config import EDGCConfig
from ..policies.plans import COMPRESS, WARMUP, Decision, StepPlan
from .profiling import describe_profiling_verdict
from .rank_control import WindowController

LOGGER = logging.getLogger("edgc")


class GroupRankZero(logging.Filter):
    """A `logging.Filter` that lets through the records of a group's rank 0, and records that name no rank."""

    def filter(self, record: logging.LogRecord) -> bool:
        return getattr(record, "edgc_rank", 0) == 0


GROUP_RANK_ZERO = GroupRankZero()
LOGGER.addFilter(GROUP_RANK_ZERO)


def say(rank: int, level: int, record: dict, line: str | None = None) -> None:
    """Log ``record`` (``kind``, ``step``, ``message``) as one line: ``line``, or its message; ``rank``: the
    speaker's in the group that decides."""
    if LOGGER.isEnabledFor(level):
        LOGGER.log(level, line or record["message"], extra={"edgc": record, "edgc_rank": rank})


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


def discarded(rank: int, owner: str, step: int, reason: str) -> None:
    """Step ``step`` of the sync state called ``owner`` was rolled back: the state is as before it (what it
    tried to send is kept)."""
    message = (
        f"step {step}: {owner} discarded the step ({reason}): its shared state is as "
        "before it; error feedback keeps what it tried to send"
    )
    say(rank, logging.INFO, {"kind": "discarded", "step": step, "reason": reason, "message": message})


def owner_error_dropped(rank: int, owner: str, step: int, key: str, before, now) -> None:
    """At ``step``, a two-stage sync (`edgc.sync.two_stage`, the state called ``owner``) dropped the error feedback
    of the chunks it owned for the call ``key``: the partition ``before`` is not the one ``now`` (the quorum
    changed)."""
    message = (
        f"step {step}: {owner}: the owner's error feedback of {key!r} is dropped: the group "
        f"changed ({before.members} members, rank {before.rank} → {now.members}, rank {now.rank})"
    )
    say(rank, logging.INFO, {"kind": "owner_error", "step": step, "key": key, "message": message})


def owner_error_cleared(rank: int, owner: str, step: int, reason: str) -> None:
    """At ``step``, a two-stage sync (`edgc.sync.two_stage`, the state called ``owner``) dropped the error
    feedback of every chunk it owned, for ``reason`` (a heal)."""
    message = f"step {step}: {owner}: the owner's error feedback is dropped: {reason}"
    say(rank, logging.INFO, {"kind": "owner_error", "step": step, "key": None, "message": message})
