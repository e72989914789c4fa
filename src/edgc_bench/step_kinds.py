"""Every kind of compressed step, counted: kernels, bytes moved and memory per compressed element.

    python -m edgc_bench.step_kinds --out docs/engine/step-kinds.json     # GPT-2 XL, rank 32, a few min
    python scripts/step_kinds_to_docs.py                                   # the engine page's block

On fake tensors (`edgc_bench.dispatch_count.count_hook_step`: the accelerator's path, DDP's default
buckets fused into jobs, bf16 gradients, world size 1): the dispatches (`edgc_bench.dispatch_count`,
the rule the GPU page's counts follow), the bytes every kernel reads and writes (`op_traffic`) and
the most bytes alive at once during the step beyond the gradients, the engine's state and the
step's transient buffers included (`edgc_bench.live_memory`), per compressed gradient element, for:

- ``static``: a steady step of static PowerSGD (no error measured, nothing sampled);
- ``sampled``: a step of adaptive control (held at the rank) that samples the gradients for the
  entropy (GDS) and measures ‖M − Ĝ‖/‖M‖: what a sampled step adds;
- ``rank-change``: the step at which a hand-set schedule halves the rank: the new layout's arena is
  built while the old one lives;
- ``torchft``: a step left uncommitted until the manager's verdict (``defer_commit``), its residual
  written to the spare arena so that M survives for a rollback, then committed;
- ``diloco``: one outer sync of DiLoCo's default method (`edgc.integrations.diloco.DEFAULT_OUTER_SYNC`)
  of every parameter's fp32 pseudo-gradient (per parameter, not per compressed element).

Beside the live tensors, ``process`` runs a step kind on real CPU tensors at the same widths with
``--layers`` blocks and reads the process's peak resident memory during the step
(``/proc/self/status``'s VmHWM, reset before it) beyond what the gradients alone held: what the
allocator and the kernels' own temporaries add, which a count of tensors cannot see.
"""

from __future__ import annotations

import argparse
import gc
import json
import math
import re
from pathlib import Path

import torch

from .dispatch_count import DispatchCounter, StepCount, count_hook_step
from .engine_cost import emit
from .gpt2_layout import gpt2_parameters
from .hook_steps import _static_config, sampled_config
from .live_memory import LiveStorages
from .stand_ins import counting_communicator

KINDS = ("static", "sampled", "rank-change", "torchft")
LIMITS = {"bytes": 32.0, "dispatches": 2000, "memory": 4.4, "rank-change": 8.8, "torchft": 8.4}


