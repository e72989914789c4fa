"""What the capture checker (`edgc_probes.capture_check`) records while a step runs: its operators, the
calls of its regions, where each storage was made and what crosses a region's boundary.

A *call* is one call of a region in one step: a `edgc.device.graphs.GraphRegion`'s (explicit), or, where
the step has none, a stretch of the library's work between two points a CUDA graph cannot hold: a
collective issued, a wait (for a collective or another stream), a host read or synchronisation, a
region's begin or end. Each storage is known by its identity (``UntypedStorage._cdata``, fake tensors
too) and every storage seen is held until the checker ends, so no address is reused and two storages
seen are two storages. A storage is *made* in the call whose operator first outputs it; one first
seen as an input was made before the checked steps. It *crosses into* a call that reads or writes it
without having made it, and *escapes* the call that made it when anything else uses it.
"""

from __future__ import annotations

import contextlib
import linecache
import os
import sys
import threading
from dataclasses import dataclass, field

import torch
from torch.utils import _pytree as pytree

from edgc.adapters import torch_adapter

from .op_traffic import tensors_in


@dataclass(frozen=True)
class Frame:
    """A frame of the code under check: ``site`` reads ``file:line (function)``."""

    site: str
    filename: str
    lineno: int

    @property
    def line(self) -> str:
        return linecache.getline(self.filename, self.lineno).strip()


def frame_in(library: str, depth: int = 2) -> Frame | None:
    """The innermost frame of the caller's stack under ``library`` (a folder), or None."""
    frame = sys._getframe(depth)
    while frame is not None:
        filename = frame.f_code.co_filename
        if filename.startswith(library):
            where = os.path.relpath(filename, os.path.dirname(library.rstrip(os.sep)))
            return Frame(f"{where}:{frame.f_lineno} ({frame.f_code.co_name})", filename, frame.f_lineno)
        frame = frame.f_back
    return None


@dataclass(eq=False)
class Call:
    """One call of a region in one step (see the module docstring)."""

    name: str
    explicit: bool
    region: object | None = None  # the GraphRegion of an explicit call
    declared: frozenset = frozenset()  # keys of the storages passed as its buffers
    inputs: dict = field(default_factory=dict)  # key → (operator, site) of its first use, in order


@dataclass(eq=False)
class Birth:
    """Where a storage was made: the step (from 0), the call (None: outside every call), the operator."""

    step: int
    call: Call | None
    op: str
    frame: Frame | None

    def describe(self, site: bool = True) -> str:
        if self.frame is None:
            return f"{self.op} outside the library"
        return f"`{self.frame.line}` ({self.op}, {self.frame.site})" if site else f"`{self.frame.line}` ({self.op})"


@dataclass
class OpRecord:
    op: str
    signature: tuple
    site: str
    call: Call | None
    library: bool  # issued from the library's code (the frame is under it)


@dataclass
class StepTrace:
    ops: list[OpRecord] = field(default_factory=list)
    calls: list[Call] = field(default_factory=list)


SCALARS = (int, float, bool, str, type(None), torch.dtype, torch.device, torch.layout, torch.memory_format)


def _leaf(value) -> object:
    if isinstance(value, torch.Tensor):
        return ("tensor", tuple(value.shape), tuple(value.stride()), value.dtype, value.storage_offset())
    if isinstance(value, float):
        return repr(value)  # NaN equals NaN
    if isinstance(value, SCALARS):
        return value
    return type(value).__name__  # a process group, a work: their kind only


def signature(args, kwargs) -> tuple:
    """An operator's arguments as compared between steps: every non-tensor value, and each tensor's
    shape, strides, dtype and offset (its storage is compared on its own)."""
    return tuple(_leaf(value) for value in pytree.tree_leaves((args, kwargs)))


key_of = torch_adapter.storage_identity


