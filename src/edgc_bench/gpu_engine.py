"""The engine part of the GPU bench: EDGC's hook against PyTorch's ``powerSGD_hook`` at GPT-2 sizes.

Two measurements per model, DDP on a process group of one (NCCL on the GPU):
- ``steps``: a training step (forward + backward, bf16) with no hook, with EDGC and (on the
  largest model) with ``powerSGD_hook``, at the goal rank, per DDP bucket size. The hook's cost to
  the step is hooked − plain; with it the backward time, kernels per step (profiler) and memory.
- ``hook_alone``: each hook on its own, over one backward's real gradients laid out in DDP's
  buckets (`edgc_probes.stand_ins.ddp_buckets`) and restored before every call: seconds per
  step, kernels, memory beyond the gradients. Both hooks run on bf16 and on fp32 copies of the
  same gradients, since ``powerSGD_hook`` orthogonalises half precision by Gram–Schmidt in half
  precision and fp32 by a QR, while EDGC computes in fp32 either way. Every rank at DDP's default
  buckets, the goal rank at the other bucket sizes.

The plan runs the largest model first, the goal rank before the other ranks, and stops where its
time budget ends, recording what it skipped. ``powerSGD_hook`` runs on NCCL here; on gloo (a
smoke run) its callbacks wait for collectives on gloo's two worker threads, so two buckets in
flight deadlock: smoke runs give it one bucket.
"""

from __future__ import annotations

import gc
import time
from collections.abc import Callable

import torch
from torch.nn.parallel import DistributedDataParallel as DDP

from edgc_probes.dispatch_count import sampled_config
from edgc_probes.stand_ins import GradBucketStandIn, NamedParameters, ddp_buckets, ready_order

from .gpu_support import (
    DeviceTimer,
    device_activity_count,
    gpt2,
    kernel_profile,
    median,
    memory_allocated,
    peak_memory,
    vocabulary,
)

# both hooks: 2 uncompressed steps (DDP's bucket rebuild), then one that creates Q and the error feedback
WARMUP_CALLS = 3


def _cap_label(cap: float | None) -> dict:
    return {"bucket_cap_mb": 25 if cap is None else cap, "ddp_default": cap is None}


def _hook_state(method: str, rank: int, named: list | None, model=None, config=None):
    """(state, hook) of ``method``: "edgc", "edgc-bf16-ef" (error feedback in the gradient's dtype),
    "edgc-sampled" (adaptive rank control held at ``rank``, the gradients sampled on every step: what
    a sampled step adds) or "powersgd"; starting to compress at the third step, as the plain runs do.
    ``config``: EDGC's `EDGCConfig` as given (``method`` an EDGC one)."""
    if method == "powersgd":
        from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook as psgd

        return psgd.PowerSGDState(
            process_group=None, matrix_approximation_rank=rank, start_powerSGD_iter=2
        ), psgd.powerSGD_hook
    from edgc import EDGCConfig, EDGCState, LowRankConfig, edgc_hook

    if config is None and method == "edgc-sampled":
        config = sampled_config(rank)
    elif config is None:
        engine = LowRankConfig(error_feedback_dtype="gradient" if method == "edgc-bf16-ef" else "float32")
        config = EDGCConfig.static(rank, total_steps=100_000, warmup_fraction=0.0, engine=engine)
    return EDGCState(None, config, model=model if model is not None else NamedParameters(named)), edgc_hook


# ---------------------------------------------------------------------------- a training step
def _train_steps(ddp, tokens, count: int, timer: DeviceTimer) -> list[tuple[float, float]]:
    """(step, backward) seconds of ``count`` forward + backward steps."""
    marks = []
    for _ in range(count):
        start = timer.mark()
        loss = ddp(input_ids=tokens, labels=tokens).loss
        forward_done = timer.mark()
        loss.backward()
        end = timer.mark()
        ddp.module.zero_grad(set_to_none=False)
        marks.append((start, forward_done, end))
    timer.synchronize()
    return [(timer.seconds(s, e), timer.seconds(f, e)) for s, f, e in marks]


