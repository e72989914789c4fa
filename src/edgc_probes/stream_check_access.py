"""Kernel accesses and the races between them, for `edgc_probes.stream_check`.

The rule is `torch.cuda._sanitizer`'s: each storage keeps its last write and the reads since; a
kernel on stream S that reads a storage must be ordered after its last write, and one that writes
it after its last write and every read since, unless they were on S itself. Ordered after means
S's state (`torch.cuda._sanitizer.StreamSynchronizations`) has seen the other stream's sequence
number of that access. Unlike the sanitizer, a kernel's stack is taken as bare frames (file, line,
function) without reading source lines: a check runs at every kernel of a training step.

Which storages a kernel reads and writes comes from the operator's schema: a mutable argument
(``add_``'s self, ``out=``) is written, other tensor arguments are read, and the results that are
not views are written (the outputs of ``*_like``/``new_*`` factories excepted, as the sanitizer
has it). ``c10d`` schemas mark nothing: a collective writes its ``output*`` arguments and the
``tensors`` of an in-place one (all but ``send``), and reads the rest.
"""

from __future__ import annotations

import re
import sys
import traceback
from dataclasses import dataclass, field

import torch
from torch.cuda._sanitizer import StreamSynchronizations

from edgc.adapters import torch_adapter

from .op_traffic import tensors_in

FACTORY = re.compile("(new_.*|.*_like)")
READ, WRITE = "reading from", "writing to"


@dataclass
class Access:
    type: str  # READ or WRITE
    seq_num: int
    stream: int
    operator: str
    stack: tuple  # (file, line, function) per frame, outermost first

    @property
    def stack_trace(self) -> list[traceback.FrameSummary]:
        return [traceback.FrameSummary(f, line, name, lookup_line=False) for f, line, name in self.stack]


@dataclass
class _Accessed:
    write: Access | None = None
    reads: list[Access] = field(default_factory=list)


@dataclass
class Race:
    """Two accesses to one storage on different streams with no wait between them, one a write."""

    now: Access
    before: Access


def cheap_stack(skip: int = 2) -> tuple:
    frames = []
    frame = sys._getframe(skip)
    while frame is not None:
        frames.append((frame.f_code.co_filename, frame.f_lineno, frame.f_code.co_name))
        frame = frame.f_back
    frames.reverse()
    return tuple(frames)


class Accesses:
    """The accesses of every storage (by key) and the streams' order."""

    def __init__(self):
        self.syncs = StreamSynchronizations()
        self.by_key: dict[int, _Accessed] = {}
        self.seq_num = 0

    def new_stream(self, stream: int) -> None:
        self.syncs.create_stream(stream)

    def forget(self, key: int) -> _Accessed | None:
        return self.by_key.pop(key, None)

    def ordered(self, stream: int, access: Access) -> bool:
        """Whether ``stream``'s work from now on is ordered after ``access``."""
        return access.stream == stream or self.syncs.is_ordered_after(stream, access.seq_num, access.stream)

    def launch(self, stream: int, read: set, written: set, operator: str) -> list[Race]:
        """A kernel on ``stream`` reads ``read`` and writes ``written`` (storage keys): the races it makes."""
        self.seq_num += 1
        self.syncs.update_seq_num(stream, self.seq_num)
        stack = cheap_stack(3)
        races = []
        for key in read:
            accessed = self.by_key.setdefault(key, _Accessed())
            now = Access(READ, self.seq_num, stream, operator, stack)
            if accessed.write is not None and not self.ordered(stream, accessed.write):
                races.append(Race(now, accessed.write))
            accessed.reads.append(now)
        for key in written:
            accessed = self.by_key.setdefault(key, _Accessed())
            now = Access(WRITE, self.seq_num, stream, operator, stack)
            for before in accessed.reads or [accessed.write]:
                if before is not None and not self.ordered(stream, before):
                    races.append(Race(now, before))
            accessed.write, accessed.reads = now, []
        return races


_ROLES: dict = {}  # operator → (role of each argument, whether its results are written)


def _roles(func) -> tuple[tuple, bool]:
    known = _ROLES.get(func)
    if known is None:
        schema = torch_adapter.op_schema(func)
        factory = bool(FACTORY.match(schema.name))
        if func.namespace == "c10d":  # no alias marks: by name (see the module docstring)
            roles = tuple(
                (
                    a.name,
                    "write"
                    if a.name.startswith("output") or (a.name == "tensors" and schema.name != "c10d::send")
                    else "read",
                )
                for a in schema.arguments
            )
            known = (roles, False)
        else:
            roles = tuple(
                (
                    a.name,
                    "write"
                    if a.alias_info is not None and a.alias_info.is_write
                    else "read"
                    if a.alias_info is None and not factory
                    else "none",
                )
                for a in schema.arguments
            )
            written = not factory and all(r.alias_info is None or r.alias_info.is_write for r in schema.returns)
            known = (roles, written)
        _ROLES[func] = known
    return known


def schema_writes(func, tensor: torch.Tensor, args) -> bool:
    """Whether ``func`` writes ``tensor`` (a mutable argument of its schema)."""
    for argument, value in zip(torch_adapter.op_schema(func).arguments, args):
        if value is tensor and argument.alias_info is not None and argument.alias_info.is_write:
            return True
    return False


def accesses_of(func, args: tuple, kwargs: dict, outputs) -> tuple[list, list]:
    """(tensors read, tensors written) by one ATen or ``c10d`` operator (see the module docstring)."""
    roles, results_written = _roles(func)
    read, written = [], []
    for position, (name, role) in enumerate(roles):
        if role == "none":
            continue
        value = args[position] if position < len(args) else kwargs.get(name)
        tensors = tensors_in(value)
        if tensors:
            (written if role == "write" else read).extend(tensors)
    if results_written:
        written += tensors_in(outputs)
    return read, written
