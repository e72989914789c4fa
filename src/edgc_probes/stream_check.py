"""A stream-race checker and host-synchronisation counter that run on the CPU.

    with StreamChecker() as checker:
        with checker.device():                 # built here: made on the device
            model, optimizer = ...
        ... training steps (any threads) ...
    assert not checker.races, checker.report()
    assert not checker.host_syncs, checker.report()

What it models is CUDA's, run on CPU tensors. The streams are `torch.cpu`'s stand-ins, which the
library (`edgc.device.streams`) and FSDP2 use where CUDA code uses ``torch.cuda``: the checker gives each
one an identity (the default one is the compute stream), makes ``torch.cpu.stream(s)`` and the
current stream per thread (a new thread starts on the compute stream), and records every
``wait_stream``, event record, event wait, host wait (``Event``/``Stream.synchronize``,
``torch.cpu.synchronize``) and ``record_stream``. Each ATen operator is a kernel on the current
stream that reads and writes the tensors its schema says (`torch.cuda._sanitizer`'s
``ArgumentHandler``), and the sanitizer's ``EventHandler`` reports two accesses to one tensor's
memory, one a write, on streams with no wait between them. Memory is a storage (two views of one
buffer are one tensor here).

Every thread. A dispatch mode is thread-local: the checker enters it on every thread started,
every executor task submitted and every future callback registered from a thread it watches
(`edgc_probes.stream_check_threads`), and its state is guarded by one lock.

Collectives (``c10d`` ops, every kind: all-reduce, all-gather, all-to-all, broadcast, …) run as
NCCL runs them: on one collectives stream per process group, which waits for the issuing stream,
and which keeps their tensors alive (NCCL records them on it). Each work's end is an event of its
own: ``Work.wait`` (and ``wait`` of its future) makes the current stream wait for that work alone,
not for the ones issued after it.

Frees, which the CUDA sanitizer does not check: the caching allocator gives a block back to the
stream it was allocated on, which may reuse it at once, and records an event on every stream the
block was ``record_stream``-ed on, at the free. So when a storage dies, every access to it on
another stream must be ordered before the allocating stream's position at that moment, or before
a recorded stream's. The checker looks for dead storages before every operation that orders
streams, so a wait issued after the free comes too late, as on CUDA.

Provenance. The code under test runs on CPU tensors that stand for device tensors, next to CPU
tensors that stay on the host. Every storage is classed where it is made: by a factory called with
an explicit ``device=`` or inside ``checker.device()`` (a device tensor), without one (a host
tensor; ``pin_memory=True`` or ``.pin_memory()``: pinned host memory), by an operator from its
inputs (a device tensor if any input is one), by C++ code that allocates without Python (DDP's
buckets: on the device), by ``.to(device)`` of a host tensor (a copy, as a host-to-device copy),
by ``.cpu()`` or ``torch.load`` (host). Tensors made before the checker are declared with
``checker.adopt(...)``; one it meets without knowing where it came from is a finding, not a pass.
Host tensors are off every stream, except pinned ones written or read by a non-blocking copy:
the host may then touch them only after a wait that orders it after that copy (an event's or the
stream's ``synchronize``), else it reads a stale value.

Host synchronisations (`edgc_probes.stream_check_syncs`): what would make the host wait for the
device on CUDA, outside `edgc.device.timing.host_reads_allowed` and set-up code (``checker.device()``),
from a frame of the library (`edgc`). Where they are not counted, they still order the streams as
the wait would.

The parts: `edgc_probes.stream_check_access` (accesses and races), `edgc_probes.stream_check_memory`
(provenance and frees), `edgc_probes.stream_check_threads` (every thread),
`edgc_probes.stream_check_patches` and `edgc_probes.stream_check_moves` (what Python-level calls
do), `edgc_probes.stream_check_syncs` (host synchronisations).
"""

from __future__ import annotations

import contextlib
import os
import threading
import traceback

import torch
from torch.utils import _pytree as pytree
from torch.utils._python_dispatch import TorchDispatchMode, is_traceable_wrapper_subclass

import edgc
from edgc.adapters import torch_adapter
from edgc.device import timing

from .op_traffic import tensors_in
from .stream_check_access import Accesses, Race, accesses_of, schema_writes
from .stream_check_memory import DEVICE, HOST, PINNED, Memory, key_of
from .stream_check_patches import Patches
from .stream_check_syncs import HostSync, host_syncs_of
from .stream_check_threads import Threads

