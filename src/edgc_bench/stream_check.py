"""A stream-race checker and host-synchronisation counter that run on the CPU.

    with StreamChecker() as checker:
        ... training steps (one thread: the checker's) ...
    assert not checker.races, checker.report()
    assert not checker.host_syncs, checker.report()

What it models is CUDA's, run on CPU tensors. The streams are `torch.cpu`'s stand-ins, which the
library (`edgc.streams`) and FSDP2 use where CUDA code uses ``torch.cuda``: the checker gives each
one an identity (the default one is the compute stream), makes ``torch.cpu.stream(s)`` and the
current stream per thread, and records every ``wait_stream``, event record, event wait, host wait
on an event and ``record_stream``. Each ATen operator is a kernel on the current stream that reads
and writes the tensors its schema says (`torch.cuda._sanitizer`'s ``ArgumentHandler``), and the
sanitizer's ``EventHandler`` reports two accesses to one tensor's memory, one a write, on streams
with no wait between them. Memory is a storage (two views of one buffer are one tensor here).
Collectives (``c10d`` ops) run as NCCL runs them: on a collectives stream that waits for the
issuing stream; ``Work.wait`` makes the current stream wait for it.

Freed memory, which the CUDA sanitizer does not check: the caching allocator gives a block back
to the stream it was allocated on, which may reuse it at once. So when a storage dies, every
access to it on another stream must be ordered before that stream's present position, or before
the present position of a stream it was ``record_stream``-ed on. A storage never seen allocated
(made before the checker) belongs to the compute stream.

Device and host. The code under test runs on CPU tensors that stand for device tensors, next to
CPU tensors that stay on the host. A tensor is a device tensor if it was made before the checker,
by a factory called with an explicit ``device=`` (``torch.zeros(n, device=d)``), by an operator
with a device tensor among its inputs, or by ``.to(device)`` of a host tensor (which returns a copy
here, as a host-to-device copy does); a factory without ``device=`` makes a host tensor, as does
``.cpu()`` of a device tensor. Host tensors are off every stream.

Host synchronisations: what would make the host wait for the device on CUDA, outside
`edgc.timing.host_reads_allowed`, from a frame of the library (`edgc`): a value read (``item``,
``bool``, ``float``, ``tolist``, ``.cpu()``, ``numpy``), an operator whose output size depends
on values (``nonzero``, boolean-mask indexing, ``unique``, ``equal``, ...), a blocking
device↔host ``copy_`` or ``.to(device)``, and ``torch.tensor``/``torch.as_tensor`` of host data
with a ``device=`` (a copy from pageable memory). Inside ``host_reads_allowed`` they are not
counted, but they still order the streams as the wait would.
"""

from __future__ import annotations

import os
import threading
import traceback
from dataclasses import dataclass, field

import torch
import torch.cuda._sanitizer as sanitizer
from torch._subclasses.fake_tensor import FakeTensor
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils import _pytree as pytree
from torch.utils._python_dispatch import TorchDispatchMode, is_traceable_wrapper_subclass

import edgc
from edgc import timing

from .stream_check_patches import Patches, _Operator

aten = torch.ops.aten
COMPUTE = sanitizer.DEFAULT_STREAM_ID
EDGC_DIR = os.path.dirname(edgc.__file__) + os.sep
# Frames that are the checker's own or torch's dispatch machinery, never where an access comes from.
CHECKER_FILES = (
    os.path.splitext(__file__)[0],
    os.path.dirname(torch.__file__) + os.sep + "utils" + os.sep,
    os.path.join(os.path.dirname(torch.__file__), "_ops.py"),
    os.path.splitext(sanitizer.__file__)[0],
)
# Operators whose output size depends on values: on CUDA the host waits for the stream.
VALUE_SIZED = frozenset(
    {
        aten._local_scalar_dense,
        aten.nonzero,
        aten.masked_select,
        aten._unique2,
        aten.unique_dim,
        aten.unique_consecutive,
        aten.equal,
        aten.bincount,
        aten.is_nonzero,
    }
)
BOOL_INDEXED = frozenset({aten.index, aten.index_put, aten.index_put_, aten._index_put_impl_})


