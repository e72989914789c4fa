"""`python -m edgc_bench.gpu --out DIR`: the CUDA path measured on one GPU (docs/gpu.md).

One command, one GPU, every figure written as a file under DIR (scripts/gpu_to_docs.py copies them
into the README and docs/gpu.md):
- ``env.json``      device, driver, torch, CUDA and NCCL versions;
- ``engine.json``   GPT-2 medium/large/XL (HF, bf16), DDP on NCCL with one process: step time with no
                    hook, PyTorch's ``powerSGD_hook`` and EDGC at the same static rank; the hooks' time
                    (hooked step − plain step), backward time, CUDA kernels per step, memory beyond
                    the gradients; and our engine alone on the same gradients;
- ``overlap.json`` + ``trace_gloo.json.gz`` 2 processes on the one GPU over gloo with CUDA tensors
                    (NCCL cannot put two ranks on one GPU): replicas bit-identical, host reads per step,
                    and a profiler trace (CUDA activities) of one compressed step of rank 0; the same
                    for NCCL with one process, whose collectives move no bytes;
- ``device.json``   the host profile of `edgc_sim` measured on the GPU, beside the simulator's preset.
"""
from __future__ import annotations

import argparse
import gzip
import json
import os
import platform
import socket
import statistics
import subprocess
import time
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

GPT2_SIZES = {"small": (12, 768, 12), "medium": (24, 1024, 16), "large": (36, 1280, 20), "xl": (48, 1600, 25)}


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def environment() -> dict:
    smi = subprocess.run(["nvidia-smi", "--query-gpu=name,driver_version,memory.total,clocks.max.sm",
                          "--format=csv,noheader"], capture_output=True, text=True).stdout.strip()
    props = torch.cuda.get_device_properties(0)
    return {"device": torch.cuda.get_device_name(0), "nvidia_smi": smi, "torch": torch.__version__,
            "cuda": torch.version.cuda, "nccl": ".".join(map(str, torch.cuda.nccl.version())),
            "multiprocessors": props.multi_processor_count, "memory_gib": round(props.total_memory / 2**30, 1),
            "python": platform.python_version(), "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())}


def gpt2(size: str, device: torch.device, dtype=torch.bfloat16):
    from transformers import GPT2Config, GPT2LMHeadModel

    layers, width, heads = GPT2_SIZES[size]
    config = GPT2Config(n_layer=layers, n_embd=width, n_head=heads, n_positions=1024, vocab_size=50257,
                        resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
    with torch.device(device):
        model = GPT2LMHeadModel(config)
    return model.to(dtype)


def _median(values: list[float]) -> float:
    return statistics.median(values) if values else float("nan")


# ---------------------------------------------------------------------------- engine speed
def _wrap(model, method: str, rank: int, device):
    """DDP with no hook, PyTorch's powerSGD_hook or EDGC at a static rank (same bucket size)."""
    from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook as psgd

    from edgc import EDGCConfig, EDGCState, edgc_hook

    ddp = DDP(model, device_ids=[device.index] if device.type == "cuda" else None, gradient_as_bucket_view=True)
    state = None
    if method == "powersgd":
        state = psgd.PowerSGDState(process_group=None, matrix_approximation_rank=rank, start_powerSGD_iter=2)
        ddp.register_comm_hook(state, psgd.powerSGD_hook)
    elif method.startswith("edgc"):
        extra = {"error_feedback_dtype": "gradient"} if method == "edgc-bf16-ef" else {}
        state = EDGCState(None, EDGCConfig.static(rank, total_steps=100_000, warmup_fraction=0.0, **extra), model=ddp)
        ddp.register_comm_hook(state, edgc_hook)
    return ddp, state


def _steps(ddp, tokens, count: int) -> list[tuple[float, float]]:
    """(step, backward) seconds of ``count`` forward+backward steps, timed by CUDA events."""
    marks = []
    for _ in range(count):
        start, forward_done, end = (torch.cuda.Event(enable_timing=True) for _ in range(3))
        start.record()
        loss = ddp(input_ids=tokens, labels=tokens).loss
        forward_done.record()
        loss.backward()
        end.record()
        ddp.module.zero_grad(set_to_none=False)
        marks.append((start, forward_done, end))
    torch.cuda.synchronize()
    return [(s.elapsed_time(e) / 1e3, f.elapsed_time(e) / 1e3) for s, f, e in marks]


def _kernels(ddp, tokens) -> int:
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        _steps(ddp, tokens, 1)
    return sum(1 for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA)


def _engine_alone(model, rank: int, repeats: int = 5) -> float:
    """Our engine on the model's current gradients, no DDP around it: seconds per call (median)."""
    from edgc import EDGCConfig, LowRankCompressor
    from edgc.comm import Communicator

    named = [(n, p.grad.detach().clone()) for n, p in model.named_parameters() if p.grad is not None]
    compressor = LowRankCompressor(EDGCConfig(r_max=rank, min_compression_rate=2.0))
    times = []
    for _ in range(repeats + 2):
        grads = [g.clone() for _, g in named]
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        compressor.reduce([n for n, _ in named], grads, rank, Communicator(None), measure_error=False)
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end) / 1e3)
    return _median(times[2:])


