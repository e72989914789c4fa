"""The device→host reads of a piece of code, counted: on a GPU each makes the host wait for the
device, so what a step reads is counted where it cannot be timed. `counted_host_reads` counts the
library's own reads (`edgc.device.timing.to_host`); `CountHostReads` every Python-level read of a
tensor's value (``.item()``, ``bool(t)``, …), wherever it is made."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator

import torch
from torch.overrides import TorchFunctionMode

# The tensor methods that hand a value to Python, each a device→host read on a GPU.
HOST_READS = ("item", "tolist", "__bool__", "__float__", "__int__", "__index__")


class HostReads:
    reads = 0


@contextlib.contextmanager
def counted_host_reads(answer: Callable[[torch.Tensor], list] | None = None) -> Iterator[HostReads]:
    """Counts calls of `edgc.device.timing.to_host`, the library's device→host reads, in ``.reads``;
    ``answer`` replaces the read itself (a fake tensor has no values to read)."""
    import edgc.device.timing

    real, counter = edgc.device.timing.to_host, HostReads()

    def counting(tensor: torch.Tensor) -> list:
        counter.reads += 1
        return (answer or real)(tensor)

    edgc.device.timing.to_host = counting
    try:
        yield counter
    finally:
        edgc.device.timing.to_host = real


class CountHostReads(TorchFunctionMode):
    """Counts every Python-level read of a tensor value (the calls that synchronise a GPU) in ``.reads``."""

    def __init__(self):
        super().__init__()
        self.reads = 0

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if getattr(func, "__name__", "") in HOST_READS:
            self.reads += 1
        return func(*args, **(kwargs or {}))
