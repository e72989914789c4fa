"""Quick measurements of this machine, so the cost model can be checked against runs made here.

`measure_host` (~1 s): matmul throughput, memory bandwidth, the cost of first-touching new memory and
per-op dispatch overhead of the CPU with a given thread count (optionally in several processes at
once). `measure_link` (~5-10 s): a gloo all-reduce size sweep between local
processes, fitted to the ring alpha-beta model.
"""

from __future__ import annotations

import json
import os
import socket
import statistics
import tempfile
import time
from dataclasses import asdict
from pathlib import Path

import numpy as np

from .hardware import DeviceSpec, LinkSpec


def _best_time(fn, repeats: int) -> float:
    """Fastest of `repeats` calls: the least disturbed by other users of the 2 shared cores."""
    best = float("inf")
    for _ in range(repeats):
        t = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t)
    return best


def _host_numbers(threads: int, matmul_n: int, copy_mb: int, barrier=None) -> dict:
    """This process's matmul FLOP/s, copy bandwidth, first-touch rate and per-op overhead; with a
    barrier, each measurement starts together with the other processes' (they share the memory bus)."""
    import torch

    sync = barrier.wait if barrier is not None else (lambda: None)
    old_threads = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        a, b = torch.randn(matmul_n, matmul_n), torch.randn(matmul_n, matmul_n)
        sync()
        flops = 2 * matmul_n**3 / _best_time(lambda: a @ b, 5)
        src = torch.empty(copy_mb * 2**20 // 4)
        dst = torch.empty_like(src)
        sync()
        copy_s = _best_time(lambda: dst.copy_(src), 5)
        # the same copy into a new tensor: the kernel maps and zeroes its pages on first touch
        sync()
        fresh_s = _best_time(lambda: src.clone(), 5) - copy_s
        tiny = torch.zeros(4)
        reps = 2000
        sync()
        launch = _best_time(lambda: [tiny.add_(1.0) for _ in range(reps)], 3) / reps
        nbytes = src.numel() * 4
        skinny = _skinny_numbers(flops, 2 * nbytes / copy_s, launch, sync)
    finally:
        torch.set_num_threads(old_threads)
    return {
        "flops": flops,
        "mem": 2 * nbytes / copy_s,
        "alloc": nbytes / fresh_s if fresh_s > 0 else 0.0,
        "launch": launch,
        **skinny,
    }


# The engine's GEMMs are measured on the shape that dominates the bench's small preset (the MLP's
# 512 x 2048) at a representative rank, over enough matrices that M comes from memory, not cache,
# as it does in a step (every matrix is touched once per pass).
SKINNY_SHAPE = (512, 2048)
SKINNY_RANK = 8
SKINNY_MB = 64


def _skinny_numbers(flops: float, mem: float, launch: float, sync=lambda: None) -> dict:
    """Rates of our engine's three GEMM forms and its orthonormalisation, and of PyTorch's hook's GEMM
    forms, on cold matrices (engine_model.EngineRates): each product form's time minus its FLOPs at the
    square rate gives the rate M is streamed at; the same for the decompression's write."""
    import torch

    m, n = SKINNY_SHAPE
    r = SKINNY_RANK
    count = max(2, SKINNY_MB * 2**20 // (4 * m * n))
    mats = torch.randn(count, m, n)
    q_t, p_t = torch.randn(r, n), torch.randn(r, m)
    out_p, out_q = torch.empty(r, m), torch.empty(r, n)
    gemm_flops = 2 * m * n * r
    per = lambda fn: _best_time(fn, 3) / count  # noqa: E731
    sync()
    t_p = per(lambda: [torch.mm(q_t, mats[k].T, out=out_p) for k in range(count)])
    t_q = per(lambda: [torch.mm(p_t, mats[k], out=out_q) for k in range(count)])
    t_g = per(lambda: [torch.mm(p_t.T, q_t, out=mats[k]) for k in range(count)])
    nbytes = 4 * m * n
    stream = lambda t: nbytes / max(t - gemm_flops / flops, 0.1 * t)  # noqa: E731
    # PyTorch's powerSGD_hook: bmm(M, Q), bmm(M^T, P), bmm(P, Q^T) over the batch of same-shape matrices
    q_b, p_b = torch.randn(count, n, r), torch.randn(count, m, r)
    sync()
    t_hook = per(
        lambda: (
            torch.bmm(mats, q_b),
            torch.bmm(mats.transpose(1, 2), p_b),
            torch.bmm(p_b, q_b.transpose(1, 2), out=mats),
        )
    )
    sync()
    orth = _orth_numbers(count, r, m, mem, launch, lambda fn: _best_time(fn, 5))
    return {
        "skinny_read": 2 / (1 / stream(t_p) + 1 / stream(t_q)),
        "skinny_write": stream(t_g),
        "orth_flops": orth["orth_flops_per_s"],
        "hook_gemm_flops": 3 * gemm_flops / t_hook,
    }


def _orth_numbers(count: int, rank: int, side: int, mem: float, launch: float, timer, device=None) -> dict:
    """The engine's orthonormalisation (`edgc.engine.factors.orthonormalize_blocks_`) of one (count, rank,
    side) block of a float32 buffer, as the engine runs it on P on this device (Householder on a
    CPU, CholeskyQR2 on an accelerator): seconds, and the rate of its FLOPs
    (engine_model.orth_flops) once its launches and its copies (at the copy bandwidth ``mem``) are
    taken out."""
    import torch

    from edgc.engine.factors import orthonormalize_blocks_
    from edgc.engine.layout import Block
    from edgc.engine.orthonormal_choice import orthonormalization_for

    from .engine_model import HOUSEHOLDER_COPY_BYTES, ORTH_CAST_BYTES, orth_flops, orth_launches

    flat = torch.randn(count * rank * side, device=device)
    method = orthonormalization_for(flat.device)
    householder = method == "householder"
    block = Block(0, count, rank, side)
    seconds = timer(lambda: orthonormalize_blocks_(flat, [block], method=method))
    copies = HOUSEHOLDER_COPY_BYTES if householder else ORTH_CAST_BYTES
    rest = seconds - orth_launches({rank: 1}, householder=householder) * launch - count * rank * side * copies / mem
    flops = count * orth_flops(rank, side, householder=householder)
    return {"orth_s": seconds, "orth_flops_per_s": flops / max(rest, 0.1 * seconds), "orth_block": [count, rank, side]}


def _host_worker(args) -> dict:
    barrier, threads, matmul_n, copy_mb = args
    return _host_numbers(threads, matmul_n, copy_mb, barrier)


def measure_host(threads: int = 1, matmul_n: int = 768, copy_mb: int = 64, processes: int = 1) -> DeviceSpec:
    """This CPU as a DeviceSpec (mfu 1: the measured matmul rate already is the achieved rate).

    `processes` > 1 runs the measurements in that many processes at once and averages them: what one
    rank gets while the other ranks of a run on the same host compress at the same moment."""
    if processes <= 1:
        numbers = [_host_numbers(threads, matmul_n, copy_mb)]
    else:
        import multiprocessing as mp

        ctx = mp.get_context("spawn")
        with ctx.Manager() as manager, ctx.Pool(processes) as pool:
            barrier = manager.Barrier(processes)
            numbers = pool.map(_host_worker, [(barrier, threads, matmul_n, copy_mb)] * processes)
    mean = {key: statistics.fmean(n[key] for n in numbers) for key in numbers[0]}
    together = f", {processes} processes at once" if processes > 1 else ""
    m, n = SKINNY_SHAPE
    return DeviceSpec(
        "host",
        {"fp32": mean["flops"]},
        1.0,
        mean["mem"],
        mean["launch"],
        f"measured: torch {matmul_n}^2 matmul, {copy_mb} MB copy and clone, tiny add_, "
        f"rank-{SKINNY_RANK} GEMMs over {SKINNY_MB} MB of {m}x{n} and their P block's "
        f"orthonormalisation; {threads} thread(s){together}",
        mean["alloc"],
        mean["skinny_read"],
        mean["skinny_write"],
        mean["orth_flops"],
        mean["hook_gemm_flops"],
    )


def measure_cuda(matmul_n: int = 8192, copy_mb: int = 1024, shape: tuple = (1600, 6400), rank: int = 32) -> dict:
    """The same quantities on the current CUDA device (`edgc_bench.gpu`), timed by CUDA events: matmul
    FLOP/s per precision, copy bandwidth (bytes read + written), the per-op cost of a tiny eager op
    (launch + dispatch), and the engine's skinny-GEMM and orthonormalisation rates on GPT-2 XL MLP
    matrices."""
    import torch

    def timed(fn, repeats: int = 10) -> float:
        fn()
        fn()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        times = []
        for _ in range(repeats):
            start.record()
            fn()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end) / 1e3)
        return statistics.median(times)

    device = torch.device("cuda")
    flops = {}
    for name, dtype, tf32 in (
        ("bf16", torch.bfloat16, False),
        ("tf32", torch.float32, True),
        ("fp32", torch.float32, False),
    ):
        torch.backends.cuda.matmul.allow_tf32 = tf32
        a = torch.randn(matmul_n, matmul_n, device=device, dtype=dtype)
        b = torch.randn(matmul_n, matmul_n, device=device, dtype=dtype)
        flops[name] = 2 * matmul_n**3 / timed(lambda: a @ b)
    torch.backends.cuda.matmul.allow_tf32 = False
    src = torch.randn(copy_mb * 2**20 // 4, device=device)
    dst = torch.empty_like(src)
    mem = 2 * src.numel() * 4 / timed(lambda: dst.copy_(src))
    tiny = torch.zeros(4, device=device)
    reps = 2000
    launch = timed(lambda: [tiny.add_(1.0) for _ in range(reps)], 3) / reps  # host-bound: the issue rate
    m, n = shape
    count = max(2, 512 * 2**20 // (4 * m * n))  # more than L2: M comes from memory, as in a step
    mats = torch.randn(count, m, n, device=device)
    q_t, p_t = torch.randn(rank, n, device=device), torch.randn(rank, m, device=device)
    out_p, out_q = torch.empty(rank, m, device=device), torch.empty(rank, n, device=device)
    per = lambda fn: timed(fn, 5) / count  # noqa: E731
    t_p = per(lambda: [torch.mm(q_t, mats[k].T, out=out_p) for k in range(count)])
    t_q = per(lambda: [torch.mm(p_t, mats[k], out=out_q) for k in range(count)])
    t_g = per(lambda: [torch.mm(p_t.T, q_t, out=mats[k]) for k in range(count)])
    gemm_flops, nbytes = 2 * m * n * rank, 4 * m * n
    stream = lambda t: nbytes / max(t - gemm_flops / flops["fp32"], 0.1 * t)  # noqa: E731
    orth = _orth_numbers(count, rank, m, mem, launch, timed, device)  # P's block of those matrices
    return {
        "matmul_flops": flops,
        "mem_bytes_per_s": mem,
        "launch_s": launch,
        "skinny_read_bytes_per_s": 2 / (1 / stream(t_p) + 1 / stream(t_q)),
        "skinny_write_bytes_per_s": stream(t_g),
        **orth,
        "skinny_shape": [m, n],
        "skinny_rank": rank,
        "skinny_gemm_s": {"p": t_p, "q": t_q, "decompress": t_g},
        "source": f"torch {matmul_n}^3 matmuls, {copy_mb} MB copy, 2000 tiny add_, rank-{rank} GEMMs on "
        f"{count} fp32 {m}x{n} matrices, the orthonormalisation of their ({count}, {rank}, {m}) "
        "P block; CUDA events, median",
    }


def fit_alpha_beta(world: int, sizes_bytes, seconds) -> tuple:
    """Fit of T = 2(n-1) alpha + 2(n-1)/n * N / beta minimising *relative* squared error (so the
    small sizes still pin alpha); returns (alpha_s, bytes_per_s)."""
    x = np.asarray(sizes_bytes, dtype=float)
    y = np.asarray(seconds, dtype=float)
    design = np.column_stack([np.full_like(x, 2 * (world - 1)), 2 * (world - 1) / world * x]) / y[:, None]
    (alpha, inv_beta), *_ = np.linalg.lstsq(design, np.ones_like(y), rcond=None)
    if inv_beta <= 0:
        raise ValueError("all-reduce time did not grow with size; cannot fit a bandwidth")
    return max(float(alpha), 0.0), 1.0 / float(inv_beta)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _sweep_worker(rank: int, world: int, port: int, sizes: list, repeats: int, out: str) -> None:
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    try:
        medians = []
        for nbytes in sizes:
            buf = torch.ones(max(1, nbytes // 4))
            dist.all_reduce(buf)  # first call of a size sets up buffers; not timed
            times = []
            for _ in range(repeats):
                dist.barrier()
                t = time.perf_counter()
                dist.all_reduce(buf)
                times.append(time.perf_counter() - t)
            medians.append(statistics.median(times))
        if rank == 0:
            Path(out).write_text(json.dumps(medians))
    finally:
        dist.destroy_process_group()


def measure_link(world: int = 2, sizes=(4 << 10, 256 << 10, 2 << 20, 8 << 20, 32 << 20), repeats: int = 5) -> tuple:
    """gloo all-reduce sweep between `world` local processes. Returns (LinkSpec, sizes, seconds)."""
    import torch.multiprocessing as mp

    sizes = list(sizes)
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "sweep.json")
        mp.spawn(_sweep_worker, args=(world, _free_port(), sizes, repeats, out), nprocs=world, join=True)
        seconds = json.loads(Path(out).read_text())
    alpha, beta = fit_alpha_beta(world, sizes, seconds)
    link = LinkSpec("host-gloo", beta, 1.0, alpha, f"measured: gloo all-reduce sweep, {world} local processes")
    return link, sizes, seconds


def save_profile(path: str | Path, device: DeviceSpec, link: LinkSpec | None) -> None:
    Path(path).write_text(json.dumps({"device": asdict(device), "link": asdict(link) if link else None}, indent=2))


def load_profile(path: str | Path) -> tuple:
    """(DeviceSpec, LinkSpec or None) from a file written by save_profile. A profile saved before the
    engine orthonormalised by Cholesky QR holds ``qr_flops_per_s``, the rate of torch.linalg.qr, which
    the engine no longer runs: it is dropped, and the orthonormalisation rate is unmeasured (0)."""
    data = json.loads(Path(path).read_text())
    link = LinkSpec(**data["link"]) if data.get("link") else None
    device = {key: value for key, value in data["device"].items() if key != "qr_flops_per_s"}
    return DeviceSpec(**device), link