@dataclass
class HostSync:
    """One host synchronisation outside `host_reads_allowed`: what, and the library frame that did it."""

    kind: str
    where: str

    def __str__(self) -> str:
        return f"{self.kind} at {self.where}"


@dataclass
class _Storage:
    stream: int  # the stream it was allocated on
    device: bool
    ref: StorageWeakRef
    pointer: int  # where its memory was (FSDP2 frees and reallocates a live storage with resize_)
    recorded: set = field(default_factory=set)  # streams it was record_stream-ed on

    def gone(self) -> bool:
        """Whether its memory was given back: the storage died, or was resized away from it."""
        return self.ref.expired() or torch.UntypedStorage._new_with_weak_ptr(self.ref.cdata).data_ptr() != self.pointer


def library_frame(stack: traceback.StackSummary | None = None, library: str = EDGC_DIR) -> str | None:
    """The innermost frame under ``library`` (a folder), as ``file:line (function)``; None if none."""
    frames = stack if stack is not None else traceback.extract_stack()
    for frame in reversed(frames):
        if frame.filename.startswith(library):
            where = os.path.relpath(frame.filename, os.path.dirname(library.rstrip(os.sep)))
            return f"{where}:{frame.lineno} ({frame.name})"
    return None


class StreamChecker(TorchDispatchMode):
    """See the module docstring; ``races`` and ``host_syncs`` collect what it finds."""

    def __init__(self, library: str = EDGC_DIR):
        """``library``: the folder whose host synchronisations count (default: the ``edgc`` package)."""
        super().__init__()
        self.library = os.path.join(os.path.abspath(library), "")
        self.events = sanitizer.EventHandler()
        self.syncs = self.events.syncs
        self.races: list[str] = []
        self.host_syncs: list[HostSync] = []
        self._storages: dict[int, _Storage] = {}
        self._at_risk: dict[int, _Storage] = {}  # storages used off their own stream, by key
        self._streams: dict[int, tuple[object, int, str]] = {}  # id(stream) → (stream, id, label)
        self._labels = {COMPUTE: "compute"}
        self.collectives = self._new_stream_id("collectives")
        self._thread = threading.get_ident()
        self._patches = Patches(self)

    # ------------------------------------------------------------------ entering
    def __enter__(self):
        self._patches.install()
        return super().__enter__()

    def __exit__(self, *exc):
        try:
            return super().__exit__(*exc)
        finally:
            self._patches.remove()
            self._poll()

    def _where(self, stack) -> str:
        """The library's innermost frame, else the innermost one that is not the checker's or torch's dispatch."""
        where = library_frame(stack, self.library)
        if where is None:
            outside = [f for f in stack if not f.filename.startswith(CHECKER_FILES)]
            where = (
                f"{os.path.basename(outside[-1].filename)}:{outside[-1].lineno} ({outside[-1].name})"
                if outside
                else "?"
            )
        return where

    def report(self) -> str:
        lines = [
            f"{len(self.races)} stream race(s):",
            *self.races[:5],
            f"{len(self.host_syncs)} host synchronisation(s):",
            *map(str, self.host_syncs[:10]),
        ]
        return "\n".join(lines)

    def on_this_thread(self) -> bool:
        return threading.get_ident() == self._thread

    # ------------------------------------------------------------------ streams
    def _new_stream_id(self, label: str) -> int:
        stream_id = len(self._labels) + 1
        self._labels[stream_id] = label
        self.events._handle_stream_creation(stream_id)
        return stream_id

    def stream_id(self, stream, label: str | None = None) -> int:
        if stream is None or stream is torch.cpu._default_cpu_stream:
            return COMPUTE
        known = self._streams.get(id(stream))
        if known is None:
            known = self._streams[id(stream)] = (stream, self._new_stream_id(label or "a stream"), label)
        return known[1]

    def current(self) -> int:
        return self.stream_id(torch.cpu.current_stream())

    def state_of(self, stream_id: int) -> dict:
        """What ``stream_id``'s work so far is ordered after ({stream: sequence number})."""
        self.syncs._ensure_stream_exists(stream_id)
        return dict(self.syncs.current_sync_states[stream_id])

    def wait(self, stream_id: int, state: dict) -> None:
        """``stream_id`` waits for what ``state`` was recorded from."""
        self.syncs._ensure_stream_exists(stream_id)
        self.syncs._state_wait_for_other(self.syncs.current_sync_states[stream_id], state)

    def host_waits(self, state: dict) -> None:
        """The host waited for ``state``: all work queued after this is ordered after it."""
        for stream_state in self.syncs.current_sync_states.values():
            self.syncs._state_wait_for_other(stream_state, state)
        self.syncs._state_wait_for_other(self.syncs.host_sync_state, state)

    # ------------------------------------------------------------------ storages
    @staticmethod
    def _key(tensor: torch.Tensor) -> int | None:
        if not isinstance(tensor, torch.Tensor) or tensor.device.type != "cpu" or isinstance(tensor, FakeTensor):
            return None
        pointer = tensor.untyped_storage().data_ptr()
        return pointer or None  # an empty storage holds nothing to race on

    def _storage(self, tensor: torch.Tensor, *, new_on: int | None = None, device: bool = True) -> _Storage | None:
        """The record of ``tensor``'s storage; a storage not seen before is made now on stream ``new_on``
        (None: before the checker, on the compute stream, a device tensor)."""
        key = self._key(tensor)
        if key is None:
            return None
        info = self._storages.get(key)
        if info is not None and info.gone():  # the address was freed and reused
            self._freed(key)
            info = None
        if info is None:
            stream = COMPUTE if new_on is None else new_on
            info = self._storages[key] = _Storage(stream, device, StorageWeakRef(tensor.untyped_storage()), key)
            self.events.tensors_accessed.ensure_tensor_does_not_exist(key)
            self.events.tensors_accessed.create_tensor(key, None)
        return info

    def is_device(self, tensor: torch.Tensor) -> bool:
        info = self._storage(tensor)
        return info is not None and info.device

    def mark(self, tensor: torch.Tensor, device: bool) -> None:
        info = self._storage(tensor, new_on=self.current(), device=device)
        if info is not None:
            info.device = device

    def record_stream(self, tensor: torch.Tensor, stream) -> None:
        info = self._storage(tensor)
        if info is not None:
            info.recorded.add(self.stream_id(stream))

    def _poll(self) -> None:
        """Check the storages used off their own stream that have died since the last look."""
        for key in [k for k, info in self._at_risk.items() if info.gone()]:
            self._freed(key)

    def _freed(self, key: int) -> None:
        info = self._storages.pop(key)
        self._at_risk.pop(key, None)
        accessed = self.events.tensors_accessed.accesses.pop(key, None)
        if not info.device or accessed is None:
            return
        holders = {info.stream, *info.recorded}
        for access in [a for a in (accessed.write, *accessed.reads) if a is not None]:
            if access.stream in holders or any(
                self.syncs.is_ordered_after(h, access.seq_num, access.stream) for h in holders
            ):
                continue
            self.races.append(
                f"memory allocated on {self._labels[info.stream]} was freed while {self._labels[access.stream]} "
                f"may still be {access.type} it ({access.operator.name}, at {self._where(access.stack_trace)}); "
                f"no record_stream on {self._labels[access.stream]} and no wait for it"
            )

    # ------------------------------------------------------------------ kernels
    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        inputs = [t for t in pytree.tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)]
        if any(is_traceable_wrapper_subclass(t) for t in inputs):
            return NotImplemented  # a DTensor: its own dispatch runs the kernels on its local tensors, seen here
        self._poll()
        device = any(self.is_device(t) for t in inputs)
        stream = self.collectives if func.namespace == "c10d" else self.current()
        if func.namespace == "c10d":
            self.wait(self.collectives, self.state_of(self.current()))  # NCCL: its stream waits for the issuer
        if device:
            self._host_syncs_of(func, args, kwargs)
        outputs = func(*args, **kwargs)
        for tensor in pytree.tree_leaves(outputs):
            if isinstance(tensor, torch.Tensor):
                self._storage(tensor, new_on=stream, device=device)
        self._launch(func, args, kwargs, outputs, stream, device)
        return outputs

    def _launch(self, func, args, kwargs, outputs, stream: int, device: bool) -> None:
        handler = _DeviceArguments(self, device)
        is_factory = bool(sanitizer.FACTORY_FUNCTION_REGEX.match(func._schema.name))
        handler.parse_inputs(func._schema, args, kwargs, is_factory=is_factory)
        handler.parse_outputs(func._schema, outputs, is_factory=is_factory)
        touched = handler.dataptrs_read | handler.dataptrs_written
        if not touched:
            return
        errors = self.events._handle_kernel_launch(
            stream,
            handler.dataptrs_read - handler.dataptrs_written,
            handler.dataptrs_written,
            handler.outputs,
            func._schema,
            handler.tensor_aliases,
        )
        for key in touched:
            info = self._storages.get(key)
            if info is not None and stream != info.stream:
                self._at_risk[key] = info
        for error in errors:
            self.races.append(self._describe(error))

    def _describe(self, error: sanitizer.UnsynchronizedAccessError) -> str:
        now, before = error.current_access, error.previous_access
        return (
            f"{now.operator.name} on {self._labels[now.stream]} ({self._where(now.stack_trace)}) "
            f"{now.type} memory that {before.operator.name} on {self._labels[before.stream]} "
            f"({self._where(before.stack_trace)}) was {before.type}, with no wait between them"
        )

    # ------------------------------------------------------------------ host synchronisations
    def _host_syncs_of(self, func, args, kwargs) -> None:
        packet = func.overloadpacket
        if packet in VALUE_SIZED:
            self.host_sync(packet.__name__, args[0])
        elif packet in BOOL_INDEXED and any(
            isinstance(i, torch.Tensor) and i.dtype == torch.bool for i in pytree.tree_leaves(args[1])
        ):
            self.host_sync(f"{packet.__name__} with a boolean mask", args[0])
        elif packet is aten.copy_ and not (args[2] if len(args) > 2 else kwargs.get("non_blocking", False)):
            destination, source = self.is_device(args[0]), self.is_device(args[1])
            if destination != source:
                self.host_sync(
                    "blocking copy_ " + ("host → device" if destination else "device → host"),
                    args[1] if source else args[0],
                )

    def host_sync(self, kind: str, tensor: torch.Tensor | None = None) -> None:
        """The host waits for the current stream, after a copy or read of ``tensor`` on it."""
        current = self.current()
        if tensor is not None and self.is_device(tensor):
            key = self._key(tensor)
            self.events._handle_kernel_launch(current, {key}, set(), set(), _Operator(kind), {key: []})
        self.host_waits(self.state_of(current))
        self.note_host_sync(kind)

    def note_host_sync(self, kind: str) -> None:
        """Count a host synchronisation made by the library outside `host_reads_allowed`."""
        if timing.host_reads_are_allowed():
            return
        where = library_frame(library=self.library)
        if where is not None:
            self.host_syncs.append(HostSync(kind, where))


class _DeviceArguments(sanitizer.ArgumentHandler):
    """The sanitizer's schema reading, for the CPU tensors that stand for device tensors (by storage)."""

    def __init__(self, checker: StreamChecker, device_op: bool):
        super().__init__()
        self._checker, self._device_op = checker, device_op

    def _handle_argument(self, value, is_write, metadata_only, name=None, is_output=False):
        if not isinstance(value, torch.Tensor):
            return
        checker = self._checker
        if is_write and self._device_op:
            checker.mark(value, True)  # written from device tensors: a device tensor
        key = checker._key(value)
        if key is None or not checker.is_device(value):
            return
        if is_write:
            self.dataptrs_written.add(key)
        elif not metadata_only:
            self.dataptrs_read.add(key)
        self.tensor_aliases.setdefault(key, [])
        if name is not None:
            self.tensor_aliases[key].append(name)
        if is_output:
            self.outputs.add(key)
