"""What the stream checker (`edgc_probes.stream_check`) makes of tensors made, moved and read by
Python-level calls, which a dispatch mode sees only as the kernels they run, if any.

Factories class what they make: with ``device=`` (or in ``checker.device()``) a device tensor, with
``pin_memory=True`` a pinned host buffer (a CPU build has no pinned allocator: the flag is taken
off), else a host tensor; ``torch.tensor``/``torch.as_tensor`` of host data with ``device=`` is a
copy from pageable memory (the host waits); ``torch.load`` makes host tensors. ``.to(device)`` of a
host tensor is a host-to-device copy (a new tensor; the host waits unless it is non-blocking);
``.pin_memory()`` makes a pinned copy; ``.cpu()``, ``tolist`` and ``numpy`` of a device tensor make
the host wait (of a pinned buffer: the host reads it, which must follow its copies);
``UntypedStorage.resize_`` onto new memory (FSDP2's unsharded parameters) makes a storage anew.
Set-up code and torch's helpers that wait for their collectives in C++ (DDP's constructor, its
bucket rebuild) run with their collectives waited for at once.
"""

from __future__ import annotations

import contextlib
import threading

import torch
import torch.distributed as dist

from .stream_check_memory import DEVICE, HOST, PINNED

FACTORIES = (
    "zeros",
    "ones",
    "empty",
    "full",
    "randn",
    "rand",
    "randint",
    "randperm",
    "arange",
    "range",
    "linspace",
    "logspace",
    "eye",
    "empty_strided",
    "scalar_tensor",
    "tril_indices",
    "triu_indices",
)
# torch's helpers that issue collectives and wait for them in C++ (DDP's set-up, its bucket rebuild)
WAIT_INLINE = (
    (dist, "_broadcast_coalesced"),
    (dist, "_verify_params_across_processes"),
    (torch._C._distributed_c10d.Reducer, "_rebuild_buckets"),
)


