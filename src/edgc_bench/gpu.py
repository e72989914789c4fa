"""`python -m edgc_bench.gpu --out DIR`: the CUDA path measured on one GPU (docs/gpu.md).

One command, one GPU; every figure is a file under DIR, which scripts/gpu_to_docs.py copies into
docs/gpu.md and the README:
- ``env.json``      device, driver, torch, CUDA and NCCL versions;
- ``device.json``   `edgc_sim`'s host profile measured on the GPU, beside the simulator's h100 preset;
- ``count.json``    the dispatches of one compressed step predicted on the CPU (`edgc_bench.dispatch_count`;
                    computed in a background process while the GPU parts run);
- ``overlap.json``, ``trace_gloo.json.gz``, ``trace_nccl.json.gz``  does backward wait for the
                    collectives? (`edgc_bench.gpu_overlap`);
- ``engine.json``   EDGC's hook against ``powerSGD_hook`` at GPT-2 sizes (`edgc_bench.gpu_engine`);
- ``orth.json``     the engine's orthonormalisation against batched Householder QR: accuracy and
                    time on the device (`edgc_bench.orthonormalization`);
- ``outer.json``    one DiLoCo outer step at GPT-2 sizes: its time and its memory beyond the
                    training state, for the default outer sync and a bf16 cast (`edgc_bench.gpu_outer`).

Each part runs in its own ``try``, so one failure keeps the others' files; each has a time budget,
printed with the time it took (the engine part stops where its budget ends). The exit status is 1
if any part failed. ``--count-only`` writes count.json alone (CPU, no GPU needed). ``--smoke`` runs
every part's logic on the CPU with a tiny GPT-2 and gloo (the suite does, so the bench cannot rot).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import time
import traceback
from pathlib import Path

import torch

# Seconds per part on an H100, so that the whole run stays near 6 minutes (the first run's engine
# part, 2 ranks and 3 sizes, took 184 s). The engine part stops where its budget ends; the
# count runs beside the others on the CPU.
BUDGETS = {"env": 10, "device": 40, "count": 240, "overlap": 100, "engine": 220, "orth": 30, "outer": 150}
PARTS = ("env", "device", "count", "overlap", "engine", "orth", "outer")


def environment(cuda: bool) -> dict:
    found = {
        "torch": torch.__version__,
        "python": platform.python_version(),
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
    }
    if not cuda:
        return {"device": "cpu (smoke run)", **found}
    smi = subprocess.run(
        ["nvidia-smi", "--query-gpu=name,driver_version,memory.total,clocks.max.sm", "--format=csv,noheader"],
        capture_output=True,
        text=True,
    ).stdout.strip()
    props = torch.cuda.get_device_properties(0)
    return {
        "device": torch.cuda.get_device_name(0),
        "nvidia_smi": smi,
        "driver": smi.split(", ")[1] if smi else None,
        "cuda": torch.version.cuda,
        "nccl": ".".join(map(str, torch.cuda.nccl.version())),
        "multiprocessors": props.multi_processor_count,
        "memory_gib": round(props.total_memory / 2**30, 1),
        **found,
    }


def device_profile() -> dict:
    """The simulator's host measurements, taken on the GPU, beside its h100 preset."""
    from edgc_sim.hardware import DEVICES
    from edgc_sim.host import measure_cuda

    if not torch.cuda.is_available():
        raise RuntimeError("the device profile needs a CUDA GPU")
    preset = DEVICES["h100"]
    fields = (
        "name",
        "matmul_flops",
        "mfu",
        "mem_bytes_per_s",
        "launch_s",
        "skinny_read_bytes_per_s",
        "skinny_write_bytes_per_s",
        "skinny_flops_per_s",
        "orth_flops_per_s",
    )
    measured = measure_cuda()
    torch.cuda.empty_cache()
    return {"measured": measured, "preset": {name: getattr(preset, name) for name in fields}}


def count(args) -> dict:
    from .dispatch_count import count_report

    return count_report(
        args.sizes, args.bucket_caps, rank=args.goal_rank, progress=lambda line: print(line, flush=True)
    )