def hooked_step(model, tokens, method: str, rank: int, cap: float | None, timed: int, device) -> dict:
    """A DDP training step with ``method``'s hook ("none": DDP's own all-reduce)."""
    _release(device, collect=True)  # what the last measurement left in reference cycles is not this one's
    ddp = DDP(
        model,
        device_ids=[device.index] if device.type == "cuda" else None,
        bucket_cap_mb=cap,
        gradient_as_bucket_view=True,
    )
    state = None
    if method != "none":
        state, hook = _hook_state(method, rank, None, model=ddp)
        ddp.register_comm_hook(state, hook)
    timer = DeviceTimer(device)
    _train_steps(ddp, tokens, WARMUP_CALLS + 1, timer)
    resident = memory_allocated(device)
    peak_memory(device, reset=True)
    times = _train_steps(ddp, tokens, timed, timer)
    row = {
        "method": method,
        "rank": rank if method != "none" else 0,
        **_cap_label(cap),
        "step_s": median([t for t, _ in times]),
        "backward_s": median([b for _, b in times]),
        "step_s_all": [t for t, _ in times],
        "resident_bytes": resident,
        "peak_bytes": peak_memory(device),
        "kernels": device_activity_count(lambda: _train_steps(ddp, tokens, 1, timer), device),
    }
    if state is not None and hasattr(state, "last_step_metrics"):
        row["phase"], row["edgc_rank"] = state.last_step_metrics["phase"], state.last_step_metrics["rank"]
    ddp = state = None  # released before the next model is hooked
    model.zero_grad(set_to_none=True)
    _release(device, collect=True)
    return row


def against_plain(row: dict, plain: dict) -> dict:
    """The hook's share of a step: hooked − plain at the same bucket size."""

    def minus(key):
        return None if row[key] is None or plain[key] is None else row[key] - plain[key]

    hook_s = row["step_s"] - plain["step_s"]
    return dict(
        row,
        hook_s=hook_s,
        hook_over_backward=hook_s / plain["backward_s"],
        hook_kernels=minus("kernels"),
        extra_resident_bytes=minus("resident_bytes"),
        extra_peak_bytes=minus("peak_bytes"),
        plain_backward_s=plain["backward_s"],
    )


# ---------------------------------------------------------------------------- a hook on its own
def saved_gradients(model, tokens) -> list[tuple[str, torch.Tensor]]:
    """(name, gradient) of one plain backward, kept aside (the model's own are freed)."""
    model(input_ids=tokens, labels=tokens).loss.backward()
    saved = [(name, p.grad.detach().clone()) for name, p in model.named_parameters()]
    model.zero_grad(set_to_none=True)
    return saved


class PreparedHook:
    """``method``'s hook over every bucket of DDP's layout of the saved gradients (as ``grad_dtype``):
    ``call()`` runs it on every bucket and waits for its Futures, ``restore()`` puts the gradients
    back first. ``base`` is the device memory held before the buckets existed."""

    def __init__(self, saved: list, method: str, grad_dtype: torch.dtype, rank: int, cap: float | None, config=None):
        names = [name for name, _ in saved]
        device = saved[0][1].device
        self.layout = ddp_buckets([tuple(g.shape) for _, g in saved], ready_order(names), grad_dtype, cap)
        tokens = [g for _, g in saved]  # stand for the parameters: the hooks key their state by identity
        _release(device, collect=True)  # the last hook's state, if a reference cycle holds it, is not this one's
        self.base = memory_allocated(device)
        self.buckets = [
            GradBucketStandIn(k, [tokens[i] for i in indices], grad_dtype, last=k == len(self.layout) - 1)
            for k, indices in enumerate(self.layout)
        ]
        self.sources = [[tokens[i] for i in indices] for indices in self.layout]
        self.gradient_bytes = sum(b.buffer().numel() * b.buffer().element_size() for b in self.buckets)
        self.state, self.hook = _hook_state(method, rank, list(zip(names, tokens)), config=config)

    def issue(self) -> list:
        """The hook on every bucket, in DDP's order; its Futures, not waited for."""
        return [self.hook(self.state, bucket) for bucket in self.buckets]

    def call(self) -> None:
        for future in self.issue():
            future.wait()

    def restore(self) -> None:
        for bucket, source in zip(self.buckets, self.sources):
            torch._foreach_copy_(bucket.gradients(), source)

    def warm_up(self, calls: int = WARMUP_CALLS) -> None:
        for _ in range(calls):
            self.restore()
            self.call()