class Moves:
    """The patches of tensors made, moved and read, for ``checker``."""

    def __init__(self, checker):
        self.checker = checker
        self._local = threading.local()  # .kind: of what a factory makes; .building, .inline: set-up code

    def install(self, set_) -> None:
        for name in FACTORIES:
            set_(torch, name, self._factory)
        set_(torch, "tensor", self._from_data)
        set_(torch, "as_tensor", self._from_data)
        set_(torch, "load", self._load)
        set_(torch.UntypedStorage, "resize_", self._storage_resize)
        set_(torch.Tensor, "to", self._to)
        set_(torch.Tensor, "cpu", self._cpu)
        set_(torch.Tensor, "pin_memory", self._pin_memory)
        set_(torch.Tensor, "is_pinned", self._is_pinned)
        set_(torch.Tensor, "tolist", lambda original: self._read("tolist", original))
        set_(torch.Tensor, "numpy", lambda original: self._read("numpy", original))
        for owner, helper in WAIT_INLINE:
            set_(owner, helper, self._waiting_inline)

    def _watching(self) -> bool:
        return self.checker.watching()

    # ------------------------------------------------------------------ tensors made
    @contextlib.contextmanager
    def building(self):
        """Factories without ``device=`` make device tensors in the body (`StreamChecker.device`)."""
        before = getattr(self._local, "building", False)
        self._local.building = True
        try:
            yield
        finally:
            self._local.building = before

    def waits_inline(self) -> bool:
        """Whether a collective issued now is waited for at once by its issuer (set-up code, and torch's
        helpers that wait for their collectives in C++, out of the checker's sight)."""
        return getattr(self._local, "building", False) or getattr(self._local, "inline", False)

    def _waiting_inline(self, original):
        def helper(*args, **kwargs):
            before = getattr(self._local, "inline", False)
            self._local.inline = True
            try:
                return original(*args, **kwargs)
            finally:
                self._local.inline = before

        return helper

    def factory_kind(self, default: str | None = DEVICE) -> str | None:
        """What a storage made now without inputs is: the Python-level call's class (a factory, a load)
        in one, else ``default`` (C++ code allocating on its own: on the device)."""
        return getattr(self._local, "kind", None) or default

    @contextlib.contextmanager
    def making(self, kind: str):
        before = getattr(self._local, "kind", None)
        self._local.kind = kind
        try:
            yield
        finally:
            self._local.kind = before

    def _factory(self, original):
        def factory(*args, **kwargs):
            if not self._watching():
                return original(*args, **kwargs)
            explicit = kwargs.get("device") is not None or getattr(self._local, "building", False)
            kind = PINNED if kwargs.pop("pin_memory", False) else DEVICE if explicit else HOST
            with self.making(kind):
                return original(*args, **kwargs)

        return factory

    def _from_data(self, original):
        def from_data(data, *args, **kwargs):
            device = kwargs.get("device", args[1] if len(args) > 1 else None)
            checker = self.checker
            if not self._watching() or (isinstance(data, torch.Tensor) and device is None):
                return original(data, *args, **kwargs)
            if device is None:
                with self.making(HOST):
                    return original(data, *args, **kwargs)
            if isinstance(data, torch.Tensor) and checker.is_device(data):
                return original(data, *args, **kwargs)
            what = "a host tensor" if isinstance(data, torch.Tensor) else "host data"
            checker.host_sync(f"torch.{original.__name__} of {what} with device=")
            with self.making(HOST):
                result = original(data, *args, **kwargs)
            if isinstance(data, torch.Tensor) and _same_memory(result, data):
                result = result.clone()
            return self._on_device(result, f"torch.{original.__name__}")

        return from_data

    def _load(self, original):
        def load(*args, **kwargs):
            if not self._watching():
                return original(*args, **kwargs)
            with self.making(HOST):  # a checkpoint's tensors are on the host, in pageable memory
                return original(*args, **kwargs)

        return load

    def _on_device(self, tensor: torch.Tensor, how: str) -> torch.Tensor:
        """``tensor`` is a device tensor, just written on the current stream by a copy from the host."""
        checker = self.checker
        checker.made(tensor, DEVICE)
        checker.access(tensor, checker.current(), write=True, what=how)
        return tensor

    def _storage_resize(self, original):
        def resize_(storage, size):
            if not self._watching():
                return original(storage, size)
            checker = self.checker
            with checker.lock:
                known = checker.memory.at(storage.data_ptr())
            result = original(storage, size)
            if storage.data_ptr():  # FSDP2 gives an unsharded parameter its memory back: new memory
                with checker.lock:
                    checker.memory.made(storage, checker.current(), known.kind if known is not None else DEVICE)
            return result

        return resize_

    # ------------------------------------------------------------------ tensors moved and read
    def _to(self, original):
        def to(tensor, *args, **kwargs):
            checker = self.checker
            if not self._watching() or checker.is_device(tensor):
                return original(tensor, *args, **kwargs)
            moved = {key: value for key, value in kwargs.items() if key != "copy"}  # not _parse_to's
            device, _, non_blocking, _ = torch._C._nn._parse_to(*args, **moved)
            if device is None:
                return original(tensor, *args, **kwargs)
            if not non_blocking:
                checker.host_sync("blocking .to(device) of a host tensor")
            elif checker.kind_of(tensor) == PINNED:  # the copy reads the pinned buffer on the stream
                checker.access(tensor, checker.current(), write=False, what="host-to-device copy")
            with self.making(HOST):
                result = original(tensor, *args, **kwargs)
            if _same_memory(result, tensor):
                result = result.clone()  # a host-to-device copy makes a new tensor
            return self._on_device(result, "host-to-device copy")

        return to

    def _cpu(self, original):
        def cpu(tensor, *args, **kwargs):
            checker = self.checker
            if not self._watching() or not checker.is_device(tensor):
                return original(tensor, *args, **kwargs)
            checker.host_sync(".cpu()", tensor)
            with self.making(HOST):
                result = original(tensor, *args, **kwargs).clone()  # the host's own copy
            checker.made(result, HOST)
            return result

        return cpu

    def _pin_memory(self, original):
        def pin_memory(tensor, *args, **kwargs):
            if not self._watching() or self.checker.is_device(tensor):
                return tensor if self._watching() else original(tensor, *args, **kwargs)
            with self.making(PINNED):
                result = tensor.clone()
            self.checker.made(result, PINNED)
            return result

        return pin_memory

    def _is_pinned(self, original):
        def is_pinned(tensor, *args, **kwargs):
            if self._watching() and self.checker.kind_of(tensor) == PINNED:
                return True
            return original(tensor, *args, **kwargs)

        return is_pinned

    def _read(self, kind: str, original):
        def read(tensor, *args, **kwargs):
            if self._watching():
                if self.checker.is_device(tensor):
                    self.checker.host_sync(kind, tensor)
                else:
                    self.checker.host_touches(tensor, False, kind)
            return original(tensor, *args, **kwargs)

        return read


def _same_memory(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.untyped_storage().data_ptr() == b.untyped_storage().data_ptr()
