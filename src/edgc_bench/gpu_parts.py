"""The parts of the GPU run (`python -m edgc_bench.gpu`), one registry: what each measures, its time
limit, its file, and the function that measures it.

    python -m edgc_bench.gpu_parts NAME --out DIR --settings JSON     # one part (what edgc_bench.gpu runs)

Each part runs in a process of its own (`edgc_bench.gpu` kills it at its limit) and writes
``DIR/<NAME>.json`` as it goes (`edgc_bench.gpu_record.Record`). A part with ``group`` runs in a
process group of one (NCCL on a GPU, gloo on a CPU), joined before it and left after it.
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import platform
import subprocess
import sys
import time
import traceback
from dataclasses import dataclass
from pathlib import Path

import torch

from .gpu_record import Record, write_json


@dataclass(frozen=True)
class Part:
    """One part: ``limit_s`` seconds at most on the device; ``function`` ("module:name" in edgc_bench,
    imported when the part runs) fills the part's `Record` from its settings."""

    name: str
    limit_s: float
    group: bool
    default: bool
    what: str
    function: str

    def measure(self, record: Record, settings: dict) -> None:
        module, name = self.function.split(":")
        getattr(importlib.import_module(f"edgc_bench.{module}"), name)(record, settings)


def _commit() -> str | None:
    """The checkout's commit, where it is a git checkout (the device's copy may not be)."""
    try:
        done = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return done.stdout.strip() or None


def env_part(record: Record, settings: dict) -> None:
    """The device, driver, torch, CUDA and NCCL versions, and which options this build has."""
    from edgc.integrations.diloco import DEFAULT_OUTER_SYNC

    from .gpu_hook import graphs_option

    found = {"torch": torch.__version__, "python": platform.python_version()}
    found["date"] = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
    found["cuda_graphs_option"] = graphs_option()
    found["default_outer_sync"] = DEFAULT_OUTER_SYNC
    found["commit"] = _commit()
    if not settings["cuda"]:
        record.data.update({"device": "cpu (smoke run)", **found})
        return record.save()
    smi = subprocess.run(
        ["nvidia-smi", "--query-gpu=name,driver_version,memory.total,clocks.max.sm", "--format=csv,noheader"],
        capture_output=True,
        text=True,
    ).stdout.strip()
    props = torch.cuda.get_device_properties(0)
    record.data.update(
        {
            "device": torch.cuda.get_device_name(0),
            "nvidia_smi": smi,
            "driver": smi.split(", ")[1] if smi else None,
            "cuda": torch.version.cuda,
            "nccl": ".".join(map(str, torch.cuda.nccl.version())),
            "multiprocessors": props.multi_processor_count,
            "memory_gib": round(props.total_memory / 2**30, 1),
            **found,
        }
    )
    record.save()


def device_part(record: Record, settings: dict) -> None:
    """The simulator's host profile on the GPU (`edgc_bench.gpu_extras.device_profile`)."""
    from .gpu_extras import device_profile

    record.data.update(device_profile(settings["cuda"]))
    record.save()


# In the order of their value: a run cut short keeps the first. The default parts' limits fit 500 s.
PARTS = (
    Part("env", 15, False, True, "device, driver, torch, CUDA, NCCL; the build's options", "gpu_parts:env_part"),
    Part(
        "hook",
        150,
        True,
        True,
        "EDGC's hook at GPT-2 XL rank 32, bf16, DDP default/100/200 MB buckets, eager and CUDA graphs: "
        "the step's added time and drain against backward, the hook alone (device, host, dispatches, kernels)",
        "gpu_hook:hook_part",
    ),
    Part(
        "sampled",
        50,
        True,
        True,
        "a sampled step against a static one: time, kernels, host reads",
        "gpu_hook:sampled_part",
    ),
    Part(
        "outer",
        105,
        True,
        True,
        "one DiLoCo outer step of the default method at XL and the largest model that fits: time, "
        "dispatches, peak memory beyond the training state",
        "gpu_outer:outer_part",
    ),
    Part(
        "tests",
        130,
        False,
        True,
        "tests/gpu (set_sync_debug_mode('error') inside), then under TORCH_CUDA_SANITIZER=1",
        "gpu_checks:tests_part",
    ),
    Part(
        "ncu",
        50,
        False,
        True,
        "Nsight Compute: HBM bytes of the histogram's kernels, then of a static step",
        "gpu_checks:ncu_part",
    ),
    Part("device", 40, False, False, "edgc_sim's host profile measured on the GPU", "gpu_parts:device_part"),
    Part(
        "count",
        240,
        False,
        False,
        "the dispatches of one step counted on the CPU (fake tensors)",
        "gpu_extras:count_part",
    ),
    Part(
        "overlap",
        100,
        False,
        False,
        "does backward wait for the collectives (gloo pair, delayed NCCL)",
        "gpu_extras:overlap_part",
    ),
    Part("engine", 220, True, False, "EDGC against powerSGD_hook at GPT-2 sizes and ranks", "gpu_extras:engine_part"),
    Part("orth", 30, False, False, "the orthonormalisation against batched Householder QR", "gpu_extras:orth_part"),
)
BY_NAME = {part.name: part for part in PARTS}
DEFAULT_PARTS = tuple(part.name for part in PARTS if part.default)


def measured(part: Part, record: Record, settings: dict) -> None:
    """``part.measure``; an exception is recorded in the part's file too, then raised."""
    try:
        part.measure(record, settings)
    except BaseException:
        record.data["errors"].append({"part": part.name, "error": traceback.format_exc(limit=12)})
        record.save()
        raise


def run_in_group(rank: int, world_size: int, name: str, settings: dict, out: str) -> None:
    """Part ``name`` in this process (rank 0 of a group of one, if one exists): in a process group of
    one of its own if it asks for one and none exists."""
    import torch.distributed as dist

    part = BY_NAME[name]
    record = Record(Path(out), name, settings)
    if not part.group or dist.is_initialized():
        return measured(part, record, settings)
    import edgc

    from .gpu_support import GROUP_TIMEOUT, free_port

    cuda = settings["cuda"]
    if cuda:
        torch.cuda.set_device(0)
    dist.init_process_group(
        "nccl" if cuda else "gloo",
        init_method=f"tcp://127.0.0.1:{free_port()}",
        rank=0,
        world_size=1,
        timeout=GROUP_TIMEOUT,
    )
    try:
        measured(part, record, settings)
    finally:
        edgc.barrier_before_exit()
        dist.destroy_process_group()


def command(name: str, out: Path, settings: dict) -> list[str]:
    """The command line that runs part ``name`` in a process of its own."""
    return [sys.executable, "-m", "edgc_bench.gpu_parts", name, "--out", str(out), "--settings", json.dumps(settings)]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m edgc_bench.gpu_parts", description=__doc__.splitlines()[0])
    parser.add_argument("name", choices=sorted(BY_NAME))
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--settings", required=True, help="the part's settings, as JSON")
    args = parser.parse_args(argv)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    run_in_group(0, 1, args.name, json.loads(args.settings), str(args.out))
    return 0


__all__ = ["BY_NAME", "DEFAULT_PARTS", "PARTS", "Part", "command", "run_in_group", "write_json"]

if __name__ == "__main__":
    raise SystemExit(main())
