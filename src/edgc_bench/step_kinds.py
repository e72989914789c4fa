"""Every kind of compressed step, counted: kernels, bytes moved and memory per compressed element.

    python -m edgc_bench.step_kinds --out docs/engine/step-kinds.json     # GPT-2 XL, rank 32, a few min
    python scripts/to_docs.py step-kinds                                   # the engine page's block

On fake tensors (`edgc_probes.dispatch_count.count_hook_step`: the accelerator's path, DDP's default
buckets fused into jobs, bf16 gradients, world size 1): the dispatches (`edgc_probes.dispatch_count`,
the rule the GPU page's counts follow), the bytes every kernel reads and writes (`op_traffic`) and
the most bytes alive at once during the step beyond the gradients, the engine's state and the
step's transient buffers included (`edgc_probes.live_memory`), per compressed gradient element, for:

- ``static``: a steady step of static PowerSGD (no error measured, nothing sampled);
- ``sampled``: a step of adaptive control (held at the rank) that samples the gradients for the
  entropy (GDS) and measures ‖M − Ĝ‖/‖M‖: what a sampled step adds;
- ``rank-change``: the step at which a hand-set schedule halves the rank: the new layout's arena is
  built while the old one lives;
- ``torchft``: a step left uncommitted until the manager's verdict (``defer_commit``), its residual
  written to the spare arena so that M survives for a rollback, then committed;
- ``diloco``: one outer sync of DiLoCo's default method (`edgc.integrations.diloco.DEFAULT_OUTER_SYNC`)
  of every parameter's fp32 pseudo-gradient (per parameter, not per compressed element), one entry
  per model and number of replica groups (`DILOCO_COUNTS`), and the rollback of one
  (``--diloco-only`` recounts these entries alone in the ``--out`` file).

The hook at the device's pace (``pace``, at GPT-2 medium and XL widths, ``--pace`` alone): a static
step's dispatches eager and with CUDA graphs on (``cuda_graphs``: a graph region the capture checker
passes over four steady steps counts one launch per call, `edgc_probes.dispatch_count`), the dispatches
from entering the last bucket's ``reduce_bucket`` to the step's end (what the host issues once backward
is over), a sampled step's beside it, the host reads of each, and the bytes a sampled step moves beyond
a static one as a share of its own (its entropy sample's gather and histogram and its error
measurement: a bound on the histogram's share).

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
from collections import Counter
from pathlib import Path

import torch

from edgc_probes.dispatch_count import GRAPH_LAUNCH, DispatchCounter, StepCount, count_hook_step
from edgc_probes.gpt2_layout import gpt2_parameters
from edgc_probes.hook_steps import _static_config, sampled_config
from edgc_probes.live_memory import LiveStorages
from edgc_probes.stand_ins import counting_communicator, ddp_buckets, ready_order

from .engine_cost import emit

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


PACE_MODELS = ("medium", "xl")


def pace(model: str = "xl", rank: int = 32, progress=print) -> dict:
    """The hook at the device's pace at ``model``'s widths (the module docstring): static eager, static
    with graphs, sampled."""
    from dataclasses import replace

    named = gpt2_parameters(model)
    static = count_kind("static", model, rank)
    progress(f"{model} static: {static.dispatches} dispatches")
    static_config = config_of("static", rank)
    graphed_config = replace(static_config, engine=replace(static_config.engine, cuda_graphs=True))
    graphed = count_hook_step(named, rank=rank, config=graphed_config, graphs=True)
    progress(f"{model} static with graphs: {graphed.dispatches} dispatches")
    sampled = count_kind("sampled", model, rank)
    progress(f"{model} sampled: {sampled.dispatches} dispatches")
    steps = {"static": static, "static_graphs": graphed, "sampled": sampled}
    return {
        "model": model,
        "rank": rank,
        "buckets": static.buckets,
        "compressed_matrices": static.compressed,
        "dispatches": {kind: count.dispatches for kind, count in steps.items()},
        "after_last_bucket": {kind: count.extra["after_last_bucket"] for kind, count in steps.items()},
        "graph_replays": graphed.by_op.get(GRAPH_LAUNCH, 0),
        "host_reads": {kind: count.host_reads for kind, count in steps.items()},
        "bytes": {kind: round(count.per_compressed_element(count.bytes), 3) for kind, count in steps.items()},
        "memory": {
            kind: round(count.per_compressed_element(count.peak_state_bytes), 3) for kind, count in steps.items()
        },
        "sampled_extra_bytes_share": round((sampled.bytes - static.bytes) / sampled.bytes, 5),
        "floors": floors(named, static, sampled),
        "dtype": "bfloat16",
        "torch": torch.__version__,
    }


PER_GRADIENT_OPS = ("mm", "_foreach_add_")  # Ĝ = P·Qᵀ into each gradient; M = G + e, mixed dtypes: per tensor
ERROR_MEASUREMENT_OPS = ("linalg_vector_norm", "mul")  # a sampled job's ‖M‖ and ‖e‖, each squared
SAMPLE_GATHER_OPS = ("cat",)  # a sampled job's entropy sample; the rest: the histogram, once a step


def floors(named: list, static: StepCount, sampled: StepCount) -> dict:
    """Why a step's dispatches are what they are, from its counts and DDP's layout: the per-gradient ops
    (`PER_GRADIENT_OPS`), how many compressed matrices share a bucket with another of their shape (only
    those could share a batched op without the gradients first copied into one buffer, which would move
    2 × the gradient's element size more bytes per element), and a sampled step's extra by part."""
    names, shapes = [name for name, _ in named], [tuple(shape) for _, shape in named]
    buckets = ddp_buckets(shapes, ready_order(names), torch.bfloat16, None)
    neighbours = 0
    for bucket in buckets:
        per_shape = Counter(shapes[i] for i in bucket if len(shapes[i]) >= 2)
        neighbours += sum(count for count in per_shape.values() if count > 1)
    extra = {op: sampled.by_op.get(op, 0) - static.by_op.get(op, 0) for op in set(sampled.by_op) | set(static.by_op)}
    measurement = sum(extra.get(op, 0) for op in ERROR_MEASUREMENT_OPS)
    gather = sum(extra.get(op, 0) for op in SAMPLE_GATHER_OPS)
    return {
        "per_gradient": sum(static.by_op.get(op, 0) for op in PER_GRADIENT_OPS),
        "matrices_sharing_a_bucket_with_their_shape": neighbours,
        "copy_bytes_per_element": 2 * torch.bfloat16.itemsize,
        "sampled_extra": {
            "error_measurement": measurement,
            "sample_gather": gather,
            "histogram_and_entropy": sampled.dispatches - static.dispatches - measurement - gather,
        },
    }


def histogram_share(model: str, row: dict) -> float:
    """The bytes a sampled step's histogram moves (`edgc.control.histogram.histogram_entropy_on_device` over a
    bf16 sample of ``entropy_sample_cap`` elements, the most a decision's sample holds), as a share of the
    sampled step's bytes in ``row`` (a `pace` row: bytes per compressed element, every matrix compressed)."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    from edgc import EDGCConfig
    from edgc.control.histogram import histogram_entropy_on_device

    config = EDGCConfig()
    matrices = [math.prod(shape) for _, shape in gpt2_parameters(model) if len(shape) >= 2]
    if len(matrices) != row["compressed_matrices"]:
        raise ValueError(f"{model}: {row['compressed_matrices']} matrices compressed of {len(matrices)}")
    with FakeTensorMode():
        sample = torch.empty(config.entropy_sample_cap, dtype=torch.bfloat16)
        with DispatchCounter() as counter:
            histogram_entropy_on_device(sample, config.entropy_bins)
    return round(counter.total_bytes / (row["bytes"]["sampled"] * sum(matrices)), 5)


DILOCO_COUNTS = (("xl", 2), ("xl", 12), ("medium", 2), ("medium", 12))  # (model, replica groups) counted


def count_outer_sync(model: str = "xl", groups: int = 2) -> dict:
    """One outer sync of DiLoCo's default method on fp32 pseudo-gradients of every parameter (one flat
    buffer, as DiLoCo hands them), after one that made the error feedback, as one of ``groups``
    replicas (a two-stage sync's owner keeps the error feedback of its 1/groups of the chunks):
    dispatches, collectives, bytes and memory per parameter (``memory``: the peak beyond the
    pseudo-gradients; ``transient``: beyond the error feedback held too); then the dispatches of
    rolling back an uncommitted sync."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    from edgc.integrations.diloco import DEFAULT_OUTER_SYNC
    from edgc.sync.sync_methods import sync_method
    from edgc_probes.hook_steps import _zeros
    from edgc_probes.host_reads import counted_host_reads
    from edgc_probes.stand_ins import NamedParameters

    named = gpt2_parameters(model)
    names, params = [name for name, _ in named], sum(math.prod(shape) for _, shape in named)
    with counted_host_reads(_zeros), FakeTensorMode():
        flat = torch.empty(params, dtype=torch.float32)
        parts = flat.split([math.prod(shape) for _, shape in named])
        deltas = [part.view(shape) for part, (_, shape) in zip(parts, named)]
        with LiveStorages() as live:
            state = sync_method(DEFAULT_OUTER_SYNC).build(None, model=NamedParameters(list(zip(names, deltas))))
            comm = counting_communicator(groups)
            state.attach(comm)
            state.reduce_tensors(names, deltas, last=True)
            state.settle()
            held, issued = live.live_bytes(), len(comm.issued)
            live.reset_peak()
            with DispatchCounter() as counter:
                state.reduce_tensors(names, deltas, last=True)
            state.settle()
            collectives = len(comm.issued) - issued
        state.attach(defer_commit=True)
        state.reduce_tensors(names, deltas, last=True)
        with DispatchCounter() as rollback:
            state.rollback_step("counted")
    return {
        "method": DEFAULT_OUTER_SYNC,
        "model": model,
        "groups": groups,
        "params": params,
        "dispatches": counter.total,
        "collectives": collectives,
        "rollback_dispatches": rollback.total,
        "bytes_per_param": round(counter.total_bytes / params, 3),
        "memory_per_param": round(live.peak_bytes / params, 3),
        "transient_per_param": round((live.peak_bytes - held) / params, 3),
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
    from edgc_probes.dispatch_count import as_on_an_accelerator
    from edgc_probes.stand_ins import GradBucketStandIn, NamedParameters, ddp_buckets, ready_order

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


def measure_kinds(model: str = "xl", rank: int = 32, layers: int = 8, progress=print) -> dict:
    """The hook's step kinds (and the sampled step at a small cap), as ``--out`` holds them."""
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
    }