def engine_speed(sizes: list[str], ranks: list[int], micro_batch: int, seq_len: int, timed: int,
                 device: torch.device = torch.device("cuda", 0)) -> list[dict]:
    rows = []
    for size in sizes:
        torch.manual_seed(0)
        model = gpt2(size, device)
        grad_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
        tokens = torch.randint(0, 50257, (micro_batch, seq_len), device=device)
        plan = [("none", 0)] + [(m, r) for r in ranks for m in ("powersgd", "edgc")]
        if 32 in ranks:
            plan.append(("edgc-bf16-ef", 32))
        baseline = None
        for method, rank in plan:
            ddp, state = _wrap(model, method, rank, device)
            _steps(ddp, tokens, 4)  # warm-up: DDP's bucket rebuild, both hooks' uncompressed start, Q creation
            torch.cuda.synchronize()
            resident = torch.cuda.memory_allocated()
            torch.cuda.reset_peak_memory_stats()
            times = _steps(ddp, tokens, timed)
            peak = torch.cuda.max_memory_allocated()
            row = {"model": size, "params": sum(p.numel() for p in model.parameters()), "method": method,
                   "rank": rank, "step_s": _median([t for t, _ in times]), "backward_s": _median([b for _, b in times]),
                   "step_s_all": [t for t, _ in times], "kernels": _kernels(ddp, tokens),
                   "resident_bytes": resident, "peak_bytes": peak, "grad_bytes": grad_bytes,
                   "micro_batch": micro_batch, "seq_len": seq_len}
            if state is not None and hasattr(state, "last_step_metrics"):
                row["phase"], row["edgc_rank"] = state.last_step_metrics["phase"], state.last_step_metrics["rank"]
            if method == "none":
                baseline = row
            else:
                row["hook_s"] = row["step_s"] - baseline["step_s"]
                row["hook_kernels"] = row["kernels"] - baseline["kernels"]
                row["extra_resident_bytes"] = row["resident_bytes"] - baseline["resident_bytes"]
                row["extra_peak_bytes"] = row["peak_bytes"] - baseline["peak_bytes"]
                row["hook_over_backward"] = row["hook_s"] / baseline["backward_s"]
            if method == "edgc":
                row["engine_alone_s"] = _engine_alone(model, rank)
            rows.append(row)
            print(json.dumps({k: v for k, v in row.items() if k != "step_s_all"}), flush=True)
            del ddp, state
            model.zero_grad(set_to_none=True)
            torch.cuda.empty_cache()
        del model
        torch.cuda.empty_cache()
    return rows


