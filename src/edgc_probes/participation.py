"""Who took part in which step of a fault-tolerant run (torchft's quorums), from each replica
group's ``step`` lines: the bench's measure of its torchft and DiLoCo runs, and the tests' of theirs."""

from __future__ import annotations


def participation(groups: list[list[dict]], steps: int) -> dict:
    """Who took part in which step, from each group's ``step`` lines.

    A step's quorum is the largest that committed it (groups left behind may commit the same step
    later, in a quorum of their own); a group took part in the step if it committed it as one of
    that quorum's participants. ``per_step``: the size of each step's quorum (0: never committed);
    ``fraction``: per group, the share of the run's steps it took part in; ``heals``: per group,
    the times it received the state from a peer (the initial weight sync at step 0 excluded);
    ``alone``: the steps some group committed in a quorum of one."""
    commits = [
        [
            r
            for r in records
            if r["kind"] == "step" and r["committed"] and r.get("participating", True) and r["step"] < steps
        ]
        for records in groups
    ]
    quorum: dict[int, int] = {}
    for r in (r for records in commits for r in records):
        quorum[r["step"]] = max(quorum.get(r["step"], 0), r["participants"])
    took_part = [{r["step"] for r in records if r["participants"] == quorum[r["step"]]} for records in commits]
    return {
        "per_step": [quorum.get(step, 0) for step in range(steps)],
        "fraction": [len(group) / steps for group in took_part],
        "heals": [sum(r["kind"] == "step" and r.get("healed", False) for r in records) for records in groups],
        "alone": sorted({r["step"] for records in commits for r in records if r["participants"] == 1}),
    }
