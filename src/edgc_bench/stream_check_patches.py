"""What `edgc_bench.stream_check.StreamChecker` replaces while it is active, and puts back after.

`torch.cpu`'s stream and event stand-ins get an identity and tell the checker of every wait and
record; the current stream becomes per thread (torch keeps one for the process). ``Work.wait``
orders the current stream after the collectives. Python-level calls that a dispatch mode cannot
see say what they do: factories called with ``device=`` make device tensors, ``.to(device)`` of a
host tensor copies, ``.cpu()``/``tolist``/``numpy`` of a device tensor and blocking copies of host
data are host synchronisations. Calls from other threads go through unchanged.
"""

from __future__ import annotations

import os
import sys
import threading
from collections import namedtuple

import torch
import torch.distributed as dist

import edgc.streams

FACTORIES = ("zeros", "ones", "empty", "full", "randn", "rand", "randint", "arange")
_Operator = namedtuple("_Operator", "name")  # what an access names as its kernel
_MISSING = object()


def _caller_label() -> str:
    """Where a stream was made: the first frame above `edgc.streams` and `torch.cpu`."""
    frame = sys._getframe(2)
    while frame.f_back is not None and frame.f_code.co_filename in (edgc.streams.__file__, torch.cpu.__file__):
        frame = frame.f_back
    return f"{os.path.basename(frame.f_code.co_filename)}:{frame.f_lineno} ({frame.f_code.co_name})"


