"""What `edgc_probes.stream_check.StreamChecker` replaces while it is active, and puts back after.

`torch.cpu`'s stream and event stand-ins get an identity and tell the checker of every wait, record
and host wait (``Event.synchronize``, ``Stream.synchronize``, ``torch.cpu.synchronize``); the
current stream becomes per thread (torch keeps one for the process). ``Work.wait`` and the wait of
a work's future order the current stream after that work's end. Python-level calls that a dispatch
mode cannot see say what they make: factories class their tensors (device, host or pinned host),
``.to(device)`` of a host tensor copies (a host synchronisation unless non-blocking),
``.pin_memory()`` makes pinned memory, ``.cpu()``/``tolist``/``numpy`` of a device tensor make the
host wait (of a pinned buffer: the host reads it), ``torch.load`` makes host tensors. `edgc.device.streams`
is told that the CPU stands for CUDA here, so the library takes CUDA's pinned-copy path. Calls from
threads the checker does not watch go through unchanged.
"""

from __future__ import annotations

import os
import sys
import threading

import torch
import torch.distributed as dist

import edgc.device.streams

from .stream_check_memory import DEVICE
from .stream_check_moves import Moves

_MISSING = object()


def _caller_label() -> str:
    """Where a stream was made: the first frame above `edgc.device.streams` and `torch.cpu`."""
    frame = sys._getframe(2)
    while frame.f_back is not None and frame.f_code.co_filename in (edgc.device.streams.__file__, torch.cpu.__file__):
        frame = frame.f_back
    return f"{os.path.basename(frame.f_code.co_filename)}:{frame.f_lineno} ({frame.f_code.co_name})"


class Patches:
    def __init__(self, checker):
        self.checker = checker
        self._saved: list[tuple[object, str, object]] = []
        self._local = threading.local()  # .stream: the current cpu stream
        self.moves = Moves(checker)

    def building(self):
        """Set-up code in the body (`StreamChecker.device`)."""
        return self.moves.building()

    def waits_inline(self) -> bool:
        return self.moves.waits_inline()

    def factory_kind(self, default: str | None = DEVICE) -> str | None:
        return self.moves.factory_kind(default)

    # ------------------------------------------------------------------ installing
    def replace(self, owner, name: str, make) -> None:
        """``owner.name`` becomes ``make(the original)`` until `remove` (a checker built on this one adds its own)."""
        self._set(owner, name, make)

    def _set(self, owner, name: str, make) -> None:
        original = getattr(owner, name, None)
        self._saved.append((owner, name, owner.__dict__.get(name, _MISSING)))
        setattr(owner, name, make(original))

    def install(self) -> None:
        cpu = torch.cpu
        self._set(cpu.Stream, "__init__", self._stream_init)
        self._set(cpu.Stream, "wait_stream", self._wait_stream)
        self._set(cpu.Stream, "record_event", self._record_event)
        self._set(cpu.Stream, "wait_event", self._wait_event)
        self._set(cpu.Stream, "synchronize", self._stream_synchronize)
        self._set(cpu.Event, "record", self._event_record)
        self._set(cpu.Event, "wait", self._event_wait)
        self._set(cpu.Event, "synchronize", self._event_synchronize)
        self._set(cpu, "synchronize", self._synchronize)
        self._set(cpu, "current_stream", self._current_stream)
        self._set(cpu.StreamContext, "__enter__", self._context_enter)
        self._set(cpu.StreamContext, "__exit__", self._context_exit)
        self._set(dist.Work, "wait", self._work_wait)
        self._set(edgc.device.streams, "record_stream_observer", lambda _: self.checker.record_stream)
        self._set(edgc.device.streams, "pinned_off_cuda", lambda _: self.checker.watching)
        self.moves.install(self._set)
        self.checker.threads.install(self._set)

    def remove(self) -> None:
        for owner, name, value in reversed(self._saved):
            if value is _MISSING:
                delattr(owner, name)
            else:
                setattr(owner, name, value)
        self._saved = []

    def _watching(self) -> bool:
        return self.checker.watching()

    # ------------------------------------------------------------------ streams and events
    def _stream_init(self, original):
        def init(stream, *args, **kwargs):
            original(stream, *args, **kwargs)
            if self._watching():
                self.checker.stream_id(stream, _caller_label())

        return init

    def _id(self, stream) -> int:
        return self.checker.current() if stream is None else self.checker.stream_id(stream)

    def _wait_stream(self, original):
        def wait_stream(stream, other):
            if self._watching():
                self.checker.wait(self._id(stream), self.checker.state_of(self._id(other)))

        return wait_stream

    def _record_event(self, original):
        def record_event(stream):
            event = torch.cpu.Event()
            event.record(stream)
            return event

        return record_event

    def _wait_event(self, original):
        def wait_event(stream, event):
            recorded = getattr(event, "edgc_checker_state", None)
            if recorded is not None and self._watching():
                self.checker.wait(self._id(stream), recorded)

        return wait_event

    def _stream_synchronize(self, original):
        def synchronize(stream):
            if self._watching():
                self.checker.host_waits(self.checker.state_of(self._id(stream)))
                self.checker.note_host_sync("Stream.synchronize")

        return synchronize

    def _synchronize(self, original):
        def synchronize(device=None):
            if self._watching():
                self.checker.host_waits_for_all()
                self.checker.note_host_sync("synchronize")

        return synchronize

    def _event_record(self, original):
        def record(event, stream=None):
            if self._watching():
                event.edgc_checker_state = self.checker.state_of(self._id(stream))

        return record

    def _event_wait(self, original):
        def wait(event, stream=None):
            recorded = getattr(event, "edgc_checker_state", None)
            if recorded is not None and self._watching():
                self.checker.wait(self._id(stream), recorded)

        return wait

    def _event_synchronize(self, original):
        def synchronize(event):
            recorded = getattr(event, "edgc_checker_state", None)
            if recorded is not None and self._watching():
                self.checker.host_waits(recorded)
                self.checker.note_host_sync("Event.synchronize")

        return synchronize

    def _current_stream(self, original):
        def current_stream(device=None):
            return getattr(self._local, "stream", None) or torch.cpu._default_cpu_stream

        return current_stream

    def _context_enter(self, original):
        def enter(context):
            if context.stream is not None:
                context.prev_stream = torch.cpu.current_stream()
                self._local.stream = context.stream

        return enter

    def _context_exit(self, original):
        def exit_(context, *exc):
            if context.stream is not None:
                self._local.stream = context.prev_stream

        return exit_

    # ------------------------------------------------------------------ works and futures
    def _work_wait(self, original):
        def wait(work, *args, **kwargs):
            result = original(work, *args, **kwargs)
            if self._watching():  # NCCL: the current stream waits for this work's end, and no other's
                known = self.checker.works.get(id(work))
                if known is None or known[0] is not work:
                    self.checker.races.append(
                        f"Work.wait of a collective the checker did not see issued, at {self.checker.here()}"
                    )
                else:
                    self.checker.wait(self.checker.current(), known[1])
            return result

        return wait