# ---------------------------------------------------------------------------- NCCL, gloo and the trace
def _overlap_worker(rank: int, world: int, backend: str, port: int, out: str, steps: int, size: str) -> None:
    from torch.profiler import ProfilerActivity, profile

    import edgc.timing
    from edgc import EDGCConfig, EDGCState, edgc_hook

    torch.cuda.set_device(0)
    device = torch.device("cuda", 0)
    dist.init_process_group(backend, init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                            timeout=timedelta(seconds=300))
    torch.manual_seed(0)
    model = gpt2(size, device)
    ddp = DDP(model, device_ids=[0], gradient_as_bucket_view=True)
    state = EDGCState(None, EDGCConfig.static(16, total_steps=10_000, warmup_fraction=0.0), model=ddp)
    ddp.register_comm_hook(state, edgc_hook)
    optimizer = torch.optim.AdamW(ddp.parameters(), lr=1e-4, fused=True)
    reads, counter, real = [], [0], edgc.timing.to_host

    def counting(tensor):
        counter[0] += 1
        return real(tensor)

    edgc.timing.to_host = counting
    generator = torch.Generator().manual_seed(rank)
    trace = None
    for step in range(steps):
        tokens = torch.randint(0, 50257, (4, 1024), generator=generator).pin_memory().to(device, non_blocking=True)
        counter[0] = 0
        profiling = step == steps - 1 and rank == 0
        context = profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) if profiling else None
        if context is not None:
            context.__enter__()
        loss = ddp(input_ids=tokens, labels=tokens).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=False)
        if context is not None:
            torch.cuda.synchronize()
            context.__exit__(None, None, None)
            trace = context
        reads.append(counter[0])
    metrics = state.last_step_metrics
    params = torch.cat([p.detach().reshape(-1).float() for p in model.parameters()])
    checksum = [float(params.double().sum()), float(params.double().square().sum())]
    gathered = [None] * world
    dist.all_gather_object(gathered, checksum)
    if rank == 0:
        path = Path(out) / f"trace_{backend}.json"
        trace.export_chrome_trace(str(path))
        with open(path, "rb") as src, gzip.open(f"{path}.gz", "wb") as dst:
            dst.write(src.read())
        path.unlink()
        result = {"backend": backend, "world_size": world, "model": size, "steps": steps,
                  "host_reads_per_step": reads, "phase": metrics["phase"], "rank": metrics["rank"],
                  "collectives_last_step": metrics["collectives"], "bytes_sent": metrics["bytes_sent"],
                  "bytes_raw": metrics["bytes_raw"], "checksums": gathered,
                  "replicas_identical": all(c == gathered[0] for c in gathered)}
        (Path(out) / f"overlap_{backend}.json").write_text(json.dumps(result, indent=1))
    dist.barrier()
    dist.destroy_process_group()


def overlap(out: Path, steps: int, size: str) -> dict:
    import torch.multiprocessing as mp

    results = {}
    for backend, world in (("gloo", 2), ("nccl", 1)):
        mp.spawn(_overlap_worker, args=(world, backend, _free_port(), str(out), steps, size), nprocs=world, join=True)
        path = out / f"overlap_{backend}.json"
        results[backend] = json.loads(path.read_text())
        path.unlink()
    return results


# ---------------------------------------------------------------------------- device profile
def device_profile() -> dict:
    """The simulator's host measurements, taken on the GPU, beside its h100 preset."""
    from edgc_sim.hardware import DEVICES
    from edgc_sim.host import measure_cuda

    measured = measure_cuda()
    preset = DEVICES["h100"]
    return {"measured": measured, "preset": {"name": preset.name, "matmul_flops": preset.matmul_flops, "mfu": preset.mfu,
                                             "mem_bytes_per_s": preset.mem_bytes_per_s, "launch_s": preset.launch_s,
                                             "skinny_read_bytes_per_s": preset.skinny_read_bytes_per_s,
                                             "skinny_write_bytes_per_s": preset.skinny_write_bytes_per_s,
                                             "qr_flops_per_s": preset.qr_flops_per_s}}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m edgc_bench.gpu", description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True, help="folder for the JSON files and the trace")
    parser.add_argument("--sizes", default="medium,large,xl", help="GPT-2 sizes for the engine figures")
    parser.add_argument("--ranks", default="4,8,16,32,64")
    parser.add_argument("--micro-batch", type=int, default=4)
    parser.add_argument("--seq-len", type=int, default=1024)
    parser.add_argument("--timed-steps", type=int, default=8)
    parser.add_argument("--overlap-size", default="small", help="GPT-2 size of the NCCL/gloo runs and the trace")
    parser.add_argument("--parts", default="env,device,overlap,engine")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        parser.error("needs a CUDA GPU")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    parts = args.parts.split(",")
    started = time.perf_counter()
    if "env" in parts:
        (out / "env.json").write_text(json.dumps(environment(), indent=1))
    if "device" in parts:
        (out / "device.json").write_text(json.dumps(device_profile(), indent=1))
    if "overlap" in parts:
        (out / "overlap.json").write_text(json.dumps(overlap(out, 6, args.overlap_size), indent=1))
    if "engine" in parts:
        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        os.environ.setdefault("MASTER_PORT", str(_free_port()))
        dist.init_process_group("nccl", rank=0, world_size=1)
        rows = engine_speed(args.sizes.split(","), [int(r) for r in args.ranks.split(",")], args.micro_batch,
                            args.seq_len, args.timed_steps)
        (out / "engine.json").write_text(json.dumps(rows, indent=1))
        dist.destroy_process_group()
    print(f"edgc_bench.gpu: done in {time.perf_counter() - started:.0f} s; files in {out}", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
