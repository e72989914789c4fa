"""How a reducer's bucket jobs run: in a fixed order, gathered into batches, on a side stream.

A *job* (`edgc.distributed.comm`) syncs one or more buckets: it issues collectives, yields, and on resumption
waits for them and goes on; it yields ISSUES_MORE while it has collectives left to issue.

Order. Jobs start in bucket order. At each hook call the bucket's job starts first, then every job
that was in flight before it is resumed once, oldest first, to its next yield: one with collectives
left to issue waits for those it issued and issues the next, one that has issued its last waits for
it and finishes. So on the one side stream the new job's gather and first product are queued before
an older job waits for its collective, and run while that collective is on the wire; and a job
finishes at the hook call after its last collective (on CUDA its wait is the stream's, not the
host's), so what the host issues after the step's last bucket enters the hook is that bucket's job
alone, plus what the calls before it left: nothing once jobs are a hook call apart. Which job runs
when depends only on the bucket sequence and on what the jobs yield, so every rank issues the same
collectives in the same order, whatever the bucket sizes.

Fusion. Consecutive buckets are gathered until they hold at least ``fusion_bytes`` (or the
step's last bucket arrives), and one job syncs them all; their Futures complete together. A
compressed job costs a fixed number of kernel launches plus a few per shape, so on a GPU fewer,
larger jobs launch far fewer kernels; with ``fusion_bytes`` 0 every bucket is its own job (the
finest overlap, what a CPU wants).

Streams. On CUDA every job runs on one side stream, which waits for the current (compute) stream
when a job starts, since the bucket's gradients were written there. A job's collectives are
issued and waited for on that stream (NCCL makes the stream that waits wait; torchft requires
issue and wait on one stream), and each Future's completion is recorded there: DDP's stream waits
for that event before it reads the bucket, and backward's own kernels never queue behind a
compression or a collective. The drain ends with the compute stream waiting for the side stream,
so a blocking caller reads finished tensors. Off CUDA the streams are `torch.cpu`'s stand-ins
(`edgc.device.streams`): every wait is a no-op, and a checker can still see the order on the CPU.
"""

from __future__ import annotations

import contextlib
import types
from collections.abc import Callable, Iterator
from typing import Any

import torch

from ..device import streams
from ..device.timing import Clock
from ..distributed.comm import FINISHES, ISSUES_MORE

Start = Callable[[list[str], list[torch.Tensor], "torch.Tensor | None"], Any]

# A step that fuses at the device's default gathers buckets into jobs of this many MB on an accelerator
# (EDGCConfig.fusion_mb): a job's kernel launches are a fixed count plus a few per shape.
DEFAULT_ACCELERATOR_FUSION_MB = 256


def fusion_megabytes(setting: float | None, device: torch.device | None) -> float:
    """The MB of consecutive buckets one job syncs.

    Args:
        setting: the method's (``StepRecord.fusion_mb``, `EDGCConfig.fusion_mb`): MB, 0 for none, None for the
            device's default.
        device: the gradients' (None: not known yet).

    Returns:
        ``setting``, or where it is None `DEFAULT_ACCELERATOR_FUSION_MB` on an accelerator and 0 on a CPU.
    """
    if setting is not None:
        return setting
    return 0 if device is None or device.type == "cpu" else DEFAULT_ACCELERATOR_FUSION_MB


class _Entry:
    """A started job and the (Future, bucket buffer) pairs it completes."""

    def __init__(self, job, buckets: list[tuple]):
        self.job, self.buckets, self.status = job, buckets, FINISHES


