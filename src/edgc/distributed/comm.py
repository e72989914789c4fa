"""Collectives over one process group (or none at all), with a two-rule contract.

1. **Issue order is program order.** Every collective is issued from the caller's thread at the
   moment ``all_reduce_async``/``mean_async`` (or a blocking call) is made, never from a
   callback. Callers issue in an order that depends only on what every rank knows (bucket order,
   step number), so all ranks issue the same sequence; gloo and NCCL match collectives by that
   order. (PyTorch's PowerSGD hook issues from ``Future.then`` callbacks, whose order differs
   between ranks, and aborts gloo with several buckets.)
2. **A result may be read only after ``Pending.wait()``.** ``wait`` blocks the host on gloo and
   makes the current stream wait on NCCL (no host synchronisation); it never reads a value.

Blocking calls (``all_reduce``, ``mean_``, ``broadcast``, ``all_gather``) are issue + wait. Without
an initialised process group the world has size 1 and collectives are no-ops, which keeps the
compressors testable in a single plain process; with one, even of size 1, every collective is
issued (as DDP does), so a one-GPU NCCL run goes through NCCL's streams and ``Work.wait``.

Each collective's duration is kept in issue order (the same order on every rank, so traces of
all ranks line up): from its issue to its completion, as device-timeline stamps turned into
seconds at ``reset()`` (the end of a step). On CPU the completion time is the earlier of the
return of ``wait`` and the first ``poll()`` that saw the work complete (no completion callback:
one would run on the backend's thread, possibly while the interpreter exits).
"""

from __future__ import annotations

import time
from collections.abc import Generator
from typing import Any

import torch
import torch.distributed as dist

from ..device.timing import Clock
from .mesh import as_process_group


class Pending:
    """One issued collective; ``wait()`` returns its tensor once the result may be read."""

    def __init__(
        self, tensor: torch.Tensor, work, record: list | None, clock: Clock, after=None, waits: list | None = None
    ):
        self.tensor, self._work, self._record, self._clock, self._after = tensor, work, record, clock, after
        self._waits = waits

    def wait(self) -> torch.Tensor:
        if self._work is not None:
            waited_from = self._clock.stamp()
            self._work.wait()
            self._work = None
            waited_to = self._clock.stamp()
            if self._record is not None:
                self._record[1] = waited_to
                self._record[3] = None  # the work is done with
            if self._waits is not None:
                self._waits.append((waited_from, waited_to))
        if self._after is not None:
            self._after()
            self._after = None
        return self.tensor