COMPUTE = 0
EDGC_DIR = os.path.dirname(edgc.__file__) + os.sep
TORCH_DIR = os.path.dirname(torch.__file__) + os.sep
# Frames that are the checker's own or torch's dispatch machinery, never where an access comes from.
CHECKER_FILES = (
    os.path.dirname(__file__) + os.sep + "stream_check",
    TORCH_DIR + "utils" + os.sep,
    TORCH_DIR + "_ops.py",
    TORCH_DIR + "_compile.py",
    TORCH_DIR + "_dynamo" + os.sep,
)
__all__ = ["StreamChecker", "HostSync", "library_frame", "DEVICE", "HOST", "PINNED"]


def library_frame(stack: list | None = None, library: str = EDGC_DIR) -> str | None:
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
        self.races: list[str] = []
        self.host_syncs: list[HostSync] = []
        self.lock = threading.RLock()
        self.active = False
        self.accesses = Accesses()
        self.memory = Memory(self)
        self._streams: dict[int, tuple[object, int]] = {}  # id(stream) → (stream, id)
        self._labels = {COMPUTE: "compute"}
        self.accesses.new_stream(COMPUTE)
        self._groups: dict[int, tuple[object, int]] = {}  # id(process group) → (group, its collectives stream)
        self.works: dict[int, tuple[object, dict]] = {}  # id(work) → (work, the state at its end)
        self.futures: dict[int, tuple[object, dict]] = {}  # id(future) → (future, {"state": at its end})
        self.threads = Threads(self)
        self.patches = Patches(self)

    # ------------------------------------------------------------------ entering
    def __enter__(self):
        self.active = True
        self.patches.install()
        super().__enter__()
        self.threads.entered()
        return self

    def __exit__(self, *exc):
        try:
            return super().__exit__(*exc)
        finally:
            self.threads.left()
            self.patches.remove()
            with self.lock:
                self.memory.judge_frees()
            self.active = False

    def watching(self) -> bool:
        """Whether the calling thread runs under this checker (the one that entered it, or one started from it)."""
        return self.active and self.threads.inside()

    @contextlib.contextmanager
    def device(self):
        """Tensors made in the body by factories without ``device=`` are device tensors (``with
        torch.device("cuda")`` on CUDA): a model, its DDP wrapper, an optimizer built here. Set-up code:
        its collectives are waited for as issued (DDP's constructor waits for its own in C++), and its
        host synchronisations are not counted."""
        with self.patches.building():
            yield

    def adopt(self, *things, kind: str = DEVICE) -> None:
        """Declare tensors made before the checker (in modules, optimizers, dicts, lists, or given
        directly) as made on the compute stream, as device tensors (or ``kind``: HOST, PINNED)."""
        with self.lock:
            for tensor in _tensors_of(things):
                key = key_of(tensor)
                if key is not None and key not in self.memory.storages:
                    self.memory.new(key, tensor.untyped_storage(), COMPUTE, kind)

    def where(self, stack) -> str:
        """The library's innermost frame, else the innermost one outside torch, else outside the checker."""
        where = library_frame(stack, self.library)
        if where is None:
            outside = [f for f in stack if not f.filename.startswith(CHECKER_FILES)]
            beyond_torch = [f for f in outside if not f.filename.startswith(TORCH_DIR)]
            frame = (beyond_torch or outside or [None])[-1]
            where = f"{os.path.basename(frame.filename)}:{frame.lineno} ({frame.name})" if frame else "?"
        return where

    def here(self) -> str:
        return self.where(traceback.extract_stack())

    def label(self, stream: int) -> str:
        return self._labels[stream]

    def report(self) -> str:
        lines = [
            f"{len(self.races)} stream race(s):",
            *self.races[:5],
            f"{len(self.host_syncs)} host synchronisation(s):",
            *map(str, self.host_syncs[:10]),
        ]
        return "\n".join(lines)

    # ------------------------------------------------------------------ streams
    def _new_stream_id(self, label: str) -> int:
        stream_id = len(self._labels)
        self._labels[stream_id] = label
        self.accesses.new_stream(stream_id)
        return stream_id

    def stream_id(self, stream, label: str | None = None) -> int:
        if stream is None or stream is torch.cpu._default_cpu_stream:
            return COMPUTE
        with self.lock:
            known = self._streams.get(id(stream))
            if known is None:
                known = self._streams[id(stream)] = (stream, self._new_stream_id(label or "a stream"))
            return known[1]

    def current(self) -> int:
        return self.stream_id(torch.cpu.current_stream())

    def collectives_of(self, group) -> int:
        """The collectives stream of a process group (one per group, as NCCL's communicators have)."""
        known = self._groups.get(id(group))
        if known is None:
            name = f"collectives {len(self._groups) + 1}" if self._groups else "collectives"
            known = self._groups[id(group)] = (group, self._new_stream_id(name))
        return known[1]

    def state_of(self, stream_id: int) -> dict:
        """What ``stream_id``'s work so far is ordered after ({stream: sequence number})."""
        return dict(self.accesses.syncs.current_sync_states[stream_id])

    def wait(self, stream_id: int, state: dict) -> None:
        """``stream_id`` waits for what ``state`` was recorded from (dead storages judged first)."""
        with self.lock:
            self.memory.judge_frees()
            syncs = self.accesses.syncs
            torch_adapter.sanitizer_wait(syncs, syncs.current_sync_states[stream_id], state)

    def host_waits(self, state: dict) -> None:
        """The host waited for ``state``: all work queued after this is ordered after it."""
        with self.lock:
            self.memory.judge_frees()
            syncs = self.accesses.syncs
            for stream_state in syncs.current_sync_states.values():
                torch_adapter.sanitizer_wait(syncs, stream_state, state)
            torch_adapter.sanitizer_wait(syncs, syncs.host_sync_state, state)

    def host_waits_for_all(self) -> None:
        with self.lock:
            for stream_id in list(self.accesses.syncs.current_sync_states):
                self.host_waits(self.state_of(stream_id))

    # ------------------------------------------------------------------ storages
    def kind_of(self, tensor: torch.Tensor) -> str | None:
        with self.lock:
            info = self.memory.of(tensor)
            return info.kind if info is not None else None

    def is_device(self, tensor: torch.Tensor) -> bool:
        return self.kind_of(tensor) == DEVICE

    def made(self, tensor: torch.Tensor, kind: str) -> None:
        """``tensor`` was just made (a new storage) on the current stream, as ``kind``."""
        if key_of(tensor) is not None:
            with self.lock:
                self.memory.made(tensor.untyped_storage(), self.current(), kind)

    def record_stream(self, tensor: torch.Tensor, stream) -> None:
        self.record_stream_id(tensor, self.stream_id(stream))

    def record_stream_id(self, tensor: torch.Tensor, stream_id: int) -> None:
        with self.lock:
            info = self.memory.of(tensor)
            if info is not None:
                info.recorded.add(stream_id)

    def host_touches(self, tensor: torch.Tensor, write: bool, what: str) -> None:
        with self.lock:
            self.memory.host_touches(tensor, write, what)

    # ------------------------------------------------------------------ kernels
    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if not self.watching():
            return func(*args, **kwargs)
        inputs = tensors_in(args) + tensors_in(kwargs)
        if any(is_traceable_wrapper_subclass(t) for t in inputs):
            return NotImplemented  # a DTensor: its own dispatch runs the kernels on its local tensors, seen here
        collective = func.namespace == "c10d"
        with self.lock:  # (dead storages are judged before the next wait: a launch changes no verdict)
            kinds = [self.kind_of(t) for t in inputs]
            stream = self.current()
            if collective:
                issuer, stream = stream, self.collectives_of(_group_in(args))
                self.wait(stream, self.state_of(issuer))  # NCCL: its stream waits for the issuer
            device = DEVICE in kinds
            syncs = host_syncs_of(self, func, args, kwargs) if device else []
            if not device and PINNED in kinds:
                for tensor in inputs:
                    self.memory.host_touches(tensor, schema_writes(func, tensor, args), func.overloadpacket.__name__)
        outputs = func(*args, **kwargs)
        with self.lock:
            made = self.patches.factory_kind() if not inputs else (DEVICE if device else HOST)
            for tensor in tensors_in(outputs):
                self.memory.of(tensor, made_on=stream, kind=made)
            if collective or device:
                self._launch(stream, *accesses_of(func, args, kwargs, outputs), func.overloadpacket.__name__)
            if collective:
                self._collective_issued(issuer, stream, inputs, outputs)
            for kind, tensor in syncs:
                self.host_sync(kind, tensor)
        return outputs

    def _collective_issued(self, issuer: int, stream: int, inputs: list, outputs) -> None:
        """NCCL keeps a collective's tensors alive for its stream; each work it returns completes at the
        collectives stream's present position (set-up code waits for it at once)."""
        for tensor in inputs:
            self.record_stream_id(tensor, stream)
        end = self.state_of(stream)
        for value in outputs if isinstance(outputs, (list, tuple)) else [outputs]:
            if isinstance(value, torch.ScriptObject) and "Work" in torch_adapter.script_type(value):
                work = torch.distributed.Work.unbox(value)
                self.works[id(work)] = (work, end)
        if self.patches.waits_inline():  # DDP's constructor and helpers wait for theirs in C++
            self.wait(issuer, end)

    def _launch(self, stream: int, read: list, written: list, operator: str) -> None:
        read_keys, written_keys = set(), set()
        for tensors, keys in ((read, read_keys), (written, written_keys)):
            for tensor in tensors:
                info = self.memory.of(tensor)
                if info is not None and info.on_streams:
                    keys.add(key_of(tensor))
        if read_keys or written_keys:
            self.launch(stream, read_keys - written_keys, written_keys, operator)

    def launch(self, stream: int, read: set, written: set, operator: str) -> None:
        """A kernel on ``stream`` that reads and writes these storages (by key)."""
        for key in read | written:
            self.memory.used_on(key, stream)
        for race in self.accesses.launch(stream, read, written, operator):
            self.races.append(self._describe(race))

    def access(self, tensor: torch.Tensor, stream: int, *, write: bool, what: str) -> None:
        """A kernel named ``what`` on ``stream`` reads (or writes) ``tensor``, if it lives on a stream."""
        with self.lock:
            info, key = self.memory.of(tensor), key_of(tensor)
            if info is not None and info.on_streams:
                self.launch(stream, set() if write else {key}, {key} if write else set(), what)

    def _describe(self, race: Race) -> str:
        now, before = race.now, race.before
        return (
            f"{now.operator} on {self.label(now.stream)} ({self.where(now.stack_trace)}) "
            f"{now.type} memory that {before.operator} on {self.label(before.stream)} "
            f"({self.where(before.stack_trace)}) was {before.type}, with no wait between them"
        )

    # ------------------------------------------------------------------ host synchronisations
    def host_sync(self, kind: str, tensor: torch.Tensor | None = None) -> None:
        """The host waits for the current stream, after a copy or read of ``tensor`` on it."""
        current = self.current()
        if tensor is not None:
            self.access(tensor, current, write=False, what=kind)
        self.host_waits(self.state_of(current))
        self.note_host_sync(kind)

    def note_host_sync(self, kind: str) -> None:
        """Count a host synchronisation made by the library outside `host_reads_allowed` (and outside
        set-up code: `device`)."""
        if timing.host_reads_are_allowed() or self.patches.waits_inline():
            return
        where = library_frame(library=self.library)
        if where is not None:
            with self.lock:
                self.host_syncs.append(HostSync(kind, where))


def _group_in(args) -> object | None:
    """The process group a ``c10d`` op is issued on (None: one it does not name)."""
    for value in pytree.tree_leaves(args):
        if isinstance(value, torch.ScriptObject) and "ProcessGroup" in torch_adapter.script_type(value):
            return torch.distributed.ProcessGroup.unbox(value)
    return None


def _tensors_of(things) -> list[torch.Tensor]:
    found: list[torch.Tensor] = []
    for thing in things:
        if isinstance(thing, torch.Tensor):
            found.append(thing)
        elif isinstance(thing, torch.nn.Module):
            found += [*thing.parameters(), *thing.buffers()]
            found += [p.grad for p in thing.parameters() if p.grad is not None]
        elif isinstance(thing, torch.optim.Optimizer):
            found += _tensors_of([thing.state_dict()["state"]])
        elif isinstance(thing, dict):
            found += _tensors_of(list(thing.values()))
        elif isinstance(thing, (list, tuple)):
            found += _tensors_of(list(thing))
    return found