def hook_alone(
    saved: list[tuple[str, torch.Tensor]],
    method: str,
    grad_dtype: torch.dtype,
    rank: int,
    cap: float | None,
    timed: int,
    count_kernels: bool,
) -> dict:
    """Seconds per step of ``method``'s hook over every bucket (its Futures waited for), on the
    saved gradients as ``grad_dtype``, restored before each call; kernels of one call, memory."""
    device = saved[0][1].device
    hook = PreparedHook(saved, method, grad_dtype, rank, cap)
    timer = DeviceTimer(device)
    hook.warm_up()
    timer.synchronize()
    resident = memory_allocated(device)
    peak_memory(device, reset=True)
    seconds = []
    for _ in range(timed):
        hook.restore()
        timer.synchronize()
        start = timer.mark()
        hook.call()
        seconds.append(timer.seconds(start, timer.mark()))
    peak = peak_memory(device)
    hook.restore()
    profiled = kernel_profile(hook.call, device) if count_kernels else None
    base, gradient_bytes = hook.base, hook.gradient_bytes
    return {
        "method": method,
        "grad_dtype": str(grad_dtype).removeprefix("torch."),
        "rank": rank,
        **_cap_label(cap),
        "buckets": len(hook.layout),
        "seconds": median(seconds),
        "seconds_all": seconds,
        "kernels": None if profiled is None else profiled["kernels"],
        "kernel_profile": profiled,
        "state_bytes": None if base is None else resident - base - gradient_bytes,
        "peak_extra_bytes": None if base is None else peak - base - gradient_bytes,
    }


def _release(device, collect: bool = False) -> None:
    """Give the device's cached memory back between measurements; with ``collect``, after a
    collection, for what DDP leaves in reference cycles (a collection costs about a second)."""
    if device.type == "cuda":
        if collect:
            gc.collect()
        torch.cuda.empty_cache()


# ---------------------------------------------------------------------------- the plan
HOOKS = (("edgc", torch.bfloat16), ("powersgd", torch.bfloat16), ("edgc", torch.float32), ("powersgd", torch.float32))


class Budget:
    """Seconds a part may take; work is skipped (and said so) once they are spent."""

    def __init__(self, seconds: float):
        self.seconds, self.start = seconds, time.perf_counter()

    def left(self) -> float:
        return self.seconds - (time.perf_counter() - self.start)


def _attempt(result: dict, budget: Budget, what: dict, measure: Callable[[], dict]) -> dict | None:
    """``measure()`` unless the budget is spent; its row with ``what`` in front, or None (skipped or
    failed, recorded in ``result``)."""
    import traceback

    if budget.left() <= 0:
        result["skipped"].append(what)
        return None
    try:
        row = {**what, **measure()}
    except Exception:
        result["errors"].append({**what, "error": traceback.format_exc(limit=8)})
        print(f"engine {what}: failed\n{result['errors'][-1]['error']}", flush=True)
        return None
    print("engine", {k: v for k, v in row.items() if not k.endswith("_all")}, flush=True)
    return row