class CountInBackground:
    """count.json from ``--count-only`` in a process of its own (CPU only), while the GPU parts run."""

    def __init__(self, args):
        command = [
            sys.executable,
            "-m",
            "edgc_bench.gpu",
            "--count-only",
            "--out",
            str(args.out),
            "--sizes",
            ",".join(args.sizes),
            "--bucket-cap-mb",
            args.bucket_cap_mb,
            "--goal-rank",
            str(args.goal_rank),
        ]
        self.process = subprocess.Popen(command, env={**os.environ, "OMP_NUM_THREADS": "1", "CUDA_VISIBLE_DEVICES": ""})

    def result(self, timeout: float) -> None:
        try:
            status = self.process.wait(timeout=max(timeout, 1))
        except subprocess.TimeoutExpired:
            self.process.kill()
            raise RuntimeError(f"the dispatch count did not finish within its budget ({timeout:.0f} s left)") from None
        if status:
            raise RuntimeError(f"the dispatch count exited with status {status}")


def run_part(name: str, out: Path, measure, budget: float, failures: list) -> None:
    """``measure()`` into ``out/<name>.json``; if it raises, its error goes there too, beside what
    the part wrote so far (the engine part writes as it goes). ``measure`` may return None when the
    part writes its file itself."""
    started = time.perf_counter()
    print(f"== part {name}: budget {budget:.0f} s", flush=True)
    path = out / f"{name}.json"
    try:
        result = measure()
    except Exception:
        result = json.loads(path.read_text()) if path.exists() else {}
        result = {
            **(result if isinstance(result, dict) else {"partial": result}),
            "error": traceback.format_exc(limit=12),
        }
        failures.append(name)
        print(result["error"], flush=True)
    if result is not None:
        path.write_text(json.dumps(result, indent=1, default=str))
    took = time.perf_counter() - started
    print(f"== part {name}: {took:.0f} s of {budget:.0f} s{' (over budget)' if took > budget else ''}", flush=True)


def orthonormalization(smoke: bool) -> dict:
    from .orthonormalization import compare

    if smoke:
        return {"device": "cpu (smoke run)", "rows": compare(torch.device("cpu"), shapes=((2, 4, 64),), repeats=1)}
    return {"device": torch.cuda.get_device_name(0), "rows": compare(torch.device("cuda"))}


def engine_settings(args) -> dict:
    return {
        "cuda": not args.smoke,
        "sizes": args.sizes,
        "ranks": args.ranks,
        "goal_rank": args.goal_rank,
        "bucket_caps": args.bucket_caps,
        "micro_batch": args.micro_batch,
        "seq_len": args.seq_len,
        "timed": args.timed_steps,
        "skip_steps": args.skip_steps,
    }


def outer_settings(args) -> dict:
    from edgc.integrations.diloco import DEFAULT_OUTER_SYNC

    return {
        "cuda": not args.smoke,
        "sizes": args.outer_sizes.split(","),
        "methods": [DEFAULT_OUTER_SYNC, "bf16"],
        "micro_batch": 1,
        "seq_len": min(args.seq_len, 512),
    }


def overlap_settings(args) -> dict:
    return {
        "cuda": not args.smoke,
        "size": args.overlap_size,
        "rank": args.overlap_rank,
        "steps": args.overlap_steps,
        "micro_batch": args.micro_batch,
        "seq_len": min(args.seq_len, 1024),
    }


# A smoke run's first bucket size holds the tiny model in one bucket: on gloo, powerSGD_hook's
# callbacks wait for collectives on gloo's two worker threads, so two buckets in flight deadlock.
SMOKE = {
    "sizes": "tiny",
    "ranks": "4",
    "goal_rank": 4,
    "bucket_cap_mb": "100,0.25",
    "micro_batch": 2,
    "seq_len": 32,
    "timed_steps": 2,
    "overlap_size": "tiny",
    "overlap_rank": 4,
    "overlap_steps": 2,
    "delay_ms": 1.0,
    "outer_sizes": "tiny",
    "parts": "env,count,overlap,engine,orth,outer",
}


