"""Device-timeline timestamps and the library's only device→host reads.

Hot-path code never synchronises the device: it takes ``Clock.stamp()`` (a CUDA event recorded on
the current stream, or ``perf_counter`` on CPU) and keeps device tensors. Once per optimizer step
the reducer turns stamps into seconds and reads its packed device values with ``to_host``; that
is the step's single host synchronisation. Tests count calls of ``synchronize`` and ``to_host``
(and of ``Tensor.item``/``__bool__``/…) to hold the hot path to this rule.
"""
from __future__ import annotations

import time
from typing import Union

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
    return tensor.detach().cpu().reshape(-1).tolist()


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
