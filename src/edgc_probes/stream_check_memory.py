"""Where each storage came from and what its free means, for `edgc_probes.stream_check`.

A storage is known by the address of its memory and classed once, where it is made (the module
docstring of `edgc_probes.stream_check` lists the ways): a device tensor on the stream it was
allocated on, a host tensor (off every stream), or a pinned host buffer (on the streams of the
copies that use it). One met for the first time as an operator's input came from somewhere the
checker could not see: that is a finding.

Frees. The caching allocator gives a freed block back to its allocation stream at once and, for
each stream it was ``record_stream``-ed on, records an event there at the free that a reuse waits
for. So at the free every access from another stream must be ordered before the allocation
stream's position then, or a recorded stream's: `judge_frees` is called before anything that
changes the streams' order (a kernel launch changes no verdict), so it judges as at the free.
Pinned host memory is exempt: its allocator records the copies' streams itself.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch._subclasses.fake_tensor import FakeTensor
from torch.multiprocessing.reductions import StorageWeakRef

DEVICE, HOST, PINNED = "device", "host", "pinned"


@dataclass
class Storage:
    stream: int  # the stream it was allocated on
    kind: str  # DEVICE, HOST or PINNED
    ref: StorageWeakRef
    pointer: int  # where its memory was (FSDP2 frees and reallocates a live storage with resize_)
    recorded: set = field(default_factory=set)  # streams it was record_stream-ed on

    def gone(self) -> bool:
        """Whether its memory was given back: the storage died, or was resized away from it."""
        return self.ref.expired() or torch.UntypedStorage._new_with_weak_ptr(self.ref.cdata).data_ptr() != self.pointer

    @property
    def on_streams(self) -> bool:
        return self.kind != HOST


def key_of(tensor) -> int | None:
    """The address of ``tensor``'s memory, or None where it has none to race on."""
    if not isinstance(tensor, torch.Tensor) or tensor.device.type != "cpu" or isinstance(tensor, FakeTensor):
        return None
    return tensor.untyped_storage().data_ptr() or None


class Memory:
    """The storages known to a checker (``checker``: for its accesses, streams' labels and findings)."""

    def __init__(self, checker):
        self.checker = checker
        self.storages: dict[int, Storage] = {}
        self._at_risk: dict[int, Storage] = {}  # storages used off their own stream, by key

    def new(self, key: int, storage: torch.UntypedStorage, stream: int, kind: str) -> Storage:
        self.checker.accesses.forget(key)
        info = self.storages[key] = Storage(stream, kind, StorageWeakRef(storage), key)
        return info

    def of(self, tensor, *, made_on: int | None = None, kind: str | None = None) -> Storage | None:
        """The record of ``tensor``'s storage. One not seen before is new (made now on stream ``made_on``,
        as ``kind``) or, without ``made_on``, of unknown origin: a finding, then taken as a device tensor."""
        key = key_of(tensor)
        if key is None:
            return None
        info = self.storages.get(key)
        if info is not None and info.gone():  # the address was freed and reused
            self.freed(key)
            info = None
        if info is None:
            checker = self.checker
            if made_on is None and (kind := checker.patches.factory_kind(default=None)) is not None:
                made_on = checker.current()  # made inside a Python-level call that classes what it makes
            elif made_on is None:
                checker.races.append(
                    f"a tensor of unknown origin ({tuple(tensor.shape)}, {tensor.dtype}), made before the "
                    f"checker or where it cannot see, used at {checker.here()}: declare it with adopt(), "
                    "or make it under the checker"
                )
            info = self.new(key, tensor.untyped_storage(), 0 if made_on is None else made_on, kind or DEVICE)
        return info

    def at(self, pointer: int) -> Storage | None:
        """The record of the live storage at ``pointer``, if any."""
        info = self.storages.get(pointer)
        return info if info is not None and not info.gone() else None

    def made(self, storage: torch.UntypedStorage, stream: int, kind: str) -> None:
        """``storage`` was just made on ``stream`` (or re-made: resized onto new memory), as ``kind``."""
        key = storage.data_ptr()
        info = self.storages.get(key)
        if info is not None and not info.gone():
            info.kind = kind  # made by a dispatch just now, classed here by the call that made it
            return
        if info is not None:
            self.freed(key)
        self.new(key, storage, stream, kind)

    def used_on(self, key: int, stream: int) -> None:
        info = self.storages.get(key)
        if info is not None and stream != info.stream:
            self._at_risk[key] = info

    def judge_frees(self) -> None:
        """Judge the storages used off their own stream that have died since the last look."""
        for key in [k for k, info in self._at_risk.items() if info.gone()]:
            if self.storages.get(key) is self._at_risk[key]:
                self.freed(key)
            else:
                self._at_risk.pop(key)

    def freed(self, key: int) -> None:
        info = self.storages.pop(key)
        self._at_risk.pop(key, None)
        accessed = self.checker.accesses.forget(key)
        if info.kind != DEVICE or accessed is None:
            return  # pinned host memory: its allocator records the copies' streams itself
        holders = {info.stream, *info.recorded}
        checker = self.checker
        for access in [a for a in (accessed.write, *accessed.reads) if a is not None]:
            if any(checker.accesses.ordered(holder, access) for holder in holders):
                continue
            checker.races.append(
                f"memory allocated on {checker.label(info.stream)} was freed while {checker.label(access.stream)} "
                f"may still be {access.type} it ({access.operator}, at {checker.where(access.stack_trace)}); "
                f"no record_stream on {checker.label(access.stream)} and no wait for it before the free"
            )

    def host_touches(self, tensor, write: bool, what: str) -> None:
        """The host reads (or writes) ``tensor`` now: a pinned buffer must be done with by the copies queued
        on it (ordered before the host by a wait), else the host reads a stale value (or overwrites one
        still being copied)."""
        info = self.of(tensor)
        if info is None or info.kind != PINNED:
            return
        checker = self.checker
        accessed = checker.accesses.by_key.get(key_of(tensor))
        if accessed is None:
            return
        host = checker.accesses.syncs.host_sync_state
        for access in [a for a in [accessed.write, *(accessed.reads if write else [])] if a is not None]:
            if access.seq_num <= host.get(access.stream, -1):
                continue
            checker.races.append(
                f"the host {'writes' if write else 'reads'} pinned memory ({what}, at {checker.here()}) that "
                f"{access.operator} on {checker.label(access.stream)} (at {checker.where(access.stack_trace)}) "
                f"may still be {access.type}: no event or stream synchronize orders the host after it"
            )
