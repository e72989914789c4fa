"""Device-timeline timestamps and the library's only device→host reads.

Hot-path code never synchronises the device: it takes ``Clock.stamp()`` (a CUDA event recorded on
the current stream on timed steps, or ``perf_counter`` on CPU) and keeps device tensors. At the end
of a step the reducer sends its packed device values to the host behind an event (`HostCopy`) and
reads them when the step is settled: at the start of the next step, or when its metrics are read
after the optimizer step. That is the step's single host read, and it waits for no later work. Tests count calls of
``synchronize`` and ``to_host``
(and of ``Tensor.item``/``__bool__``/…) to hold the hot path to this rule.

The places allowed to synchronise run inside ``host_reads_allowed()``: the end of a step and a
rank change (at most once per decision window). On CUDA that lifts
``torch.cuda.set_sync_debug_mode("error")`` for them alone, so a run under that mode fails at any
other synchronisation (tests/gpu). Host→device copies of CPU-made tensors go through ``to_device``
(pinned, non-blocking): a plain ``.to("cuda")`` from pageable memory synchronises.
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Iterator
from typing import Union

import torch

from . import streams

Stamp = Union[float, "torch.cuda.Event"]


def synchronize(device: torch.device) -> None:
    """Wait for all queued work on ``device`` (never called per bucket)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    elif device.type == "cpu":
        torch.cpu.synchronize()  # nothing to wait for, but a checker sees the call (`edgc_probes.stream_check`)
    elif device.type != "meta" and hasattr(torch, "accelerator"):
        torch.accelerator.synchronize(device)


def to_host(tensor: torch.Tensor) -> list:
    """A device tensor's values as Python numbers (a host synchronisation on accelerators)."""
    with host_reads_allowed():
        return tensor.detach().cpu().reshape(-1).tolist()


_allowed = threading.local()  # depth of host_reads_allowed on this thread


def host_reads_are_allowed() -> bool:
    """Whether this thread is inside `host_reads_allowed` (a checker's question: `edgc_probes.stream_check`)."""
    return getattr(_allowed, "depth", 0) > 0


@contextlib.contextmanager
def host_reads_allowed() -> Iterator[None]:
    """Mark a deliberate synchronisation point (see the module docstring); re-entrant."""
    _allowed.depth = getattr(_allowed, "depth", 0) + 1
    mode = torch.cuda.get_sync_debug_mode() if torch.cuda.is_available() else 0
    if mode:
        torch.cuda.set_sync_debug_mode(0)
    try:
        yield
    finally:
        _allowed.depth -= 1
        if mode:
            torch.cuda.set_sync_debug_mode(mode)


def to_device(tensor: torch.Tensor, device: torch.device | str) -> torch.Tensor:
    """A CPU-made tensor (seeded random columns, small vectors) on ``device`` without a host sync."""
    device = torch.device(device)
    if streams.pins(device) and tensor.device.type == "cpu":
        return tensor.pin_memory().to(device, non_blocking=True)
    return tensor.to(device, non_blocking=True)  # what the copy is, wherever one is made


def state_to_device(
    tensors: dict[str, torch.Tensor], device: torch.device, stream: streams.Stream | None
) -> dict[str, torch.Tensor]:
    """Loaded state (a checkpoint's, a peer's) onto ``device`` for ``stream``, the jobs' stream that
    reads it and then replaces it: copied without a host wait (`to_device`), and kept from reuse until
    that stream's work queued so far is done (`edgc.device.streams.record_stream`). The copy's memory comes
    from the current (compute) stream's pool; without the record, backward could reuse it while the
    jobs still read it. The one rule for every sync state's loaded tensors."""
    moved = {}
    for name, tensor in tensors.items():
        moved[name] = to_device(tensor, device)
        if stream is not None:
            streams.record_stream(moved[name], stream)
    return moved


def state_to_host(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """A checkpoint's copy of device state, on the host (a checkpoint: the host waits, as allowed)."""
    with host_reads_allowed():
        return {name: tensor.detach().cpu().clone() for name, tensor in tensors.items()}


def device_scalar(value: float | bool | torch.Tensor, device: torch.device) -> torch.Tensor:
    """``value`` as a 0-dim float64 tensor on ``device``, made on the current stream: a cast of a device
    value, or a fill for a Python number (a copy from host memory would make the host wait)."""
    if isinstance(value, torch.Tensor):
        return value.to(torch.float64).reshape(())
    return torch.full((), float(value), dtype=torch.float64, device=device)


# On an accelerator a timestamp is a recorded event: cheap, but not free per bucket of every step.
# Device timestamps are taken on every DEVICE_TIMING_EVERY-th step and on the steps that need them
# (r_max profiling); `perf_counter` on CPU costs nothing, so there every step is timed.
DEVICE_TIMING_EVERY = 100


class Clock:
    """Timestamps on ``device``'s timeline; ``seconds`` may only be called once the step is over.

    With ``enabled`` False (an untimed step on an accelerator) a stamp is None and so is any span
    that has one: the step's time figures are then missing, not zero."""

    def __init__(self, device: torch.device | None = None):
        self.cuda = device is not None and device.type == "cuda"
        self.enabled = True

    def stamp(self) -> Stamp | None:
        if not self.enabled:
            return None
        if self.cuda:
            event = torch.cuda.Event(enable_timing=True)
            event.record()
            return event
        return time.perf_counter()

    @staticmethod
    def seconds(start: Stamp | None, end: Stamp | None) -> float | None:
        """Elapsed seconds between two stamps (for events: after the end event has completed), or
        None for an untimed span."""
        if start is None or end is None:
            return None
        if isinstance(start, float):
            return max(0.0, end - start)  # type: ignore[operator]
        with host_reads_allowed():
            end.synchronize()  # type: ignore[union-attr]
        return start.elapsed_time(end) / 1000.0  # type: ignore[union-attr]

    @staticmethod
    def total(spans: list[tuple]) -> float | None:
        """Seconds summed over (start, end) spans; None if any is untimed."""
        seconds = [Clock.seconds(start, end) for start, end in spans]
        return None if any(s is None for s in seconds) else sum(seconds)  # type: ignore[arg-type]


class HostCopy:
    """A device tensor on its way to the host: copied into pinned memory without waiting, behind an
    event; `values` waits for that copy alone (not for work queued after it) and reads it.

    This is how a step's device values reach the host one step late, or after the optimizer step,
    so the read never stalls the GPU."""

    def __init__(self, tensor: torch.Tensor):
        if streams.pins(tensor.device):
            self._host = torch.empty(tensor.shape, dtype=tensor.dtype, pin_memory=True)
            self._host.copy_(tensor, non_blocking=True)
        else:
            self._host = tensor
        self._event = streams.current_stream(tensor.device).record_event()  # None off CUDA

    def values(self) -> list:
        if self._event is not None:
            with host_reads_allowed():
                self._event.synchronize()
        return to_host(self._host)
