"""Which orthonormalisation the engine runs on a device: timed once, agreed by the group, kept.

On a CPU, LAPACK's Householder QR (a library call costs no launch there). On an accelerator, the
shifted CholeskyQR2 in float64 or the four-pass CholeskyQR in float32 (`edgc.engine.factors`), whichever is
faster there. Compute capability cannot say which: 9.0 covers the H100 and the H20, whose float64
rate is cut. So the engine times both once per device (`timed`), on a batch shaped like a job's P
blocks, with device events, and takes the faster.

A timing differs from replica to replica and from a run to its resume, and the two methods round
differently: replicas that ran different ones would drift apart. So the group takes its rank 0's
choice (`agreed`: one broadcast, at the state's first step, where every rank stands at the same
point), and the engine keeps it in its state and checkpoints (`edgc.engine.engine_memory.EngineMemory`): a
resumed run, or a healing replica, runs the method its peers run and times nothing.
"""

from __future__ import annotations

import functools
import time

import torch

from ..device.timing import host_reads_allowed, to_host
from .factors import ORTHONORMALIZATIONS, orthonormalize_blocks_

TIMED = ("cholesky2-fp64", "cholesky4-fp32")
TIMED_SHAPE = (16, 32, 4096)  # a job's P blocks: matrices × rank × rows
TIMED_REPEATS = 3


class _Batch:
    def __init__(self, shape: tuple[int, int, int]):
        self.count, self.rank, self.side = shape

    def view(self, flat: torch.Tensor) -> torch.Tensor:
        return flat.view(self.count, self.rank, self.side)


def seconds_of(method: str, device: torch.device, shape: tuple[int, int, int] = TIMED_SHAPE) -> float:
    """Seconds of one orthonormalisation of a ``shape`` batch by ``method`` on ``device`` (the best of
    `TIMED_REPEATS`, after one warm-up call): device events on CUDA, the host's clock elsewhere."""
    generator = torch.Generator(device=device).manual_seed(0)
    flat = torch.randn(shape[0] * shape[1] * shape[2], device=device, generator=generator)
    block = [_Batch(shape)]
    best = float("inf")
    with host_reads_allowed():  # a one-off measurement, before the first step's work
        for repeat in range(TIMED_REPEATS + 1):
            work = flat.clone()
            if device.type == "cuda":
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                start.record()
                orthonormalize_blocks_(work, block, method=method)
                end.record()
                end.synchronize()
                seconds = start.elapsed_time(end) / 1000
            else:
                began = time.perf_counter()
                orthonormalize_blocks_(work, block, method=method)
                seconds = time.perf_counter() - began
            if repeat:
                best = min(best, seconds)
    return best


@functools.cache
def timed(device_type: str, index: int | None) -> str:
    """The faster of the float64 and float32 Cholesky methods on one accelerator, timed once per device."""
    device = torch.device(device_type, index) if index is not None else torch.device(device_type)
    return min(TIMED, key=lambda method: seconds_of(method, device))


def orthonormalization_for(device: torch.device) -> str:
    """This process's choice for ``device``: Householder on a CPU, else the timed one (`timed`)."""
    if device.type == "cpu":
        return "householder"
    index = device.index
    if device.type == "cuda" and index is None:
        index = torch.cuda.current_device()
    return timed(device.type, index)


def agreed(choice: str, comm, device: torch.device) -> str:
    """``choice`` (this rank's) as the group's over ``comm`` (an `edgc.distributed.comm.Communicator` on ``device``):
    its rank 0's, broadcast. Every rank must call this at the same point; no group, no broadcast."""
    if not comm.issues:
        return choice
    code = torch.full((), float(ORTHONORMALIZATIONS.index(choice)), dtype=torch.float64, device=device)
    with host_reads_allowed():  # once per run, at its first step
        (value,) = to_host(comm.broadcast(code))
    return ORTHONORMALIZATIONS[int(value)]
