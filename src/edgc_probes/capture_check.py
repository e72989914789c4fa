"""The capture checker: whether the work of a step could be held by CUDA graphs, checked on the CPU.

    from edgc_probes.capture_check import check_capture, check_hook_capture
    violations = check_capture(step, steps=2)      # step(): one steady step, on CPU tensors, fake or real
    assert violations == [], "\\n".join(map(str, violations))
    check_hook_capture(gpt2_parameters("tiny"), rank=8)   # a DDP hook's steady static steps, fake tensors

Graphs cannot be captured on a CPU, so what capture needs is checked on the step as it runs eagerly,
over two steady steps or more. What is checked is each region's calls (`edgc.device.graphs.GraphRegion`:
the work a graph would hold): every call of a region against its call before, since a replay repeats
one capture whichever step it is in; and at each place of a step, the same region as ``period`` steps
before (2 where a region per buffer is used in turn; then check 2·period steps, so that each is
compared). Where the step has no region: every stretch of the library's work between two points a
graph cannot hold (a collective issued, a wait, a host read; `edgc_probes.capture_check_trace`), each
step against the ``period``-th before it: what today's engine could put in graphs. The rules, each a
kind of `Violation`:

- ``op sequence``: the same operators, in the same order, at every call (every step);
- ``arguments``: each with the same non-tensor arguments (scalars, dims, dtypes), on tensors of the
  same shapes, strides, dtypes and offsets (a region that alternates between two halves of a buffer
  breaks this: its replay would always use the captured half);
- ``fresh buffer``: a storage made inside a call and used after it (a result kept, sent or read): made
  anew at every call, where a graph's replay writes the same memory each time;
- ``changed buffer``: a storage made outside a call and used in it that is not the one the call before
  used there (made anew each step outside the region);
- ``undeclared buffer``: one crossing an explicit region's boundary that is not among its buffers
  (the replay could not tell that it changed);
- ``host sync``: a host read or synchronisation (``.item()``, ``tolist``, ``.cpu()``, a blocking copy,
  an event's or stream's ``synchronize``, ``to_host``) inside a region, or anywhere in the library's
  work outside `edgc.device.timing.host_reads_allowed`;
- ``data-dependent size``: an operator whose output size depends on values (``nonzero``, a boolean
  mask, ``unique``, ``repeat_interleave`` without ``output_size``), where host syncs count;
- ``collective in region``, ``wait in region``: a collective issued, or a wait for one or for another
  stream, inside a region: they stay outside graphs;
- ``new region``: a region called at the same place of a step and ``period`` steps before that is not
  the same `GraphRegion` (made per step, it would capture at every step).

It is the CPU stream checker (`edgc_probes.stream_check.StreamChecker`) with a record of its own, so it
sees what that one sees: every thread, stream waits, host syncs of real tensors by provenance (a host
tensor's values are the host's). On fake tensors (`torch._subclasses.fake_tensor.FakeTensorMode`, the
dispatch counter's harness) every tensor stands for a device one; a fake tensor cannot answer a host
read, so its step stops there, the read reported. Usable as a context too: ``with CaptureChecker() as
c:``, each checked step in ``with c.step():``, then ``c.violations()``.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable

import torch
from torch.utils._python_dispatch import is_traceable_wrapper_subclass

import edgc.device.timing
from edgc.device import graphs
from edgc.distributed.comm import Communicator, Pending

from .capture_check_judge import COLLECTIVE, DATA_DEPENDENT, HOST_SYNC, WAIT, Violation, judge
from .capture_check_trace import Trace, frame_in
from .op_traffic import tensors_in
from .stream_check import EDGC_DIR, HOST, PINNED, StreamChecker
from .stream_check_syncs import value_read

__all__ = ["CaptureChecker", "Violation", "check_capture", "check_hook_capture", "passing_regions"]


class CaptureChecker(StreamChecker):
    """See the module docstring. ``library``: the folder whose work is checked outside regions, and
    whose host syncs count (default: the ``edgc`` package)."""

    def __init__(self, library: str = EDGC_DIR):
        super().__init__(library)
        self.trace = Trace(self.library)
        self._observing = contextlib.ExitStack()

    def __enter__(self):
        super().__enter__()
        self._observing.enter_context(graphs.observing(self.trace))
        self.patches.replace(Communicator, "_issue", self._issue)
        self.patches.replace(Pending, "wait", self._pending_wait)
        self.patches.replace(edgc.device.timing, "to_host", self._to_host)
        return self

    def __exit__(self, *exc):
        self._observing.close()
        return super().__exit__(*exc)

    @contextlib.contextmanager
    def step(self):
        """The body is one checked step."""
        self.trace.begin_step()
        try:
            yield
        finally:
            self.trace.end_step()

    def violations(self, period: int = 1) -> list[Violation]:
        """What the checked steps break, each step against the ``period``-th before it."""
        return judge(self.trace, period)

    def _recording(self) -> bool:
        return self.trace.recording and self.watching()

    def _site(self, frame, explicit: bool) -> str:
        if frame is not None:
            return frame.site
        return self.here() if explicit else "outside the library"

    # ------------------------------------------------------------------ operators
    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        trace = self.trace
        if not self._recording() or func.namespace == "prim":  # prim: a fake tensor's metadata queries
            return super().__torch_dispatch__(func, types, args, kwargs)
        inputs = tensors_in(args) + tensors_in(kwargs)
        if any(is_traceable_wrapper_subclass(t) for t in inputs):
            return NotImplemented  # a DTensor: its local tensors' operators come here next
        frame = frame_in(self.library)
        collective = func.namespace == "c10d"
        call = None if collective else trace.call_for(frame)
        site = self._site(frame, call is not None and call.explicit)
        if collective:
            self._collective_out(inputs, site)
        self._value_read(func, args, kwargs, call, frame, site)
        keys = trace.record(func, args, kwargs, call, frame, site)
        with trace.quiet():  # its own host read and waits are this operator's, noted above
            outputs = super().__torch_dispatch__(func, types, args, kwargs)
        trace.made(tensors_in(outputs), keys, call, str(func), frame)
        return outputs

    def _value_read(self, func, args, kwargs, call, frame, site: str) -> None:
        read = value_read(func, args, kwargs)
        if read is None:
            return
        what, sized, tensor = read
        if call is not None and not call.explicit:
            call = None  # a stretch of eager work: the step's
        if call is None:
            if frame is None or edgc.device.timing.host_reads_are_allowed():
                return
            if tensor is not None and self.kind_of(tensor) in (HOST, PINNED):
                return  # a host tensor's values are the host's
        if sized:
            self.trace.note(DATA_DEPENDENT, call, site, f"{what}: the size of its output depends on values")
        else:
            self.trace.note(HOST_SYNC, call, site, f"{what} reads a device value on the host")
        self.trace.boundary()

    def _collective_out(self, tensors: list[torch.Tensor], site: str) -> None:
        call = self.trace.region()
        if call is not None and not self.trace.is_quiet():
            self.trace.note(COLLECTIVE, call, site, "a collective is issued inside the region")
        self.trace.crossing_out(tensors, "a collective", site)

    # ------------------------------------------------------------------ what stops a stretch
    def note_host_sync(self, kind: str) -> None:
        trace = self.trace
        if self._recording() and not trace.is_quiet():
            call, frame = trace.region(), frame_in(self.library)
            allowed = edgc.device.timing.host_reads_are_allowed() or self.patches.waits_inline()
            detail = f"{kind} makes the host wait for the device"
            if call is not None:
                trace.note(HOST_SYNC, call, self._site(frame, True), detail)
            elif frame is not None and not allowed:
                trace.note(HOST_SYNC, None, frame.site, detail)
            trace.boundary()
        super().note_host_sync(kind)

    def wait(self, stream_id: int, state: dict) -> None:
        trace = self.trace
        if self._recording() and not trace.is_quiet():
            call = trace.region()
            if call is not None:
                site = self._site(frame_in(self.library), True)
                trace.note(WAIT, call, site, f"{self.label(stream_id)} waits for another stream or a collective")
            trace.boundary()
        super().wait(stream_id, state)

    def _issue(self, original):
        def issue(comm, tensor, run, after=None):
            if not self._recording():
                return original(comm, tensor, run, after)
            self._collective_out([tensor], self._site(frame_in(self.library), self.trace.region() is not None))
            with self.trace.quiet():
                return original(comm, tensor, run, after)

        return issue

    def _pending_wait(self, original):
        def wait(pending):
            trace = self.trace
            if self._recording():
                call = trace.region()
                if call is not None and not trace.is_quiet():
                    trace.note(WAIT, call, self._site(frame_in(self.library), True), "waits for a collective")
                trace.boundary()
            with trace.quiet():
                return original(pending)

        return wait

    def _to_host(self, original):
        def to_host(tensor):
            trace = self.trace
            if not self._recording():
                return original(tensor)
            call = trace.region()
            site = self._site(frame_in(self.library), call is not None)
            if call is not None and not trace.is_quiet():
                trace.note(HOST_SYNC, call, site, "to_host reads a device value on the host")
            trace.crossing_out([tensor], "a host read (to_host)", site)
            with trace.quiet():
                return original(tensor)

        return to_host


# A fake tensor's answer to a host read or a value-sized operator: its step cannot go on.
FAKE_STOPS = (
    torch._subclasses.fake_tensor.DataDependentOutputException,
    torch._subclasses.fake_tensor.DynamicOutputShapeException,
)


def _checked(step: Callable[[], object], steps: int, settle: int, period: int, library: str) -> CaptureChecker:
    if not isinstance(period, int) or period < 1 or steps < period + 1:
        raise ValueError(f"check_capture: steps ({steps}) must exceed period ({period}), an int ≥ 1")
    with CaptureChecker(library) as checker:
        try:
            for _ in range(settle):
                step()
            for _ in range(steps):
                with checker.step():
                    step()
        except FAKE_STOPS as error:
            checker.trace.note(HOST_SYNC, None, "a fake tensor", f"the step stopped at a host read: {error}")
    return checker


def check_capture(
    step: Callable[[], object], steps: int = 2, *, settle: int = 0, period: int = 1, library: str = EDGC_DIR
) -> list[Violation]:
    """Run ``step()`` ``settle`` times, then ``steps`` times checked, under a `CaptureChecker`; the
    violations (see the module docstring; ``period``: 2 where a region per buffer is used in turn)."""
    return _checked(step, steps, settle, period, library).violations(period)


def passing_regions(step: Callable[[], object], steps: int = 4, *, period: int = 2) -> frozenset[str]:
    """The names of the graph regions called in ``steps`` checked runs of ``step()`` that no violation is
    in and whose every `GraphRegion` was called twice at least (compared once): those a GPU would replay
    (`edgc_probes.dispatch_count` counts each call of one as one launch). Period 2 by default, so that a
    region per buffer used in turn passes, as its graphs would."""
    checker = _checked(step, steps, 0, period, EDGC_DIR)
    calls: dict[int, tuple[str, int]] = {}  # id(region) → (name, calls)
    for traced in checker.trace.steps:
        for call in traced.calls:
            if call.explicit:
                name, count = calls.get(id(call.region), (call.name, 0))
                calls[id(call.region)] = (name, count + 1)
    once = {name for name, count in calls.values() if count < 2}
    failed = {violation.region for violation in checker.violations(period)}
    return frozenset({name for name, _ in calls.values()} - once - failed)


def check_hook_capture(
    named_shapes: list[tuple[str, tuple[int, ...]]], steps: int = 2, *, period: int = 1, **settings
) -> list[Violation]:
    """`check_capture` over steady steps of a DDP hook's state on fake gradients of ``named_shapes``
    (`edgc_probes.hook_steps.settled_hook` and its ``settings``: ``rank``, ``config``, ``bucket_cap_mb``,
    …), each settled as the dispatch counter's counted step is. E.g. ``check_hook_capture(
    gpt2_parameters("tiny"), rank=8, config=sampled_config(8))`` for two sampled steps."""
    from .hook_steps import settled_hook

    with settled_hook(named_shapes, **settings) as run:
        return check_capture(run.settled_step, steps, period=period)