def parse(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m edgc_bench.gpu", description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True, help="folder for the JSON files and the traces")
    parser.add_argument("--smoke", action="store_true", help="on the CPU: tiny GPT-2, gloo, a few steps")
    parser.add_argument("--count-only", action="store_true", help="count.json only (CPU)")
    parser.add_argument("--parts", default=",".join(PARTS))
    parser.add_argument("--sizes", default="medium,large,xl", help="GPT-2 sizes (run largest first)")
    parser.add_argument("--ranks", default="4,8,16,32,64")
    parser.add_argument(
        "--goal-rank", type=int, default=32, help="rank of the goals, the kernel counts and the bucket sizes"
    )
    parser.add_argument(
        "--bucket-cap-mb",
        default="default,100,200",
        help="DDP bucket sizes; 'default' is DDP's own (25 MB, a first bucket of 1 MB)",
    )
    parser.add_argument("--micro-batch", type=int, default=4)
    parser.add_argument("--seq-len", type=int, default=1024)
    parser.add_argument("--timed-steps", type=int, default=5)
    parser.add_argument("--overlap-size", default="small", help="GPT-2 size of the overlap runs")
    parser.add_argument("--overlap-rank", type=int, default=16)
    parser.add_argument("--overlap-steps", type=int, default=4, help="timed steps without and with the delay")
    parser.add_argument("--delay-ms", type=float, default=2.0, help="injected delay per all-reduce in the NCCL run")
    parser.add_argument(
        "--skip-steps", action="store_true", help="engine part: the hooks alone only, no training steps"
    )
    parser.add_argument("--outer-sizes", default="xl,medium", help="GPT-2 sizes of the DiLoCo outer step")
    smoke = "--smoke" in (argv if argv is not None else sys.argv[1:])
    if smoke:
        parser.set_defaults(**SMOKE)
    args = parser.parse_args(argv)
    if not smoke and not args.count_only and not torch.cuda.is_available():
        parser.error("needs a CUDA GPU (or --smoke, or --count-only)")
    from .gpt2_layout import GPT2_SIZES

    args.sizes = sorted(args.sizes.split(","), key=lambda size: -GPT2_SIZES[size][1])
    args.ranks = [int(r) for r in args.ranks.split(",")]
    args.bucket_caps = [None if cap == "default" else float(cap) for cap in args.bucket_cap_mb.split(",")]
    return args


def main(argv: list[str] | None = None, runner=None) -> int:
    """``runner(fn, world_size, backend, *args, timeout=seconds)`` runs a distributed part (default:
    `spawn_group`, new processes; the suite passes its process pool)."""
    from .gpu_engine import engine
    from .gpu_overlap import overlap
    from .gpu_support import spawn_group

    args, failures, started = parse(argv), [], time.perf_counter()
    runner = runner or spawn_group
    args.out.mkdir(parents=True, exist_ok=True)
    parts = ["count"] if args.count_only else args.parts.split(",")
    if "env" in parts:
        run_part("env", args.out, lambda: environment(not args.smoke), BUDGETS["env"], failures)
    if "device" in parts:  # before the count starts beside it: this part times the host's issue rate
        run_part("device", args.out, device_profile, BUDGETS["device"], failures)
    background, count_started = None, time.perf_counter()
    if "count" in parts and not (args.smoke or args.count_only):
        background = CountInBackground(args)
    elif "count" in parts:
        run_part("count", args.out, lambda: count(args), BUDGETS["count"], failures)
    if "overlap" in parts:
        settings = overlap_settings(args)
        run_part(
            "overlap",
            args.out,
            lambda: overlap(args.out, settings, args.delay_ms, runner, BUDGETS["overlap"] / 2),
            BUDGETS["overlap"],
            failures,
        )
    if "engine" in parts:
        backend, partial, budget = "gloo" if args.smoke else "nccl", str(args.out / "engine.json"), BUDGETS["engine"]
        run_part(
            "engine",
            args.out,
            lambda: runner(engine, 1, backend, engine_settings(args), budget, partial, timeout=budget + 90)[0],
            budget + 90,
            failures,
        )
    if "orth" in parts:
        run_part("orth", args.out, lambda: orthonormalization(args.smoke), BUDGETS["orth"], failures)
    if "outer" in parts:
        from .gpu_outer import outer

        backend, budget = "gloo" if args.smoke else "nccl", BUDGETS["outer"]
        run_part(
            "outer",
            args.out,
            lambda: runner(outer, 1, backend, outer_settings(args), timeout=budget)[0],
            budget,
            failures,
        )
    if background is not None:
        left = BUDGETS["count"] - (time.perf_counter() - count_started)
        run_part("count", args.out, lambda: background.result(left), max(left, 0), failures)
    print(
        f"edgc_bench.gpu: {time.perf_counter() - started:.0f} s; files in {args.out}"
        f"{'; failed: ' + ', '.join(failures) if failures else ''}",
        flush=True,
    )
    return 1 if failures else 0


if __name__ == "__main__":
    raise SystemExit(main())