class Communicator:
    """Collectives over ``process_group`` (None: the default group; a 1-D DeviceMesh too), under the
    module docstring's contract."""

    # Whether a plain average also reports if it is finite (`GradientReducer._average_raw`): where a
    # non-finite step must be discarded on every replica (torchft's manager), not only skipped.
    flags_nonfinite = False
    # Whether a rank's error feedback belongs to its place among ``world_size`` ranks, so that a checkpoint
    # loaded at another world size drops it (residuals cannot be split or merged). Not under torchft,
    # where a replica group's error feedback is its own whatever the quorum's size.
    residuals_per_rank = True

    def __init__(self, process_group=None):
        process_group = self.group = as_process_group(process_group)  # a group, None, or a 1-D DeviceMesh
        distributed = dist.is_available() and dist.is_initialized()
        self.world_size = dist.get_world_size(process_group) if distributed else 1
        self._distributed = distributed
        # The default group, asked for before it existed: `edgc.safeguards.guards` binds it at the state's first use.
        self.awaits_default_group = process_group is None and not distributed
        self.rank = dist.get_rank(process_group) if distributed else 0
        # Global rank of the group's rank 0: the source of every decision broadcast.
        self.root = dist.get_global_rank(process_group, 0) if distributed and process_group is not None else 0
        self.clock = Clock()
        self._records: list[list] = []  # [issue stamp, wait stamp, completion time] per collective
        self._waits: list[tuple] = []  # (start, end) stamps of every wait that found work unfinished
        self.durations: list[float | None] = []  # seconds per collective of the last step ended by reset()
        self.wait_seconds = 0.0  # of the last finished step: time the caller was blocked in wait()
        self._backend: str | None = None  # the group's, once asked (`waits_on_device`)

    def use_device(self, device: torch.device, clock: Clock | None = None) -> None:
        """Stamp collectives on ``device``'s timeline, with ``clock`` if given (shared with the reducer,
        which decides which steps are timed)."""
        self.clock = clock if clock is not None else Clock(device)

    @property
    def collectives(self) -> int:
        """Collectives issued since the last reset() (each has a fixed latency cost)."""
        return len(self._records)

    def take_step(self) -> StepCollectives:
        """End a step without reading any clock: its collectives' stamps, for `StepCollectives` to turn
        into seconds once the step is over. Call after every wait."""
        if any(record[3] is not None for record in self._records):
            raise RuntimeError("Communicator: a step ended before every issued collective was waited for")
        step = StepCollectives(self._records, self._waits)
        self._records, self._waits = [], []
        return step

    def reset(self) -> list[float | None]:
        """End a step now: the durations (s) of its collectives in issue order (None where untimed)."""
        step = self.take_step()
        self.durations = step.durations()
        self.wait_seconds = step.wait_seconds() or 0.0
        return self.durations

    def forget_since(self, count: int, waits: int) -> None:
        """Drop the collectives issued after the first ``count``, and the waits after the first
        ``waits`` (traffic that is not the step's, e.g. a profiling shadow sync)."""
        del self._records[count:]
        del self._waits[waits:]

    def wait_stamps(self) -> list[tuple]:
        """(start, end) stamps of this step's waits so far that found work unfinished (seconds with
        ``Clock.seconds`` at the step's end): how long the caller was blocked on the network."""
        return list(self._waits)

    def mark(self) -> tuple[int, int]:
        """(collectives, waits) so far: the argument of a later ``forget_since``."""
        return len(self._records), len(self._waits)

    @property
    def waits_on_device(self) -> bool:
        """Whether ``Pending.wait()`` makes the current stream wait rather than the host (NCCL's): a job
        can then wait for a collective it has just issued and go on without blocking the caller."""
        if not self._distributed:
            return False
        if self._backend is None:
            self._backend = str(dist.get_backend(self.group))
        return self._backend == "nccl"

    @property
    def issues(self) -> bool:
        """Whether collectives are issued: a process group exists, of any size."""
        return self._distributed

    def report_nonfinite(self, owner: str, step: int) -> None:
        """``owner``'s step ``step`` averaged to a NaN/Inf: nothing more here (the optimizer or a
        GradScaler skips it); torchft's manager counts it as an error, so no replica commits it."""

    @property
    def step_failed(self) -> bool:
        """Whether a collective of this step failed, so that results read now are not the group's
        (never on a plain process group, where a failure raises; torchft's manager reports it instead)."""
        return False

    # ------------------------------------------------------------------ asynchronous
    def _issue(self, tensor: torch.Tensor, run, after=None) -> Pending:
        if not self.issues:
            if after is not None:
                after()
            return Pending(tensor, None, None, self.clock)
        record: list = [self.clock.stamp(), None, None, None]  # issued, waited, seen complete, work
        self._records.append(record)
        work = run()
        record[3] = work
        return Pending(tensor, work, record, self.clock, after, self._waits)

    def poll(self) -> None:
        """Note the time at which unwaited collectives are seen complete (CPU timing only; called
        at each hook call, so a collective's end is known to within one bucket's backward)."""
        if self.clock.cuda:
            return
        now = None
        for record in self._records:
            if record[2] is None and record[3] is not None and record[3].is_completed():
                now = now if now is not None else time.perf_counter()
                record[2] = now

    # The ways a work is started: a subclass routes them elsewhere (e.g. through torchft's
    # manager, `edgc.integrations.torchft`) and everything above them stays as it is.
    def _all_reduce_work(self, tensor: torch.Tensor, op: dist.ReduceOp.RedOpType):
        return dist.all_reduce(tensor, op=op, group=self.group, async_op=True)

    def _broadcast_work(self, tensor: torch.Tensor):
        return dist.broadcast(tensor, src=self.root, group=self.group, async_op=True)

    def _all_gather_work(self, out: list[torch.Tensor], tensor: torch.Tensor):
        return dist.all_gather(out, tensor, group=self.group, async_op=True)

    def _all_to_all_work(self, out: torch.Tensor, tensor: torch.Tensor):
        return dist.all_to_all_single(out, tensor, group=self.group, async_op=True)

    def _all_gather_into_work(self, out: torch.Tensor, tensor: torch.Tensor):
        return dist.all_gather_single(out, tensor, group=self.group, async_op=True)

    @property
    def group_size(self) -> int:
        """Members of the process group (the chunk owners of a two-stage sync, `edgc.sync.two_stage`); a
        quorum may hold spares, so this can exceed ``world_size``, the replicas that contribute."""
        return self.world_size

    @property
    def group_rank(self) -> int:
        """This process's rank in the process group (which chunk it owns in a two-stage sync)."""
        return self.rank

    def all_to_all_async(self, out: torch.Tensor, tensor: torch.Tensor) -> Pending:
        """Equal splits: ``tensor`` is ``group_size`` blocks, block j goes to rank j, and block i of
        ``out`` comes from rank i (without a process group: ``out`` ← ``tensor``)."""
        if not self.issues:
            out.copy_(tensor)
            return Pending(out, None, None, self.clock)
        return self._issue(out, lambda: self._all_to_all_work(out, tensor))

    def all_gather_into_async(self, out: torch.Tensor, tensor: torch.Tensor) -> Pending:
        """``out`` (``group_size`` blocks of ``tensor``'s size) ← every rank's ``tensor`` in rank order."""
        if not self.issues:
            out.copy_(tensor.reshape(out.shape))
            return Pending(out, None, None, self.clock)
        return self._issue(out, lambda: self._all_gather_into_work(out, tensor))

    def all_reduce_async(self, tensor: torch.Tensor, op: dist.ReduceOp.RedOpType = dist.ReduceOp.SUM) -> Pending:
        return self._issue(tensor, lambda: self._all_reduce_work(tensor, op))

    def mean_async(self, tensor: torch.Tensor, wire_dtype: torch.dtype | None = None) -> Pending:
        """Average ``tensor`` in place over the group, sent as ``wire_dtype`` (default: its own).

        Divides before summing so that half-precision sums cannot overflow.
        """
        if not self.issues:
            return Pending(tensor, None, None, self.clock)
        if wire_dtype is None or wire_dtype == tensor.dtype:
            if self.world_size > 1:
                tensor.div_(self.world_size)
            return self.all_reduce_async(tensor)
        on_wire = torch.div(tensor, self.world_size, out=torch.empty_like(tensor, dtype=wire_dtype))  # one pass
        return self._issue(
            tensor, lambda: self._all_reduce_work(on_wire, dist.ReduceOp.SUM), after=lambda: tensor.copy_(on_wire)
        )

    def sparse_mean_async(self, tensor: torch.Tensor) -> Pending:
        """Average a sparse COO ``tensor`` in place over the group, as DDP's default hook does: divided
        first, then the backend's sparse all-reduce (gloo's; NCCL refuses sparse tensors). The sum
        lands in ``tensor`` once waited for, whether the backend writes it there or returns it."""
        if not self.issues:
            return Pending(tensor, None, None, self.clock)
        if self.world_size > 1:
            tensor.div_(self.world_size)
        works = []

        def run():
            works.append(self._all_reduce_work(tensor, dist.ReduceOp.SUM))
            return works[0]

        def after():
            result = works[0].result()[0] if hasattr(works[0], "result") else tensor
            if result is not tensor:
                tensor.copy_(result)

        return self._issue(tensor, run, after)

    # ------------------------------------------------------------------ blocking
    def all_reduce(self, tensor: torch.Tensor, op: dist.ReduceOp.RedOpType = dist.ReduceOp.SUM) -> torch.Tensor:
        return self.all_reduce_async(tensor, op).wait()

    def mean_(self, tensor: torch.Tensor) -> torch.Tensor:
        """In-place average over the group (blocking)."""
        return self.mean_async(tensor).wait()

    def all_gather(self, tensor: torch.Tensor) -> list[torch.Tensor]:
        """Every rank's ``tensor`` (same shape and dtype on all ranks), in group-rank order."""
        if not self.issues:
            return [tensor]
        out = [torch.empty_like(tensor) for _ in range(self.world_size)]
        self._issue(tensor, lambda: self._all_gather_work(out, tensor)).wait()
        return out

    def broadcast(self, tensor: torch.Tensor) -> torch.Tensor:
        """Overwrite ``tensor`` on every rank with group rank 0's value (blocking)."""
        if not self.issues:
            return tensor
        return self._issue(tensor, lambda: self._broadcast_work(tensor)).wait()


