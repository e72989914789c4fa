"""What profiling measures: a compressed sync timed beside the real one, and the plain sync's time.

While r_max is profiled (`edgc.control.rank_control`), training stays exactly uncompressed: every bucket is
averaged plainly, and a *shadow* compressed sync of a copy of its gradients, with Q factors of its
own and no error feedback, is timed at the candidate rank. Where the plan asks for the plain sync's
time too (``StepPlan.profile_raw``) both run blocking, one after the other, each timed; otherwise
the plain sync overlaps backward as in warm-up and the shadow syncs are timed at the step's end,
when no other transfer shares the link (the quick test, ``StepPlan.profile_bound``, also keeps the
host's waits for the plain sync after backward: a lower bound on its time). A shadow sync's
collectives are not the step's traffic: they are dropped from its record.

`ShadowProfiler` holds the shadow engine and the times summed since the last decision, which
`mean_times` turns into the seconds per step a decision agrees on.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import replace

import torch

from ..config import LowRankConfig
from ..device import streams
from ..device.timing import Clock
from ..distributed.comm import Communicator, Job, run_job
from ..engine.lowrank import LowRankCompressor
from ..policies.plans import StepPlan
from ..runner.jobs import JobQueue
from ..runner.stats import ReduceStats
from .profiling import profile_seconds


class ShadowProfiler:
    """Profiling's shadow syncs and their times (see the module docstring). ``config``: the engine's
    `LowRankConfig` (the shadow runs it without error feedback). ``seconds``: since the last decision,
    [compressed s, steps that timed it, uncompressed s, steps that timed it]."""

    def __init__(self, config: LowRankConfig):
        self.config = config
        # a shadow sync times one power iteration, without error feedback
        self.compressor = LowRankCompressor(replace(config, error_feedback=False, power_iterations=1))
        self.seconds = [0.0, 0, 0.0, 0]
        self._shadow_stamps: list[tuple] = []  # this step's (start, end) of the timed shadow syncs
        self._raw_stamps: list[tuple] = []  # … and of the blocking plain syncs (`StepPlan.profile_raw`)
        self._deferred: list[
            tuple[list[str], list[torch.Tensor]]
        ] = []  # buckets whose shadow sync waits for the step's end
        self._plain_waits: list[tuple] = []  # the quick test's waits for the plain sync

    def begin_step(self) -> None:
        self._shadow_stamps, self._raw_stamps, self._deferred, self._plain_waits = [], [], [], []

    def bucket(
        self,
        names: list[str],
        grads: list[torch.Tensor],
        plan: StepPlan,
        comm: Communicator,
        clock: Clock,
        average: Callable[[], Job],
    ) -> Job | ReduceStats:
        """A profiling bucket, averaged plainly by the job ``average()``: overlapped, its shadow sync
        left for the step's end; or (``plan.profile_raw``) blocking after a timed shadow sync, timed."""
        if not plan.profile_raw:
            self._deferred.append((names, grads))  # only their shapes matter by then
            return average()
        self._time_shadow_sync(names, grads, plan, comm, clock)
        start = clock.stamp()
        stats = run_job(average())
        self._raw_stamps.append((start, clock.stamp()))
        return stats

    def close_step(self, plan: StepPlan, comm: Communicator, jobs: JobQueue, clock: Clock) -> None:
        """Every plain sync of the step has completed: the shadow syncs left for now, timed on the jobs'
        stream (their cost shows as compress time), after the quick test's waits are kept."""
        deferred, self._deferred = self._deferred, []
        if plan.profile_bound:  # before the shadow sync adds its own waits
            self._plain_waits = comm.wait_stamps()
        if not deferred:
            return
        # Copied on the compute stream, where the gradients lie: the next step's backward writes DDP's
        # buckets there, and nothing would order that write after a read on the jobs' stream.
        copies = [(names, [g.detach().clone() for g in grads]) for names, grads in deferred]
        with jobs.working(after_compute=True):
            for names, grads in copies:
                for copy in grads:
                    streams.record_stream(copy, jobs.stream)  # freed after the jobs' stream reads it
                self._time_shadow_sync(names, grads, plan, comm, clock)

    def _time_shadow_sync(
        self, names: list[str], grads: list[torch.Tensor], plan: StepPlan, comm: Communicator, clock: Clock
    ) -> None:
        """One blocking compressed sync of copies of ``grads`` at ``plan.profile_rank``, timed, not counted."""
        issued_before = comm.mark()
        for _ in range(2 if plan.profile_warm else 1):  # only the last call's time counts
            shadow = [g.detach().clone() for g in grads]
            start = clock.stamp()
            self.compressor.reduce(names, shadow, plan.profile_rank, comm, measure_error=False)  # type: ignore[arg-type]
            end = clock.stamp()
        comm.forget_since(*issued_before)  # the shadow sync is not the step's traffic
        self._shadow_stamps.append((start, end))

    def settle_step(self) -> None:
        """The step's stamps are readable (it is settled): add its times to the sums."""
        for offset, stamps in ((0, self._shadow_stamps), (2, self._raw_stamps)):
            seconds = Clock.total(stamps) if stamps else None
            if seconds is not None:
                self.seconds[offset] += seconds
                self.seconds[offset + 1] += 1

    def mean_times(self, plan: StepPlan) -> tuple[float, float, float]:
        """(compressed s/step, uncompressed s/step, the quick test's lower bound on the uncompressed one),
        NaN where unmeasured: this rank's part of `edgc.policies.plans.Agreed`."""
        compressed, compressed_steps, uncompressed, uncompressed_steps = self.seconds
        bound = (Clock.total(self._plain_waits) or 0.0) if plan.profile_bound else math.nan
        return (
            compressed / compressed_steps if compressed_steps else math.nan,
            uncompressed / uncompressed_steps if uncompressed_steps else math.nan,
            bound,
        )

    def decided(self, *, finished: bool) -> None:
        """A decision read the sums: start again. ``finished``: profiling is over, and its shadow Q
        factors are garbage."""
        self.seconds = [0.0, 0, 0.0, 0]
        if finished:
            method = self.compressor.state.orthonormalization  # the group's (`edgc.engine.orthonormal_choice`)
            self.compressor = LowRankCompressor(self.compressor.config)
            self.compressor.state.orthonormalization = method

    def use_orthonormalization(self, method: str) -> None:
        """Orthonormalise the shadow syncs' factors as the group's engine does (`edgc.engine.orthonormal_choice`)."""
        self.compressor.state.orthonormalization = method

    def to(self, device: torch.device, stream: streams.Stream | None) -> None:
        self.compressor.state.to(device, stream)

    # ------------------------------------------------------------------ uncommitted steps, checkpoints
    # Its entries sit at the top level of the state's checkpoint and snapshot, where they always were.
    def state_dict(self) -> dict:
        """The shadow engine's state (``profiler``) and the sums since the last decision (``profile_seconds``)."""
        return {"profiler": self.compressor.state_dict(), "profile_seconds": list(self.seconds)}

    def load_state_dict(self, state: dict) -> None:
        """A `state_dict()`'s entries (the sums of a state saved with one step count for both, too)."""
        self.compressor.load_state_dict(state["profiler"])
        self.seconds = profile_seconds(state["profile_seconds"])

    def snapshot(self) -> dict:
        """What a discarded step restores: the shadow Q (by reference: never written in place) and the sums."""
        return {"profiler_q": self.compressor.state.snapshot(), "profile_seconds": list(self.seconds)}

    def restore(self, snapshot: dict) -> None:
        self.compressor.state.restore(snapshot["profiler_q"])
        self.seconds = snapshot["profile_seconds"]