def measure(model: str = "xl", rank: int = 32, layers: int = 8, progress=print) -> dict:
    """The figures of the module docstring, as ``--out`` writes them."""
    result = {
        **measure_kinds(model, rank, layers, progress),
        "diloco": [count_outer_sync(m, groups) for m, groups in DILOCO_COUNTS],
        "pace": {size: pace(size, rank, progress) for size in PACE_MODELS},
    }
    for size, row in result["pace"].items():
        row["histogram_bytes_share"] = histogram_share(size, row)
    return result


SMALL_CAP = 1 << 20  # the entropy sample a report-only estimate takes (`edgc.control.entropy.REPORT_SAMPLE_CAP`)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m edgc_bench.step_kinds", description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="xl")
    parser.add_argument("--rank", type=int, default=32)
    parser.add_argument("--layers", type=int, default=8, help="blocks of the real-tensor run (the process's peak)")
    parser.add_argument("--process-peak", choices=KINDS, help="only this kind's process peak, as one JSON line")
    parser.add_argument("--out", type=Path, help="write the figures as JSON here")
    parser.add_argument("--pace", action="store_true", help="only the pace figures, into --out's 'pace' (kept else)")
    parser.add_argument("--models", nargs="*", default=PACE_MODELS, help="the pace's model widths (none: shares only)")
    parser.add_argument("--kinds-only", action="store_true", help="recount the step kinds of --out alone")
    parser.add_argument("--diloco-only", action="store_true", help="recount the diloco entries of --out alone")
    args = parser.parse_args(argv)
    if args.diloco_only or args.kinds_only:
        figures = json.loads(args.out.read_text()) if args.out and args.out.exists() else {}
        if args.kinds_only:
            figures.update(measure_kinds(args.model, args.rank, args.layers))
        if args.diloco_only:
            figures["diloco"] = [count_outer_sync(m, groups) for m, groups in DILOCO_COUNTS]
        emit(figures, args.out)
        return 0
    if args.process_peak:
        print(json.dumps(process_peak(args.process_peak, args.layers, args.rank)))
        return 0
    if args.pace:
        figures = json.loads(args.out.read_text()) if args.out is not None and args.out.exists() else {}
        figures["pace"] = {**figures.get("pace", {}), **{model: pace(model, args.rank) for model in args.models}}
        for model, row in figures["pace"].items():
            row["histogram_bytes_share"] = histogram_share(model, row)
        emit(figures, args.out)
        return 0
    emit(measure(args.model, args.rank, args.layers), args.out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
