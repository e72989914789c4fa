"""What the GPU bench's parts share: the model, device timing, kernel counts and process groups.

Everything here runs unchanged on a CPU (gloo, ``perf_counter``, no kernel count), which is how
`python -m edgc_bench.gpu --smoke` and the suite exercise the bench without a GPU.
"""

from __future__ import annotations

import pickle
import socket
import statistics
import tempfile
import time
from collections.abc import Callable
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist

GROUP_TIMEOUT = timedelta(seconds=300)


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def median(values: list[float]) -> float:
    return statistics.median(values) if values else float("nan")


def gpt2(size: str, device: torch.device, dtype: torch.dtype = torch.bfloat16, shapes: dict | None = None):
    """GPT-2 ``size`` with random weights: Hugging Face's model for the published sizes (no dropout)
    and for those of ``shapes`` (name → (layers, width, heads, vocabulary, context)),
    `edgc_probes.gpt2_layout.GPT2Layout` for "tiny" (smoke runs; no transformers import)."""
    from edgc_probes.gpt2_layout import GPT2_SIZES, GPT2Layout

    if size == "tiny":
        with torch.device(device):
            return GPT2Layout(size).to(dtype)
    from transformers import GPT2Config, GPT2LMHeadModel

    layers, width, heads, vocab, context = {**GPT2_SIZES, **(shapes or {})}[size]
    config = GPT2Config(
        n_layer=layers,
        n_embd=width,
        n_head=heads,
        n_positions=context,
        vocab_size=vocab,
        resid_pdrop=0.0,
        embd_pdrop=0.0,
        attn_pdrop=0.0,
    )
    with torch.device(device):
        model = GPT2LMHeadModel(config)
    return model.to(dtype)


def vocabulary(size: str, shapes: dict | None = None) -> int:
    from edgc_probes.gpt2_layout import GPT2_SIZES

    return {**GPT2_SIZES, **(shapes or {})}[size][3]


class DeviceTimer:
    """Marks on the device's timeline (CUDA events on the current stream, ``perf_counter`` on a CPU);
    ``seconds`` waits for the later mark, so call it after the work, never inside it."""

    def __init__(self, device: torch.device):
        self.cuda = device.type == "cuda"

    def mark(self):
        if not self.cuda:
            return time.perf_counter()
        event = torch.cuda.Event(enable_timing=True)
        event.record()
        return event

    def seconds(self, start, end) -> float:
        if not self.cuda:
            return end - start
        end.synchronize()
        return start.elapsed_time(end) / 1e3

    def synchronize(self) -> None:
        if self.cuda:
            torch.cuda.synchronize()


def device_activity_count(run: Callable[[], None], device: torch.device) -> int | None:
    """Kernels, copies and memsets the device ran during ``run()`` (torch.profiler); on a CPU,
    None without running it."""
    profiled = kernel_profile(run, device)
    return None if profiled is None else profiled["kernels"]


def kernel_profile(run: Callable[[], None], device: torch.device, top: int = 12) -> dict | None:
    """What the device ran during ``run()`` (torch.profiler's kernel list): the count of kernels,
    copies and memsets, their summed device time, the span from the first start to the last end,
    and the ``top`` names by summed time as [name, count, seconds]; on a CPU, None without running it.
    Summed time well below the span says the device waited (for the host's launches, or a stream)."""
    if device.type != "cuda":
        return None
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        run()
        torch.cuda.synchronize()
    cuda = torch.autograd.DeviceType.CUDA
    events = [e for e in prof.profiler.kineto_results.events() if e.device_type() == cuda]
    by_name: dict[str, list] = {}
    for event in events:
        entry = by_name.setdefault(event.name()[:120], [0, 0])
        entry[0] += 1
        entry[1] += event.duration_ns()
    ranked = sorted(by_name.items(), key=lambda item: -item[1][1])[:top]
    starts = [e.start_ns() for e in events]
    ends = [e.start_ns() + e.duration_ns() for e in events]
    return {
        "kernels": len(events),
        "device_s": sum(e.duration_ns() for e in events) / 1e9,
        "span_s": (max(ends) - min(starts)) / 1e9 if events else 0.0,
        "top": [[name, count, ns / 1e9] for name, (count, ns) in ranked],
    }


def memory_allocated(device: torch.device) -> int | None:
    return torch.cuda.memory_allocated(device) if device.type == "cuda" else None


def peak_memory(device: torch.device, reset: bool = False) -> int | None:
    if device.type != "cuda":
        return None
    if reset:
        torch.cuda.reset_peak_memory_stats(device)
    return torch.cuda.max_memory_allocated(device)


def _spawned(rank: int, fn, world_size: int, backend: str, port: int, folder: str, args: tuple) -> None:
    """One process of `spawn_group`: a group, ``fn``, its result pickled, and the exit
    `edgc.distributed.comm` asks for."""
    import edgc

    if torch.cuda.is_available():
        torch.cuda.set_device(0)  # one GPU: every rank shares it
    dist.init_process_group(
        backend, init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world_size, timeout=GROUP_TIMEOUT
    )
    result = fn(rank, world_size, *args)
    (Path(folder) / f"{rank}.pickle").write_bytes(pickle.dumps(result))
    edgc.barrier_before_exit()  # a bare barrier + destroy can abort gloo's threads at exit
    dist.destroy_process_group()


def spawn_group(fn, world_size: int, backend: str, *args, timeout: float) -> list:
    """``fn(rank, world_size, *args)`` in ``world_size`` new processes joined by ``backend``; their
    results by rank. Processes still running after ``timeout`` seconds are killed (TimeoutError).
    The suite passes a runner of the same signature that uses its process pool."""
    import torch.multiprocessing as mp

    with tempfile.TemporaryDirectory() as folder:
        context = mp.spawn(
            _spawned, args=(fn, world_size, backend, free_port(), folder, args), nprocs=world_size, join=False
        )
        deadline = time.monotonic() + timeout
        while not context.join(timeout=5):
            if time.monotonic() > deadline:
                for process in context.processes:
                    process.kill()
                raise TimeoutError(f"{fn.__name__} did not finish within {timeout:.0f} s")
        return [pickle.loads((Path(folder) / f"{rank}.pickle").read_bytes()) for rank in range(world_size)]