def config_of(kind: str, rank: int):
    """The `EDGCConfig` of a step kind (see the module docstring)."""
    from edgc import EDGCConfig

    if kind == "sampled":
        return sampled_config(rank)
    if kind == "rank-change":
        return EDGCConfig(
            r_max=rank,
            total_steps=100_000,
            warmup_fraction=0.0,
            warmup_error_test=False,
            rank_schedule=((0, rank), (RANK_CHANGE_STEP, rank // 2)),
        )
    return _static_config(rank)


RANK_CHANGE_STEP = 3  # the hand-set schedule's change: steps 0-2 at the rank (Q and arenas made), 3 at half


def _hooks(kind: str) -> dict:
    if kind == "rank-change":
        return {"count_step": RANK_CHANGE_STEP}
    if kind == "torchft":  # every step waits for the manager's verdict, here a commit

        def defer(state) -> None:
            state.attach(defer_commit=True)

        return {"prepare": defer, "after_step": lambda state: state.commit_step()}
    return {}


def count_kind(kind: str, model: str = "xl", rank: int = 32) -> StepCount:
    return count_hook_step(gpt2_parameters(model), rank=rank, config=config_of(kind, rank), **_hooks(kind))


def count_outer_sync(model: str = "xl") -> dict:
    """One outer sync of DiLoCo's default method on fp32 pseudo-gradients of every parameter, after one
    that made the error feedback, as one of two replicas (a two-stage sync's owner keeps the error
    feedback of its half of the chunks): dispatches, bytes and memory beyond the pseudo-gradients, per
    parameter."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    from edgc.integrations.diloco import DEFAULT_OUTER_SYNC
    from edgc.sync.sync_methods import sync_method

    from .gpu_support import counted_host_reads
    from .hook_steps import _zeros
    from .stand_ins import NamedParameters

    named = gpt2_parameters(model)
    with counted_host_reads(_zeros), FakeTensorMode():
        deltas = [torch.empty(shape, dtype=torch.float32) for _, shape in named]
        names = [name for name, _ in named]
        with LiveStorages() as live:
            state = sync_method(DEFAULT_OUTER_SYNC).build(None, model=NamedParameters(list(zip(names, deltas))))
            state.attach(counting_communicator(2))  # two replicas: each owns half the chunks
            state.reduce_tensors(names, deltas, last=True)
            state.settle()
            live.reset_peak()
            with DispatchCounter() as counter:
                state.reduce_tensors(names, deltas, last=True)
            state.settle()
    params = sum(math.prod(shape) for _, shape in named)
    return {
        "method": DEFAULT_OUTER_SYNC,
        "params": params,
        "dispatches": counter.total,
        "bytes_per_param": round(counter.total_bytes / params, 3),
        "memory_per_param": round(live.peak_bytes / params, 3),
        "bytes_sent_per_param": round(state.last_step_metrics["bytes_sent"] / params, 4),
    }


# ---------------------------------------------------------------------------- the process's peak
def _block(name: str) -> int | None:
    """The transformer block a GPT-2 parameter belongs to, or None (embeddings, the last norm)."""
    found = re.match(r"transformer\.h\.(\d+)\.", name)
    return int(found.group(1)) if found else None


def _resident_kib(field: str) -> int:
    return int(re.search(rf"{field}:\s+(\d+)", Path("/proc/self/status").read_text()).group(1))


def process_peak(kind: str, layers: int = 2, rank: int = 32, steps: int = 3) -> dict:
    """``kind``'s step on real CPU tensors, GPT-2 XL widths with ``layers`` blocks: the process's peak
    resident bytes during the counted step beyond those held with the gradients alone, per
    compressed element (Linux: VmHWM reset through /proc/self/clear_refs)."""
    from edgc import EDGCState

    from .dispatch_count import as_on_an_accelerator
    from .stand_ins import GradBucketStandIn, NamedParameters, ddp_buckets, ready_order

    named = [(n, s) for n, s in gpt2_parameters("xl") if _block(n) is None or _block(n) < layers]
    names, shapes = [n for n, _ in named], [tuple(s) for _, s in named]
    layout = ddp_buckets(shapes, ready_order(names), torch.bfloat16, None)
    parameters = [torch.zeros(shape, dtype=torch.bfloat16) for shape in shapes]
    buckets = [
        GradBucketStandIn(k, [parameters[i] for i in indices], torch.bfloat16, last=k == len(layout) - 1)
        for k, indices in enumerate(layout)
    ]
    generator = torch.Generator().manual_seed(0)
    for bucket in buckets:
        bucket.buffer().normal_(generator=generator)
    gc.collect()
    held = _resident_kib("VmRSS")
    config = as_on_an_accelerator(config_of(kind, rank))
    state = EDGCState(None, config, model=NamedParameters(list(zip(names, parameters))))
    state.attach(counting_communicator())
    hooks = _hooks(kind)
    if "prepare" in hooks:
        hooks["prepare"](state)
    target = hooks.get("count_step", steps)
    while True:
        counted = state.step == target
        if counted:
            gc.collect()
            Path("/proc/self/clear_refs").write_text("5")
        for bucket in buckets:
            bucket.buffer().normal_(generator=generator)
            state.reduce_bucket(bucket)
        metrics = state.last_step_metrics
        if "after_step" in hooks:
            hooks["after_step"](state)
        if counted:
            break
    compressed = sum(math.prod(s) for n, s in zip(names, shapes) if metrics["ranks"].get(n))
    peak = _resident_kib("VmHWM") - held
    return {
        "layers": layers,
        "compressed_elements": compressed,
        "peak_beyond_gradients": round(peak * 1024 / compressed, 3),
    }


def _peak_in_a_new_process(kind: str, layers: int, rank: int) -> dict:
    """`process_peak` in a process of its own (a clean heap: nothing of another count's allocations)."""
    import subprocess
    import sys

    command = [sys.executable, "-m", "edgc_bench.step_kinds", "--process-peak", kind, "--layers", str(layers)]
    done = subprocess.run([*command, "--rank", str(rank)], capture_output=True, text=True, check=True)
    return json.loads(done.stdout.strip().splitlines()[-1])


def measure(model: str = "xl", rank: int = 32, layers: int = 8, progress=print) -> dict:
    """The figures of the module docstring, as ``--out`` writes them."""
    from dataclasses import replace

    kinds = {}
    for kind in KINDS:
        count = count_kind(kind, model, rank)
        kinds[kind] = {
            "dispatches": count.dispatches,
            "bytes": round(count.per_compressed_element(count.bytes), 3),
            "memory": round(count.per_compressed_element(count.peak_state_bytes), 3),
            "rank": count.rank,
            "process": _peak_in_a_new_process(kind, layers, rank),
        }
        progress(f"{kind}: {kinds[kind]}")
    small = replace(config_of("sampled", rank), entropy_sample_cap=SMALL_CAP)
    count = count_hook_step(gpt2_parameters(model), rank=rank, config=small)
    small_cap = {
        "entropy_sample_cap": SMALL_CAP,
        "dispatches": count.dispatches,
        "bytes": round(count.per_compressed_element(count.bytes), 3),
        "memory": round(count.per_compressed_element(count.peak_state_bytes), 3),
    }
    from edgc import EDGCConfig

    return {
        "model": model,
        "rank": rank,
        "dtype": "bfloat16",
        "torch": torch.__version__,
        "entropy_sample_cap": EDGCConfig().entropy_sample_cap,
        "limits": LIMITS,
        "kinds": kinds,
        "sampled_small_cap": small_cap,
        "diloco": count_outer_sync(model),
    }


SMALL_CAP = 1 << 20  # the entropy sample a report-only estimate takes (`edgc.control.entropy.REPORT_SAMPLE_CAP`)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m edgc_bench.step_kinds", description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="xl")
    parser.add_argument("--rank", type=int, default=32)
    parser.add_argument("--layers", type=int, default=8, help="blocks of the real-tensor run (the process's peak)")
    parser.add_argument("--process-peak", choices=KINDS, help="only this kind's process peak, as one JSON line")
    parser.add_argument("--out", type=Path, help="write the figures as JSON here")
    args = parser.parse_args(argv)
    if args.process_peak:
        print(json.dumps(process_peak(args.process_peak, args.layers, args.rank)))
        return 0
    emit(measure(args.model, args.rank, args.layers), args.out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