class StepCollectives:
    """The collectives of one finished step: [issue stamp, wait stamp, completion time, work] each,
    and the waits that found work unfinished; seconds are computed when asked (`edgc.device.timing.Clock`)."""

    def __init__(self, records: list[list], waits: list[tuple]):
        self.records, self.waits = records, waits

    def __len__(self) -> int:
        return len(self.records)

    def durations(self) -> list[float | None]:
        durations = []
        for start, end, completed, _ in self.records:
            seconds = Clock.seconds(start, end)
            if seconds is not None and completed is not None:  # CPU: the work may have finished before anyone waited
                seconds = min(seconds, max(0.0, completed - start))
            durations.append(seconds)
        return durations

    def wait_seconds(self) -> float | None:
        """How long the caller was blocked on the network (None on an untimed step)."""
        return Clock.total(self.waits)


# ---------------------------------------------------------------------------- exit
_EXIT_BARRIERS: list = []  # referenced until the interpreter exits (see barrier_before_exit)


def barrier_before_exit(group=None) -> None:
    """Barrier to call once after the last step, before ``destroy_process_group``.

    Why (PyTorch 2.13 on gloo, with or without EDGC): ``torch.autograd.backward`` keeps a Python
    ``contextvars.Context`` in the thread-local state while it runs, and every gloo work keeps a copy
    of its issuing thread's state, so each collective issued during backward (DDP's own or a comm
    hook's) refers to a Python object. A gloo barrier holds weak references to the works still in
    flight when it was issued, and a work's state is freed only with its last reference, weak or
    not. ``dist.barrier()`` drops its handle after waiting, so gloo's worker thread may hold the last
    one. Gloo's threads run until the process exits: ``destroy_process_group`` does not stop them,
    and once a DDP model has been built over the group the group is never freed, even with the model
    deleted. A worker that frees such a barrier once the interpreter is finalizing must take the
    GIL, which ends the thread through a noexcept destructor: "terminate called without an active
    exception" (SIGABRT). Keeping this barrier's work referenced until exit leaves the last
    reference, and the freeing, to the main thread. Accelerate's ``end_training()`` and Lightning's
    exit handler call ``destroy_process_group``: call this before them too. tests/core/exit_race.py
    makes the abort near-certain without it.

    Args:
        group: the process group (or mesh dimension's group) to wait on; None: the default group.
    """
    if not (dist.is_available() and dist.is_initialized()):
        return
    work = dist.barrier(group=as_process_group(group), async_op=True)
    work.wait()
    _EXIT_BARRIERS.append(work)


# ---------------------------------------------------------------------------- bucket jobs
# A *job* syncs one bucket as a generator: it issues collectives (rule 1), then yields so that
# backward can go on, and on resumption waits for them (rule 2) before computing and issuing the
# next ones. It yields ISSUES_MORE when it will issue more collectives once resumed, FINISHES
# when all that is left is to wait and compute locally. Its return value is its result. The
# driver (`edgc.runner.reducer`) resumes jobs at points that depend only on the bucket sequence and on
# what the jobs yielded, never on timing, so every rank issues the same collectives in order.
ISSUES_MORE, FINISHES = "issues more", "finishes"
Job = Generator[str, None, Any]


def run_job(job: Job) -> Any:
    """Run a job to its end, blocking; returns its result."""
    while True:
        try:
            next(job)
        except StopIteration as done:
            return done.value
