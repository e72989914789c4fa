"""What a sync state says through Python's `logging`: logger ``edgc``, one record per event.

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
``logging.getLogger("edgc").removeFilter(edgc.runner.events.GROUP_RANK_ZERO)``; ``record.edgc_rank`` is
the rank in the group that decides.

Each event takes that rank (``rank``: the sync state's rank in its `GradientReducer.settings_group`) and
the plain values it reports. The events every sync state says are here (`discarded`, `owner_error`), with
`say`, which says any: EDGC's rank control says its own through it (`edgc.control.events`), and a graph
region its captures (`edgc.device.graphs`).
"""

from __future__ import annotations

import logging

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
