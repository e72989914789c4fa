"""The replica fingerprint: what must be identical on every rank of a group, compared once per window.

Data parallelism is right only while every replica holds the same shared state: the step, the
phase, the rank and its bounds, the rank schedule and every warm-start Q factor. A rank resumed
from another checkpoint, a state bound to another group or a bug would show otherwise only as
replicas that drift apart, with exit code 0. (Settings that differ between ranks are refused
before they are used, at the first step: `edgc.distributed.agreement`; this checks the state they produce.)
So at the end of every window (`EDGCConfig.window` steps, where the group settles together:
`EDGCState.settle`) each rank of the group compares, in one collective:

=================  ================================================================
field              value
=================  ================================================================
``step``           the step that ends the window
``phase``          profile, warmup, compress or off
``rank``           the rank in force (none: uncompressed)
``r_max``          the rank's ceiling (none while profiling)
``r_min``          the rank's floor
``rank changes``   entries of the rank schedule so far
``Q checksum``     the bits of every Q factor read as integers and summed in int64
=================  ================================================================

The Q checksum is exact and independent of the order of summation (integer sums are
associative), so identical Q factors give identical checksums on any device and thread count,
and a one-bit difference changes it. Each rank sends every field v twice, as v + 2 and 2⁵² − v,
in one all-reduce (MAX): every rank gets the largest and the smallest value of each field, and
where they differ every rank raises `ReplicasDiverged` naming the first such field, its range over
the group and its own value. (A torchft spare replica contributes zeros, which neither encoding
can win with.)

Cost per window: one blocking all-reduce of 2 × 7 float64 (112 bytes), a pass over the Q factors
on the device (they are r/m of the gradient's size) and one host read of the result, at the
window's settle point. It is no gradient traffic, so not counted in the step's collectives. It does
not ride on the rank decision's all-reduce and broadcast: those average and send rank 0's proposal,
whereas a comparison needs a maximum, and a decision is not taken at every window (warm-up,
hand-set schedules, static PowerSGD, pipeline followers).
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import torch.distributed as dist

from ..distributed.comm import Communicator
from ..policies.plans import PHASES

FIELDS = ("step", "phase", "rank", "r_max", "r_min", "rank changes", "Q checksum")
SPAN = 2**52  # every field is an integer below it: exact in float64
_AS_INTEGERS = {1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int32}  # by element size


class ReplicasDiverged(RuntimeError):
    """The ranks of a group no longer hold the same shared state (see `edgc.safeguards.fingerprint`)."""


def q_checksum(q: dict[str, torch.Tensor], device: torch.device) -> torch.Tensor:
    """The sum of the bits of every Q factor read as integers, modulo 2⁵² (int64, on ``device``)."""
    total = torch.zeros((), dtype=torch.int64, device=device)
    for name in sorted(q):
        flat = q[name].detach().contiguous().view(-1)
        total += flat.view(_AS_INTEGERS[flat.element_size()]).sum(dtype=torch.int64)
    return total.remainder(SPAN)


class SharedFields(NamedTuple):
    """The fields before the Q checksum, as the rank controller holds them (see the module docstring)."""

    step: int
    phase: str
    rank: int | None
    r_max: int | None
    r_min: int | None
    rank_changes: int

    def encoded(self) -> list[int]:
        """The fields as integers; -1 stands for None."""
        values = (self.step, PHASES.index(self.phase), self.rank, self.r_max, self.r_min, self.rank_changes)
        return [-1 if value is None else int(value) for value in values]


def compare_replicas(
    comm: Communicator, fields: SharedFields, q: dict[str, torch.Tensor], device: torch.device
) -> None:
    """Compare the fingerprint (``fields`` and the Q factors ``q``, on ``device``) over ``comm``'s group
    (every rank calls it at the same step); raise `ReplicasDiverged` where it differs."""
    if not comm.issues or comm.world_size < 2:
        return
    step = fields.step
    mine = torch.cat(
        [
            torch.tensor(fields.encoded(), dtype=torch.float64, device=device),
            q_checksum(q, device).to(torch.float64).reshape(1),
        ]
    )
    both = torch.cat([mine + 2, SPAN - mine])
    issued_before = comm.mark()
    comm.all_reduce(both, op=dist.ReduceOp.MAX)
    comm.forget_since(*issued_before)  # no gradient traffic: not the step's to report
    if comm.step_failed:  # torchft: the step is lost, and what came back is not the group's
        return
    values = torch.cat([both, mine]).tolist()
    count = len(FIELDS)
    for index, field in enumerate(FIELDS):
        highest, lowest, own = values[index] - 2, SPAN - values[count + index], values[2 * count + index]
        if highest != lowest:
            raise ReplicasDiverged(
                f"EDGC replicas diverged at step {step}: {field} differs across the group (from {lowest:.0f} to "
                f"{highest:.0f}, this rank {own:.0f}; -1 = none), checked in {FIELDS}: a rank resumed from "
                "another checkpoint, a state on another group, or a bug (please report it)"
            )
