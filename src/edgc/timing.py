"""Device-timeline timestamps and the library's only device→host reads.

Hot-path code never synchronises the device: it takes ``Clock.stamp()`` (a CUDA event recorded on
the current stream, or ``perf_counter`` on CPU) and keeps device tensors. Once per optimizer step
the reducer turns stamps into seconds and reads its packed device values with ``to_host``; that
is the step's single host synchronisation. Tests count calls of ``synchronize`` and ``to_host``
(and of ``Tensor.item``/``__bool__``/…) to hold the hot path to this rule.

The places allowed to synchronise run inside ``host_reads_allowed()``: the end of a step and a
rank change (at most once per decision window). On CUDA that lifts
``torch.cuda.set_sync_debug_mode("error")`` for them alone, so a run under that mode fails at any
other synchronisation (tests/gpu). Host→device copies of CPU-made tensors go through ``to_device``
(pinned, non-blocking): a plain ``.to("cuda")`` from pageable memory synchronises.
"""
from __future__ import annotations

import contextlib
import time
from typing import Iterator, Union

import torch

Stamp = Union[float, "torch.cuda.Event"]


def synchronize(device: torch.device) -> None:
    """Wait for all queued work on ``device`` (never called per bucket)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    elif device.type not in ("cpu", "meta") and hasattr(torch, "accelerator"):
        torch.accelerator.synchronize(device)


def to_host(tensor: torch.Tensor) -> list:
    """A device tensor's values as Python numbers (a host synchronisation on accelerators)."""
    with host_reads_allowed():
        return tensor.detach().cpu().reshape(-1).tolist()


@contextlib.contextmanager
def host_reads_allowed() -> Iterator[None]:
    """Mark a deliberate synchronisation point (see the module docstring); re-entrant."""
    if not torch.cuda.is_available():
        yield
        return
    mode = torch.cuda.get_sync_debug_mode()
    if mode:
        torch.cuda.set_sync_debug_mode(0)
    try:
        yield
    finally:
        if mode:
            torch.cuda.set_sync_debug_mode(mode)


def to_device(tensor: torch.Tensor, device: torch.device | str) -> torch.Tensor:
    """A CPU-made tensor (seeded random columns, small vectors) on ``device`` without a host sync."""
    device = torch.device(device)
    if device.type == "cuda" and tensor.device.type == "cpu":
        return tensor.pin_memory().to(device, non_blocking=True)
    return tensor.to(device)


class Clock:
    """Timestamps on ``device``'s timeline; ``seconds`` may only be called at the end of a step."""

    def __init__(self, device: torch.device | None = None):
        self.cuda = device is not None and device.type == "cuda"

    def stamp(self) -> Stamp:
        if self.cuda:
            event = torch.cuda.Event(enable_timing=True)
            event.record()
            return event
        return time.perf_counter()

    @staticmethod
    def seconds(start: Stamp, end: Stamp) -> float:
        """Elapsed seconds between two stamps (for events: after the end event has completed)."""
        if isinstance(start, float):
            return max(0.0, end - start)  # type: ignore[operator]
        end.synchronize()  # type: ignore[union-attr]
        return start.elapsed_time(end) / 1000.0  # type: ignore[union-attr]
