"""Device memory a piece of code keeps alive, counted on the CPU by the storages it creates.

    with FakeTensorMode():
        gradients = ...                       # allocated before: not counted
        with LiveStorages() as live:
            state = ...; step(); live.reset_peak(); step()
        live.peak_bytes                       # the most bytes alive at once during the last step

How: a `TorchDispatchMode` sees every ATen operator's outputs. An output whose storage is none of
its inputs' storages is a new allocation (a factory, a ``cat``, a product without ``out=``): its
size joins a running total of the bytes alive, and a weak reference to its storage (a Python weak
reference, which fake tensors' storages take too: torch keeps one Python object per storage while
it lives) takes the size back off when the storage is freed. After every operator the total is the
peak's candidate: what a caching allocator would have to hold at that point, rounding and
fragmentation aside. Storages made before the mode was entered (parameters, gradients) are never
counted, nor are views, in-place and ``out=`` results, which live in their inputs' storages.
"""

from __future__ import annotations

import weakref

from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils._python_dispatch import TorchDispatchMode

from .op_traffic import tensors_in


class LiveStorages(TorchDispatchMode):
    """Tracks the storages created while it is active (see the module docstring)."""

    def __init__(self):
        super().__init__()
        # storage's address (cdata) → (weak reference whose callback forgets it, bytes)
        self._storages: dict[int, tuple[weakref.ref, int]] = {}
        self._live_bytes = 0
        self.peak_bytes = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        inputs = {StorageWeakRef(t.untyped_storage()).cdata for t in tensors_in((args, kwargs))}
        out = func(*args, **kwargs)
        for tensor in tensors_in(out):
            storage = tensor.untyped_storage()
            address = StorageWeakRef(storage).cdata
            if address not in inputs and address not in self._storages:  # a freed address is forgotten
                size = storage.nbytes()
                self._storages[address] = (weakref.ref(storage, self._forget(address)), size)
                self._live_bytes += size
        self.peak_bytes = max(self.peak_bytes, self._live_bytes)
        return out

    def _forget(self, address: int):
        """The callback that takes a freed storage's bytes off the total (the tracker held weakly, so
        that a storage outliving it keeps nothing alive)."""
        tracker = weakref.ref(self)

        def forget(reference: weakref.ref) -> None:
            live = tracker()
            entry = live and live._storages.get(address)
            if entry and entry[0] is reference:
                del live._storages[address]
                live._live_bytes -= entry[1]

        return forget

    def live_bytes(self) -> int:
        """Bytes of the tracked storages still alive."""
        return self._live_bytes

    def reset_peak(self) -> None:
        """Start a new peak from what is alive now."""
        self.peak_bytes = self._live_bytes
