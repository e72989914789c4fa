"""The library's streams and stream-ordered memory, in one device-agnostic place.

On CUDA a stream is a `torch.cuda.Stream`. Elsewhere there are no streams, and `torch.cpu`'s
stand-ins take their place: a `torch.cpu.Stream` whose ``wait_stream``/``record_event``/
``wait_event`` do nothing, and ``torch.cpu.stream(s)`` that only names the current one. So the
code that orders work across streams runs the same on every device, and a checker can give the
stand-ins an identity on the CPU and check that order there (`edgc_probes.stream_check`, which
does the same for FSDP2's streams, themselves `torch.cpu` stand-ins on the CPU).

Use a stream's own ``wait_stream(other)``, ``record_event()`` (an event, or None on the CPU) and
``wait_event(event)``; the rest is here. Memory made on one stream and used on another is kept
from reuse with `record_stream` until the other stream's work queued so far is done.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from typing import Any

import torch

Stream = Any  # torch.cuda.Stream, or torch.cpu.Stream off CUDA

# Told of every `record_stream` off CUDA, where tensors have no stream to record: a checker's
# hook (`edgc_probes.stream_check`); None outside one.
record_stream_observer: Callable[[torch.Tensor, Stream], None] | None = None
# Asked off CUDA whether the calling thread runs CUDA's path on CPU tensors, pinned host copies
# included: a checker's (`edgc_probes.stream_check`); None outside one.
pinned_off_cuda: Callable[[], bool] | None = None


def new_stream(device: torch.device) -> Stream:
    """A stream of its own on ``device``."""
    return torch.cuda.Stream(device) if device.type == "cuda" else torch.cpu.Stream()


def current_stream(device: torch.device) -> Stream:
    """The stream that work on ``device`` is queued on now."""
    return torch.cuda.current_stream(device) if device.type == "cuda" else torch.cpu.current_stream()


def using(stream: Stream) -> contextlib.AbstractContextManager:
    """Make ``stream`` the current one in the body."""
    return torch.cuda.stream(stream) if isinstance(stream, torch.cuda.Stream) else torch.cpu.stream(stream)


def pins(device: torch.device) -> bool:
    """Whether copies between the host and ``device`` go through pinned host memory (CUDA's), so that
    a non-blocking copy makes neither side wait; then the host reads a copied value only after an
    event that follows the copy (`edgc.device.timing.HostCopy`)."""
    return device.type == "cuda" or (device.type == "cpu" and pinned_off_cuda is not None and pinned_off_cuda())


def record_stream(tensor: torch.Tensor, stream: Stream) -> None:
    """``tensor``'s memory is not reused before the work queued on ``stream`` so far is done,
    whichever stream frees it (`torch.Tensor.record_stream`)."""
    if isinstance(stream, torch.cuda.Stream):
        tensor.record_stream(stream)
    elif record_stream_observer is not None:
        record_stream_observer(tensor, stream)
