"""`StepCycle`: one optimizer step's cycle as every sync method runs it, the base of `GradientReducer`.

A step is one optimizer step: DDP calls the hook once per bucket and ``bucket.is_last()`` closes
the step, so ``no_sync`` gradient accumulation does not advance the counter. Each step is one
`StepRecord`, from its first bucket until it is settled: it begins (the group's settings agreed at
the first, the step before settled), its buckets are averaged (`GradientReducer`'s entry points), it
closes, and a closed step's device values (non-finite flags, errors: its `StepTotals`, by name)
reach the host as one tensor behind an event and are read when the step is *settled* (`settle`):
when its metrics are read, or when the next step begins (`edgc.device.timing`). With
``defer_commit`` it stays pending until it is committed or rolled back; between steps the state is
checkpointed by name.

A method says what it does with a step through five hooks, each called at most once per step (but
`_reduce`) in this order: `_plan_step(record)` (the step begins: its plan, and how many bytes of
buckets one job gathers, ``record.fusion_mb``), `_reduce` per bucket (`edgc.runner.reducer`),
`_settle_step(record, totals)` (the step's values are on the host: the method's metrics),
`_on_verdict(committed, snapshot)` for an uncommitted step (kept, or rolled back to the state of
``snapshot``), and `_on_device(device)` at the first step and at a load (by default every error
feedback it keeps moves there). The error feedback a method keeps (`error_feedbacks`) is
snapshotted and restored by the cycle itself, each as its rollback mode says
(`edgc.runner.error_feedback.ErrorFeedback.rollback`). What one method does beyond them (EDGC's
values for the host at the step's close, its decision round settled by the group together, its
agreement on the device, its shared state in the snapshot) it adds to the cycle's own methods
(`_end_step`, `settle`, `_use_device`, `_plan_step`'s ``record.snapshot``) in its class.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from ..device.timing import DEVICE_TIMING_EVERY, Clock, host_reads_allowed
from ..device.totals import StepTotals
from ..distributed.comm import Communicator
from ..safeguards.guards import UsageGuard
from . import events
from .error_feedback import ErrorFeedback
from .jobs import JobQueue, fusion_megabytes
from .stats import ReduceStats
from .steps import StepRecord, step_metrics


class StepCycle:
    """The step cycle of a sync state (see the module docstring): its step count, totals, uncommitted
    steps and checkpoint, the group it agrees with, its jobs' device and clock.

    Args:
        process_group: the group it averages over (None: the default one; a 1-D DeviceMesh too).
        model: the module whose parameters it syncs (the DDP model or the module it wraps): it names
            them (`edgc.safeguards.guards`).
    """

    rollback_keeps_input = False  # a rollback leaves all the input in the state: callers keep no copy (two_stage)

    def __init__(self, process_group: dist.ProcessGroup | None = None, *, model: nn.Module | None = None):
        self.comm = Communicator(process_group)
        self.step = 0  # optimizer steps completed
        self.totals = {"elements_raw": 0, "elements_sent": 0, "bytes_raw": 0, "bytes_sent": 0}
        # Uncommitted steps: with ``defer_commit`` every step stays pending after its sync until `commit_step` or
        # `rollback_step` (a fault-tolerant loop decides whether it is applied); its record keeps the state before.
        self.defer_commit = False
        self._guard = UsageGuard(model)  # the parameters' names, the group, one state per DDP model: guards.py
        self._jobs = JobQueue(self._add_stats)  # how bucket jobs run; the device and its clock
        self._current: StepRecord | None = None  # the step being synced
        self._last: StepRecord | None = None  # the last step closed, settled when the next one begins

    # ------------------------------------------------------------------ what it knows
    @property
    def device(self) -> torch.device | None:
        """The gradients' device, once a step has seen one."""
        return self._jobs.device

    @property
    def clock(self) -> Clock:
        """The device timeline's stamps (`edgc.device.timing.Clock`), shared with the communicator."""
        return self._jobs.clock

    def agreed_settings(self, device: torch.device) -> dict[str, Any]:
        """What every rank of the group must hold alike, compared at the first step (`edgc.distributed.agreement`).

        Args:
            device: the gradients', for values resolved by device.

        Returns:
            Name → value of the method, its own arguments (a subclass adds them) and what an integration
            added (`agree_on`).
        """
        return {"method": type(self).__qualname__, **self._guard.also_agreed}

    def error_feedbacks(self) -> list[ErrorFeedback]:
        """The error feedback it keeps (`edgc.runner.error_feedback.ErrorFeedback`): moved to the device,
        snapshotted and restored by the cycle.

        Returns:
            This rank's by parameter name, then the group's part (a two-stage sync's owners'); none here.
        """
        return []

    def settings_group(self) -> Communicator:
        """The communicator of the ranks that must act alike: its group compares the settings at the first
        step, and its rank 0 speaks for it (`edgc.runner.events`).

        Returns:
            The wider group's, where the state was given one (`EDGCState`'s ``decision_group``), else the
            state's.
        """
        return self._guard.decision_comm or self.comm

    def check_group(self) -> None:
        """Bind a default group created after the state, and check the group it averages over
        (`edgc.safeguards.guards`): at its first step, or before training (`edgc.integrations.check_group`);
        later calls change nothing."""
        self.comm = self._guard.bound(self.comm)
        self._guard.first_use(type(self).__name__, self.comm)

    # ------------------------------------------------------------------ one step
    def _fusion_bytes(self) -> float:
        """Gradient bytes of consecutive buckets that one job of this step syncs (`edgc.runner.jobs`)."""
        record = self._current
        return 0 if record is None else fusion_megabytes(record.fusion_mb, self.device) * 2**20

    def _use_device(self, device: torch.device) -> None:
        """The gradients' device, at the first step: the jobs, the clock, the communicator and the method
        use it."""
        self._jobs.use_device(device)
        self.clock.enabled = self._timed(self._current)
        self.comm.use_device(device, self.clock)
        self._on_device(device)

    def _timed(self, record: StepRecord | None) -> bool:
        """Whether this step takes device timestamps (`edgc.device.timing.DEVICE_TIMING_EVERY`)."""
        return not self.clock.cuda or record is None or record.always_timed or record.step % DEVICE_TIMING_EVERY == 0

    def _begin_step(self, device: torch.device | None) -> None:
        self.check_group()  # binds a default group created after the state (edgc.safeguards.guards)
        # Start from a clean communicator; an unpickled state's stand-in refuses right here, before
        # anything of the state has changed (see edgc.distributed.detached).
        self.comm.reset()
        self._guard.agree(  # before anything is sent
            type(self).__name__,
            self.comm,
            self.settings_group(),
            self.agreed_settings,
            device or self.device or torch.device("cpu"),
        )
        self.settle()  # the step before: its values, metrics and decisions (their collectives count here)
        if self.pending:
            raise RuntimeError(
                f"{type(self).__name__}: step {self._last.step} was neither committed nor "  # type: ignore[union-attr]
                "rolled back; with defer_commit call commit_step() or rollback_step() after each step"
            )
        record = self._current = StepRecord(self.step, self._snapshot() if self.defer_commit else None)
        self._jobs.clear()
        self._plan_step(record)
        self.clock.enabled = self._timed(record)

    def _end_step(self) -> None:
        """Close the step (its last bucket is averaged) without reading anything: its values, the
        method's and the reducer's by name (`edgc.device.totals.StepTotals`), travel to the host as one tensor
        behind an event and are read when it is settled."""
        record = self._current
        assert record is not None
        if self.device is not None:
            for name, (values, weights) in record.measured().items():
                record.totals.add_sum(name, values, weights)
            with self._jobs.side_stream():  # made where the step's statistics were computed
                record.totals.send(self.device)
        record.busy, record.collectives = self._jobs.take_busy(), self.comm.take_step()
        self._last, self._current = record, None
        self.step += 1

    def settle(self) -> None:
        """Settle the last closed step: read its device values (waiting for that step's work alone) and
        build its metrics. Called at the start of the next step and by integrations at their step
        boundary (torchft's commit, `synchronize`, `state_dict`): points every rank reaches in the
        same order, so a method may take there what its group takes together (`EDGCState.settle`: the
        rank decision, which issues collectives). Reading `last_step_metrics` settles only the local part."""
        self._settle_local()

    def _settle_local(self) -> None:
        record = self._last
        if record is None or record.local_done:
            return
        record.local_done = True
        with host_reads_allowed():  # the step's one read (edgc.device.timing)
            self._build_metrics(record)

    def _build_metrics(self, record: StepRecord) -> None:
        record.totals.read()
        method = self._settle_step(record, record.totals)
        for key in self.totals:
            self.totals[key] += getattr(record.stats, key)
        record.metrics = {**step_metrics(record), **method}
        if record.metrics["nonfinite"]:
            self.comm.report_nonfinite(type(self).__name__, record.step)

    @property
    def last_step_metrics(self) -> dict:
        """Metrics of the last closed step (settled locally on first read: no collective)."""
        self._settle_local()
        return self._last.metrics if self._last is not None else {}

    def _add_stats(self, stats: ReduceStats) -> None:
        self._current.add(stats)  # type: ignore[union-attr]

    # ------------------------------------------------------------------ the method's hooks
    def _plan_step(self, record: StepRecord) -> None:
        """The step begins (the one before is settled): plan it (``record.plan``, ``record.always_timed``,
        ``record.fusion_mb``: 0, each bucket its own job, unless set)."""

    def _reduce(self, names: list[str], grads: list[torch.Tensor], flat: torch.Tensor | None) -> Any:
        raise NotImplementedError

    def _settle_step(self, record: StepRecord, totals: StepTotals) -> dict:
        """The step's values are on the host, read by name (``totals``, the record's: the reducer's and what
        the method added before the step's close): the method's part of its metrics. Local: no collective here."""
        return {"phase": "off", "rank": None, "entropy": None}

    def _on_device(self, device: torch.device) -> None:
        """Called with the gradients' device (move loaded state there): at the first step, and at a load
        once the device is known; by default every error feedback (`error_feedbacks`) goes there, for the
        jobs' stream that reads and replaces it. No collective here: a healing replica loads alone."""
        for feedback in self.error_feedbacks():
            feedback.to(device, self._jobs.stream)

    # ------------------------------------------------------------------ uncommitted steps
    @property
    def pending(self) -> bool:
        """A step has synced but is neither committed nor rolled back (only with ``defer_commit``)."""
        return self._last is not None and self._last.snapshot is not None

    def commit_step(self) -> None:
        """The pending step is applied (the optimizer stepped): keep its state. No-op when none is pending."""
        self.settle()
        if not self.pending:
            return
        snapshot, self._last.snapshot = self._last.snapshot, None  # type: ignore[union-attr]
        self._on_verdict(True, snapshot)
        self.last_step_metrics["committed"] = True

    def rollback_step(self, reason: str = "the optimizer did not step") -> None:
        """The pending step is discarded (the optimizer did not step): the state is as if it had not
        synced — same step number and shared state — except that what the step tried to send is
        kept for the next one where the method has error feedback. Bytes sent stay counted: they
        were sent. No-op when none is pending.

        Args:
            reason: for its record (`edgc.control.events`).
        """
        self.settle()  # its values first (a non-finite step's cleanup), then undo its shared state
        if not self.pending:
            return
        snapshot, self._last.snapshot = self._last.snapshot, None  # type: ignore[union-attr]
        self.step = snapshot["step"]
        for feedback, kept in zip(self.error_feedbacks(), snapshot["error_feedback"]):
            feedback.restore(kept)  # as its rollback mode says (`ErrorFeedback.snapshot`)
        self._on_verdict(False, snapshot)
        self.last_step_metrics["committed"] = False
        events.discarded(self.settings_group().rank, type(self).__name__, snapshot["step"], reason)

    def _snapshot(self) -> dict:
        """What `rollback_step` restores, taken as the step begins: the step number and each error
        feedback's snapshot (references; None where its rollback mode restores nothing). A method adds
        its shared state to ``record.snapshot`` in `_plan_step` (cheaply: no gradient-sized copy)."""
        return {"step": self.step, "error_feedback": [feedback.snapshot() for feedback in self.error_feedbacks()]}

    def _on_verdict(self, committed: bool, snapshot: dict) -> None:
        """The pending step's verdict: kept (``committed``), or discarded, the step number and the error
        feedback already back to ``snapshot``: put back the rest of what the method keeps."""

    # ------------------------------------------------------------------ checkpointing
    def state_dict(self) -> dict:
        """Settles the last step first (`settle`: call it on every rank at the same point, as
        checkpoints are taken), so that a resumed run starts where this one would go on.

        Returns:
            The step, the totals and the world size; a subclass adds its state.
        """
        self.comm = self._guard.bound(self.comm)  # a default group created after the state (edgc.safeguards.guards)
        self.settle()
        return {"step": self.step, "totals": dict(self.totals), "world_size": self.comm.world_size}

    def load_state_dict(self, state: dict) -> None:
        """Restore what `state_dict` returned; the last step's values, not yet settled, are dropped.

        Args:
            state: a state's `state_dict`.
        """
        self.comm = self._guard.bound(self.comm)
        if self._last is not None:  # its values belong to the state before: never settled now
            self._last.local_done = self._last.shared_done = True
        self.step = int(state["step"])
        self.totals = {key: int(value) for key, value in state["totals"].items()}

    def __getstate__(self) -> dict:
        """Pickle the data but not the ties to this run (`edgc.distributed.detached.detached_fields`)."""
        from ..distributed.detached import detached_fields

        self._settle_local()  # its metrics and totals travel; the device values do not
        return detached_fields(self.__dict__, type(self).__name__, self.comm, self._last)
