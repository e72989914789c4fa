"""Device memory a piece of code keeps alive, counted on the CPU by the storages it creates.

    with FakeTensorMode():
        gradients = ...                       # allocated before: not counted
        with LiveStorages() as live:
            state = ...; step(); live.reset_peak(); step()
        live.peak_bytes                       # the most bytes alive at once during the last step

How: a `TorchDispatchMode` sees every ATen operator's outputs. An output whose storage is none of
its inputs' storages is a new allocation (a factory, a ``cat``, a product without ``out=``); its
storage is remembered by a weak reference (`torch.multiprocessing.reductions.StorageWeakRef`, which
works on fake tensors too) with its size. After every operator the storages still referenced are
summed: what a caching allocator would have to hold at that point, rounding and fragmentation
aside. Storages made before the mode was entered (parameters, gradients) are never counted, nor are
views, in-place and ``out=`` results, which live in their inputs' storages.
"""

from __future__ import annotations

from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils._python_dispatch import TorchDispatchMode

from .op_traffic import tensors_in


class LiveStorages(TorchDispatchMode):
    """Tracks the storages created while it is active (see the module docstring)."""

    def __init__(self):
        super().__init__()
        self._storages: dict[int, tuple[StorageWeakRef, int]] = {}  # cdata → (weak reference, bytes)
        self.peak_bytes = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        inputs = {StorageWeakRef(t.untyped_storage()).cdata for t in tensors_in((args, kwargs))}
        out = func(*args, **kwargs)
        for tensor in tensors_in(out):
            storage = tensor.untyped_storage()
            reference = StorageWeakRef(storage)
            known = self._storages.get(reference.cdata)
            if reference.cdata not in inputs and (known is None or known[0].expired()):  # an address reused
                self._storages[reference.cdata] = (reference, storage.nbytes())
        self.peak_bytes = max(self.peak_bytes, self.live_bytes())
        return out

    def live_bytes(self) -> int:
        """Bytes of the tracked storages still alive (expired ones are forgotten)."""
        expired = [key for key, (reference, _) in self._storages.items() if reference.expired()]
        for key in expired:
            del self._storages[key]
        return sum(size for _, size in self._storages.values())

    def reset_peak(self) -> None:
        """Start a new peak from what is alive now."""
        self.peak_bytes = self.live_bytes()
