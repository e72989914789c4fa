"""HBM bytes of one compressed step, read by Nsight Compute from the GPU's DRAM counters.

    python -m edgc_bench.gpu_hbm --out DIR [--model xl] [--rank 32] [--methods edgc,edgc-sampled]

For each method, a process of its own runs under ``ncu`` (``--profile-from-start off``): GPT-2
``--model``'s parameter shapes with random bf16 gradients in DDP's default buckets, the hook warmed
up (`edgc_bench.gpu_engine.PreparedHook`), then one call between ``cudaProfilerStart`` and
``cudaProfilerStop``; ncu reads ``dram__bytes_read.sum`` and ``dram__bytes_write.sum`` of every
kernel in it. The sum is divided by the compressed elements (every matrix of ≥ 2 dimensions: at rank
32 all of GPT-2's are compressed), the unit of the CPU's count (`edgc_bench.engine_cost`). The
gradients' restore before the call is outside the profiled range; the one-process NCCL
all-reduce's kernels are inside it and counted. Writes ``DIR/hbm.json``.
"""

from __future__ import annotations

import argparse
import csv
import io
import json
import math
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import torch

METRICS = ("dram__bytes_read.sum", "dram__bytes_write.sum")


def workload(model: str, rank: int, method: str) -> None:
    """The profiled process: one warmed-up hook call inside the profiler's range (on a CPU, with
    gloo and no profiler: what a smoke run checks). Joins a process group of one unless one exists."""
    import torch.distributed as dist

    from edgc_probes.gpt2_layout import gpt2_parameters

    from .gpu_engine import PreparedHook
    from .gpu_support import free_port

    cuda = torch.cuda.is_available()
    owned = not dist.is_initialized()
    if cuda:
        torch.cuda.set_device(0)
    if owned:
        backend = "nccl" if cuda else "gloo"
        dist.init_process_group(backend, init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1)
    torch.manual_seed(0)
    device = "cuda" if cuda else "cpu"
    saved = [
        (name, torch.randn(shape, device=device, dtype=torch.bfloat16) * 1e-3) for name, shape in gpt2_parameters(model)
    ]
    hook = PreparedHook(saved, method, torch.bfloat16, rank, None)
    hook.warm_up()
    hook.restore()
    if cuda:
        torch.cuda.synchronize()
        torch.cuda.profiler.start()
    hook.call()
    if cuda:
        torch.cuda.synchronize()
        torch.cuda.profiler.stop()
    if owned:
        dist.destroy_process_group()


def parse(text: str) -> list[dict]:
    """Per-kernel rows of ncu's ``--csv --page raw --print-units base`` output (a units row after
    the header is skipped, numbers may carry thousands separators)."""
    lines = [line for line in text.splitlines() if line.startswith('"')]
    rows = list(csv.DictReader(io.StringIO("\n".join(lines))))
    kernels = []
    for row in rows:
        try:
            values = {metric: float(row[metric].replace(",", "")) for metric in METRICS}
        except (KeyError, ValueError):
            continue  # the units row, or a kernel ncu could not read
        kernels.append({"name": row.get("Kernel Name", "")[:100], **values})
    return kernels


NCU_PATHS = ("/usr/local/cuda/bin/ncu",)


def ncu_path() -> str | None:
    """Nsight Compute's command line, or None where it is not installed."""
    return shutil.which("ncu") or next((path for path in NCU_PATHS if os.path.exists(path)), None)


def kernel_filter(names: list[str]) -> list[str]:
    """ncu's arguments that profile only the kernels of ``names`` (the profiler's demangled names),
    matched by their function names; none for an empty list (every kernel)."""
    functions = sorted({name.removeprefix("void ").split("(")[0].split("<")[0].split("::")[-1] for name in names})
    functions = [f for f in functions if f]
    if not functions:
        return []
    return ["--kernel-name-base", "function", "--kernel-name", "regex:^(" + "|".join(map(re.escape, functions)) + ")$"]


def measure(model: str, rank: int, method: str, timeout: float, kernels: list[str] | None = None) -> dict:
    """``method``'s hook call under ncu: bytes per kernel, summed; only the kernels named in
    ``kernels`` (`kernel_filter`) when given."""
    from edgc_probes.gpt2_layout import gpt2_parameters

    command = [
        ncu_path() or "ncu",
        "--profile-from-start",
        "off",
        "--target-processes",
        "all",
        *kernel_filter(kernels or []),
        "--clock-control",
        "none",
        "--metrics",
        ",".join(METRICS),
        "--csv",
        "--page",
        "raw",
        "--print-units",
        "base",
        sys.executable,
        "-m",
        "edgc_bench.gpu_hbm",
        "--workload",
        "--model",
        model,
        "--rank",
        str(rank),
        "--methods",
        method,
    ]
    done = subprocess.run(command, capture_output=True, text=True, timeout=timeout, env=dict(os.environ))
    kernels = parse(done.stdout)
    if not kernels:
        raise RuntimeError(f"ncu read no kernel (exit {done.returncode}): {done.stderr[-2000:]}{done.stdout[-2000:]}")
    elements = sum(math.prod(shape) for _, shape in gpt2_parameters(model) if len(shape) >= 2)
    read = sum(k[METRICS[0]] for k in kernels)
    written = sum(k[METRICS[1]] for k in kernels)
    top = sorted(kernels, key=lambda k: -(k[METRICS[0]] + k[METRICS[1]]))[:10]
    return {
        "model": model,
        "rank": rank,
        "method": method,
        "only_kernels": kernel_filter(kernels or [])[3:] or None,
        "source": "Nsight Compute (dram__bytes_read.sum + dram__bytes_write.sum per kernel)",
        "kernels": len(kernels),
        "compressed_elements": elements,
        "bytes_read": read,
        "bytes_written": written,
        "bytes_per_compressed_element": (read + written) / elements,
        "top": [[k["name"], k[METRICS[0]] + k[METRICS[1]]] for k in top],
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m edgc_bench.gpu_hbm", description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path)
    parser.add_argument("--model", default="xl")
    parser.add_argument("--rank", type=int, default=32)
    parser.add_argument("--methods", default="edgc,edgc-sampled")
    parser.add_argument("--timeout", type=float, default=150, help="seconds per method under ncu")
    parser.add_argument("--workload", action="store_true", help="(internal) the process ncu profiles")
    args = parser.parse_args(argv)
    if args.workload:
        workload(args.model, args.rank, args.methods)
        return 0
    if args.out is None:
        parser.error("--out is required")
    args.out.mkdir(parents=True, exist_ok=True)
    result = {"rows": [], "errors": []}
    for method in args.methods.split(","):
        try:
            row = measure(args.model, args.rank, method, args.timeout)
            result["rows"].append(row)
            print("hbm", {k: v for k, v in row.items() if k != "top"}, flush=True)
        except Exception as error:  # noqa: BLE001 — the next method still runs; the error is recorded
            result["errors"].append({"method": method, "error": repr(error)[-3000:]})
            print(f"hbm {method}: failed: {error!r}"[-3000:], flush=True)
        (args.out / "hbm.json").write_text(json.dumps(result, indent=1))
    return 1 if result["errors"] else 0


if __name__ == "__main__":
    raise SystemExit(main())