class JobQueue:
    """The jobs of one reducer (see the module docstring); ``on_result`` receives each job's return value
    (or what a blocking sync returned). It holds the reducer's device and the clock that stamps it."""

    def __init__(self, on_result: Callable[[Any], None]):
        self._on_result = on_result
        self.clock = Clock()
        self._busy: list[tuple] = []  # (start, end) stamps of the jobs' time, on their stream
        self.in_flight: list[_Entry] = []
        self._gathered: list[tuple] = []  # (names, grads, bucket buffer, Future) not started yet
        self._gathered_bytes = 0
        self.device: torch.device | None = None
        self.stream: streams.Stream | None = None  # the side stream, once the device is known

    def use_device(self, device: torch.device) -> None:
        """Run on ``device``'s side stream, stamped on its timeline."""
        self.device, self.stream = device, streams.new_stream(device)
        self.clock = Clock(device)

    def __getstate__(self) -> dict:
        """Its device, without the stream, the jobs in flight or whom they report to: a pickled
        state steps nowhere (`edgc.distributed.detached`)."""
        return {
            **self.__dict__,
            "_on_result": None,
            "stream": None,
            "in_flight": [],
            "_gathered": [],
            "_gathered_bytes": 0,
            "_busy": [],
        }

    def take_busy(self) -> list[tuple]:
        """The (start, end) stamps of the jobs' work since the last call."""
        busy, self._busy = self._busy, []
        return busy

    @contextlib.contextmanager
    def side_stream(self, *, after_compute: bool = False) -> Iterator[None]:
        """Run the body on the side stream (after the compute stream's work so far, if asked)."""
        if self.stream is None:
            yield
            return
        if after_compute:
            self.stream.wait_stream(streams.current_stream(self.device))
        with streams.using(self.stream):
            yield

    @contextlib.contextmanager
    def working(self, *, after_compute: bool = False) -> Iterator[None]:
        """The side stream, with the span stamped (on it) as the jobs' time."""
        with self.side_stream(after_compute=after_compute):
            start = self.clock.stamp()
            yield
            self._busy.append((start, self.clock.stamp()))

    def submit(
        self,
        names: list[str],
        grads: list[torch.Tensor],
        flat: torch.Tensor | None,
        future: torch.futures.Future | None,
        start: Start,
        fusion_bytes: float,
    ) -> None:
        """A bucket to sync: its job starts now, or once the gathered buckets reach ``fusion_bytes``;
        then every job in flight before it is resumed to its next yield (see Order)."""
        due = list(self.in_flight)  # each job in flight before this bucket: one stretch further (see Order)
        self._gathered.append((names, grads, flat, future))
        self._gathered_bytes += sum(g.numel() * g.element_size() for g in grads)
        if self._gathered_bytes >= fusion_bytes:
            self.flush(start)
        self._resume(due)

    def flush(self, start: Start) -> None:
        """Start one job for every bucket gathered so far."""
        if not self._gathered:
            return
        gathered, self._gathered, self._gathered_bytes = self._gathered, [], 0
        if len(gathered) == 1:
            names, grads, flat, _ = gathered[0]
        else:  # several buffers: the job gets the tensors, not one flat buffer
            names = [name for entry in gathered for name in entry[0]]
            grads = [grad for entry in gathered for grad in entry[1]]
            flat = None
        with self.working(after_compute=True):
            job = start(names, grads, flat)
            entry = _Entry(
                job if isinstance(job, types.GeneratorType) else None,
                [(future, buffer) for _, _, buffer, future in gathered],
            )
            if entry.job is None and job is not None:  # a blocking sync's result
                self._on_result(job)
            self._advance(entry)

    def resume(self, *, finishing: bool = False) -> bool:
        """Resume, oldest first, the jobs in flight that have collectives to issue (all of them when
        ``finishing``); whether any was resumed."""
        return self._resume(self._due(finishing=finishing))

    def _due(self, *, finishing: bool = False) -> list[_Entry]:
        return [entry for entry in self.in_flight if finishing or entry.status == ISSUES_MORE]

    def _resume(self, due: list[_Entry]) -> bool:
        if due:
            with self.working():
                for entry in due:
                    self._advance(entry)
        return bool(due)

    def drain(self, start: Start) -> None:
        """Start what is gathered and run every job to its end; the compute stream then waits for them."""
        self.flush(start)
        while self.in_flight:
            self.resume(finishing=True)
        if self.stream is not None:
            streams.current_stream(self.device).wait_stream(self.stream)

    def clear(self) -> None:
        self.in_flight, self._gathered, self._gathered_bytes, self._busy = [], [], 0, []

    def _advance(self, entry: _Entry) -> None:
        """Resume one job to its next yield; completes its Futures when it returns (on the side stream,
        so their completion events are recorded there)."""
        if entry.job is not None:
            try:
                entry.status = next(entry.job)
                if entry not in self.in_flight:
                    self.in_flight.append(entry)
                return
            except StopIteration as done:
                if done.value is not None:
                    self._on_result(done.value)
        if entry in self.in_flight:
            self.in_flight.remove(entry)
        for future, buffer in entry.buckets:
            if future is not None:
                future.set_result(buffer)