class Patches:
    def __init__(self, checker):
        self.checker = checker
        self._saved: list[tuple[object, str, object]] = []
        self._local = threading.local()  # the current cpu stream, per thread

    # ------------------------------------------------------------------ installing
    def _set(self, owner, name: str, make) -> None:
        original = getattr(owner, name)
        self._saved.append((owner, name, owner.__dict__.get(name, _MISSING)))
        setattr(owner, name, make(original))

    def install(self) -> None:
        cpu = torch.cpu
        self._set(cpu.Stream, "__init__", self._stream_init)
        self._set(cpu.Stream, "wait_stream", self._wait_stream)
        self._set(cpu.Stream, "record_event", self._record_event)
        self._set(cpu.Stream, "wait_event", self._wait_event)
        self._set(cpu.Event, "record", self._event_record)
        self._set(cpu.Event, "wait", self._event_wait)
        self._set(cpu.Event, "synchronize", self._event_synchronize)
        self._set(cpu, "current_stream", self._current_stream)
        self._set(cpu.StreamContext, "__enter__", self._context_enter)
        self._set(cpu.StreamContext, "__exit__", self._context_exit)
        self._set(dist.Work, "wait", self._work_wait)
        self._set(edgc.streams, "record_stream_observer", lambda _: self.checker.record_stream)
        for name in FACTORIES:
            self._set(torch, name, self._factory)
        self._set(torch, "tensor", self._from_data)
        self._set(torch, "as_tensor", self._from_data)
        self._set(torch.Tensor, "to", self._to)
        self._set(torch.Tensor, "cpu", self._cpu)
        self._set(torch.Tensor, "tolist", lambda original: self._read("tolist", original))
        self._set(torch.Tensor, "numpy", lambda original: self._read("numpy", original))

    def remove(self) -> None:
        for owner, name, value in reversed(self._saved):
            if value is _MISSING:
                delattr(owner, name)
            else:
                setattr(owner, name, value)
        self._saved = []

    # ------------------------------------------------------------------ streams and events
    def _stream_init(self, original):
        def init(stream, *args, **kwargs):
            original(stream, *args, **kwargs)
            self.checker.stream_id(stream, _caller_label())

        return init

    def _id(self, stream) -> int:
        return self.checker.current() if stream is None else self.checker.stream_id(stream)

    def _wait_stream(self, original):
        def wait_stream(stream, other):
            if self.checker.on_this_thread():
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
            recorded = getattr(event, "_checker_state", None)
            if recorded is not None and self.checker.on_this_thread():
                self.checker.wait(self._id(stream), recorded)

        return wait_event

    def _event_record(self, original):
        def record(event, stream=None):
            if self.checker.on_this_thread():
                event._checker_state = self.checker.state_of(self._id(stream))

        return record

    def _event_wait(self, original):
        def wait(event, stream=None):
            recorded = getattr(event, "_checker_state", None)
            if recorded is not None and self.checker.on_this_thread():
                self.checker.wait(self._id(stream), recorded)

        return wait

    def _event_synchronize(self, original):
        def synchronize(event):
            recorded = getattr(event, "_checker_state", None)
            if recorded is not None and self.checker.on_this_thread():
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

    def _work_wait(self, original):
        def wait(work, *args, **kwargs):
            result = original(work, *args, **kwargs)
            if self.checker.on_this_thread():  # NCCL: the current stream waits for the collective
                self.checker.wait(self.checker.current(), self.checker.state_of(self.checker.collectives))
            return result

        return wait

    # ------------------------------------------------------------------ tensors made and moved
    def _made_on_device(self, tensor: torch.Tensor, how: str) -> torch.Tensor:
        """``tensor`` is a device tensor, just written on the current stream."""
        checker = self.checker
        checker.mark(tensor, True)
        key = checker._key(tensor)
        if key is not None:
            checker.events._handle_kernel_launch(checker.current(), set(), {key}, {key}, _Operator(how), {key: []})
        return tensor

    def _factory(self, original):
        def factory(*args, **kwargs):
            result = original(*args, **kwargs)
            if kwargs.get("device") is not None and isinstance(result, torch.Tensor) and self.checker.on_this_thread():
                self._made_on_device(result, f"torch.{original.__name__}")
            return result

        return factory

    def _from_data(self, original):
        def from_data(data, *args, **kwargs):
            device = kwargs.get("device", args[1] if len(args) > 1 else None)
            if device is None or not self.checker.on_this_thread():
                return original(data, *args, **kwargs)
            checker = self.checker
            if not isinstance(data, torch.Tensor):
                checker.host_sync(f"torch.{original.__name__} of host data with device=")
            elif checker.is_device(data):
                return original(data, *args, **kwargs)
            else:
                checker.host_sync(f"torch.{original.__name__} of a host tensor with device=")
            result = original(data, *args, **kwargs)
            if (
                isinstance(data, torch.Tensor)
                and result.untyped_storage().data_ptr() == data.untyped_storage().data_ptr()
            ):
                result = result.clone()
            return self._made_on_device(result, f"torch.{original.__name__}")

        return from_data

    def _to(self, original):
        def to(tensor, *args, **kwargs):
            checker = self.checker
            if not checker.on_this_thread() or checker.is_device(tensor):
                return original(tensor, *args, **kwargs)
            device, _, non_blocking, _ = torch._C._nn._parse_to(*args, **kwargs)
            if device is None:
                return original(tensor, *args, **kwargs)
            if not non_blocking:
                checker.host_sync("blocking .to(device) of a host tensor")
            result = original(tensor, *args, **kwargs)
            if result.untyped_storage().data_ptr() == tensor.untyped_storage().data_ptr():
                result = result.clone()  # a host-to-device copy makes a new tensor
            return self._made_on_device(result, "host-to-device copy")

        return to

    def _cpu(self, original):
        def cpu(tensor, *args, **kwargs):
            checker = self.checker
            if not checker.on_this_thread() or not checker.is_device(tensor):
                return original(tensor, *args, **kwargs)
            checker.host_sync(".cpu()", tensor)
            result = original(tensor, *args, **kwargs).clone()  # the host's own copy
            checker.mark(result, False)
            return result

        return cpu

    def _read(self, kind: str, original):
        def read(tensor, *args, **kwargs):
            if self.checker.on_this_thread() and self.checker.is_device(tensor):
                self.checker.host_sync(kind, tensor)
            return original(tensor, *args, **kwargs)

        return read