class Trace:
    """The record of the checked steps (see the module docstring). ``found``: (kind, call, site,
    detail) of what is wrong as it happens (a host read, a collective in a region, …)."""

    def __init__(self, library: str):
        self.library = library
        self.steps: list[StepTrace] = []
        self.recording = False
        self.births: dict[int, Birth] = {}
        self.held: dict[int, torch.UntypedStorage] = {}
        self.escapes: dict[int, tuple[Birth, str]] = {}  # key → (its birth, where it was used outside)
        self.found: list[tuple[str, Call | None, str, str]] = []
        self.segment: Call | None = None  # the stretch of library work under way (no explicit region)
        self.lock = threading.RLock()
        self._local = threading.local()  # .regions: explicit calls entered; .quiet: depth

    # ------------------------------------------------------------------ steps and calls
    def begin_step(self) -> None:
        with self.lock:
            self.steps.append(StepTrace())
            self.recording, self.segment = True, None

    def end_step(self) -> None:
        with self.lock:
            self.recording, self.segment = False, None

    def regions(self) -> list[Call]:
        if not hasattr(self._local, "regions"):
            self._local.regions = []
        return self._local.regions

    def region(self) -> Call | None:
        """The explicit call this thread is in (the outermost), or None."""
        regions = self.regions()
        return regions[0] if regions else None

    def boundary(self) -> None:
        """Something a graph cannot hold: the stretch under way ends."""
        self.segment = None

    def call_for(self, frame: Frame | None) -> Call | None:
        region = self.region()
        if region is not None or frame is None:
            return region
        with self.lock:
            if self.segment is None:
                self.segment = Call(f"the stretch from {frame.site}", explicit=False)
                self.steps[-1].calls.append(self.segment)
            return self.segment

    def region_begin(self, region, buffers, mode) -> None:
        if not self.recording:
            return
        with self.lock:
            self.boundary()
            call = Call(region.name, explicit=True, region=region, declared=frozenset(key_of(b) for b in buffers))
            for buffer in buffers:
                self.hold(buffer)
            if not self.regions():
                self.steps[-1].calls.append(call)
            self.regions().append(call)

    def region_end(self, region, buffers, mode) -> None:
        if self.regions():
            self.regions().pop()
            self.boundary()

    @contextlib.contextmanager
    def quiet(self):
        """What the body notices is part of something already noted (an operator's own host read)."""
        self._local.quiet = getattr(self._local, "quiet", 0) + 1
        try:
            yield
        finally:
            self._local.quiet -= 1

    def is_quiet(self) -> bool:
        return getattr(self._local, "quiet", 0) > 0

    # ------------------------------------------------------------------ storages
    def hold(self, tensor: torch.Tensor) -> int:
        key = key_of(tensor)
        if key not in self.held:
            self.held[key] = tensor.untyped_storage()
        return key

    def used(self, tensors: list[torch.Tensor], call: Call | None, op: str, site: str) -> set[int]:
        """``tensors`` are read or written by ``op`` in ``call``; their keys."""
        keys = set()
        with self.lock:
            for tensor in tensors:
                key = self.hold(tensor)
                keys.add(key)
                birth = self.births.get(key)
                if birth is not None and birth.call is not None and birth.call is not call:
                    self.escapes.setdefault(key, (birth, f"{op} at {site}"))
                if call is not None and (birth is None or birth.call is not call):
                    call.inputs.setdefault(key, (op, site))
        return keys

    def made(self, tensors: list[torch.Tensor], inputs: set[int], call: Call | None, op: str, frame) -> None:
        with self.lock:
            for tensor in tensors:
                key = key_of(tensor)
                if key not in self.held and key not in inputs:
                    self.births[key] = Birth(len(self.steps) - 1, call, op, frame)
                self.hold(tensor)

    def crossing_out(self, tensors: list[torch.Tensor], what: str, site: str) -> None:
        """``tensors`` leave the step's capturable work here (a collective, a host read)."""
        self.used(tensors, None, what, site)
        self.boundary()

    # ------------------------------------------------------------------ operators
    def record(self, func, args, kwargs, call: Call | None, frame: Frame | None, site: str) -> set[int]:
        """An operator about to run in ``call``: its place in the step's sequence and what it uses (the
        keys of its input storages, for `made` once it has run). A view touches no memory: what crosses
        is what reads or writes it."""
        with self.lock:
            op = str(func)
            self.steps[-1].ops.append(OpRecord(op, signature(args, kwargs), site, call, frame is not None))
            inputs = tensors_in(args) + tensors_in(kwargs)
            if func.is_view:
                return {self.hold(tensor) for tensor in inputs}
            return self.used(inputs, call, op, site)

    def note(self, kind: str, call: Call | None, site: str, detail: str) -> None:
        with self.lock:
            self.found.append((kind, call, site, detail))
