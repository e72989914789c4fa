"""The library's device→host reads (`edgc.device.timing.to_host`), counted: on a GPU each makes the
host wait for the device, so what a step reads is counted where it cannot be timed."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator

import torch


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