def _step_rows(result, budget, size, model, tokens, settings, device) -> None:
    caps, rank, largest = settings["bucket_caps"], settings["goal_rank"], size == settings["sizes"][0]
    for cap in caps if largest else caps[:1]:
        what = {
            "model": size,
            "params": sum(p.numel() for p in model.parameters()),
            "micro_batch": settings["micro_batch"],
            "seq_len": settings["seq_len"],
        }
        plain = _attempt(
            result, budget, what, lambda: hooked_step(model, tokens, "none", 0, cap, settings["timed"], device)
        )
        if plain is None:
            continue
        result["steps"].append(plain)
        methods = ["edgc"] + (["powersgd", "edgc-bf16-ef"] if largest and cap == caps[0] else [])
        for method in methods:
            row = _attempt(
                result, budget, what, lambda: hooked_step(model, tokens, method, rank, cap, settings["timed"], device)
            )
            if row is not None:
                result["steps"].append(against_plain(row, plain))


def _alone_jobs(settings: dict, goal_rank_only: bool) -> list[tuple]:
    """(method, gradient dtype, rank, bucket cap, count kernels?) of the hooks-alone measurements:
    every hook at the goal rank, EDGC at the other bucket sizes; or every hook at the other ranks."""
    caps, goal = settings["bucket_caps"], settings["goal_rank"]
    if not goal_rank_only:
        return [
            (method, dtype, rank, caps[0], False)
            for rank in settings["ranks"]
            if rank != goal
            for method, dtype in HOOKS
        ]
    jobs = [(method, dtype, goal, caps[0], True) for method, dtype in HOOKS]
    jobs.append(("edgc-bf16-ef", torch.bfloat16, goal, caps[0], True))
    jobs.append(("edgc-sampled", torch.bfloat16, goal, caps[0], True))
    return jobs + [("edgc", dtype, goal, cap, True) for cap in caps[1:] for dtype in (torch.bfloat16, torch.float32)]


def _alone_rows(result, budget, size, saved, settings, jobs) -> None:
    first_cap = _cap_label(settings["bucket_caps"][0])["bucket_cap_mb"]
    backward = [
        r["backward_s"]
        for r in result["steps"]
        if r["model"] == size and r["method"] == "none" and r["bucket_cap_mb"] == first_cap
    ]
    for method, dtype, rank, cap, kernels in jobs:
        what = {
            "model": size,
            "method": method,
            "grad_dtype": str(dtype).removeprefix("torch."),
            "rank": rank,
            **_cap_label(cap),
        }
        timed = settings["timed"] if kernels else min(3, settings["timed"])
        row = _attempt(result, budget, what, lambda: hook_alone(saved, method, dtype, rank, cap, timed, kernels))
        if row is not None:
            row["plain_backward_s"] = backward[0] if backward else None
            result["hook_alone"].append(row)
        _release(saved[0][1].device)


def engine(rank: int, world_size: int, settings: dict, budget_s: float, partial: str) -> dict:
    """Per model (largest first): its steps and its hooks alone at the goal rank; then, per model,
    the hooks alone at the other ranks. Runs in a process group of one; the result so far is
    rewritten to ``partial`` after each model, so a crash keeps what was measured."""
    import json
    from pathlib import Path

    device = torch.device("cuda", 0) if settings["cuda"] else torch.device("cpu")
    budget = Budget(budget_s)
    result = {"settings": dict(settings), "steps": [], "hook_alone": [], "skipped": [], "errors": []}
    saved = {}
    for size in settings["sizes"]:
        if budget.left() <= 0:
            result["skipped"].append({"model": size})
            continue
        torch.manual_seed(0)
        model = gpt2(size, device)
        tokens = torch.randint(0, vocabulary(size), (settings["micro_batch"], settings["seq_len"])).to(device)
        if not settings.get("skip_steps"):
            _step_rows(result, budget, size, model, tokens, settings, device)
        saved[size] = saved_gradients(model, tokens)
        del model, tokens
        _release(device, collect=True)
        _alone_rows(result, budget, size, saved[size], settings, _alone_jobs(settings, goal_rank_only=True))
        Path(partial).write_text(json.dumps(result, indent=1))
    for size, gradients in saved.items():
        _alone_rows(result, budget, size, gradients, settings, _alone_jobs(settings, goal_rank_only=False))
        Path(partial).write_text(json.dumps(result, indent=1))
    return result
