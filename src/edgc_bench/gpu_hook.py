"""Parts "hook" and "sampled" of the GPU run: EDGC's DDP hook at GPT-2 XL rank 32 on bf16 gradients.

"hook", per DDP bucket size (DDP's default, 100 and 200 MB) and mode (eager; with CUDA graphs where
this build's engine has the option, `graphs_option`):
- a training step (DDP on a process group of one, forward + backward in bf16) with no hook and with
  EDGC: the hook's added step time (hooked − plain) against the plain backward, and the drain, the
  time from the last bucket's hook call to the end of backward, on the device (CUDA events) and on
  the host;
- the hook alone on one backward's real gradients in DDP's buckets (restored before each call): its
  time on the device, the host's time issuing it, the dispatches of one call counted on the device
  (`edgc_probes.dispatch_count.DispatchCounter`, a graph region's replay one launch), the host time per
  dispatch, the kernels the profiler saw beside them, the graph regions' modes and the peak memory.

"sampled": a sampled step (`edgc_probes.hook_steps.sampled_config`: the gradients sampled and the error
measured on every call) against a static one, the hook alone at the same size on random gradients of
the model's shapes: time, kernels, dispatches, host reads per call, and the kernels only the sampled
step runs (the histogram's, whose HBM bytes part "ncu" reads by their names).
"""

from __future__ import annotations

import collections
import dataclasses
import time

import torch
from torch.nn.parallel import DistributedDataParallel as DDP

from edgc.device import graphs
from edgc_probes.host_reads import counted_host_reads

from .gpu_engine import WARMUP_CALLS, PreparedHook, _cap_label, _release, saved_gradients
from .gpu_support import DeviceTimer, gpt2, kernel_profile, median, peak_memory, vocabulary

# Names the CUDA-graphs switch of the engine's config may have (the first this build has is used).
GRAPHS_OPTIONS = ("cuda_graphs",)
# A graph region runs eagerly twice, is captured at its third call, replayed from the fourth on.
GRAPH_WARMUP_CALLS = 4


def graphs_option() -> str | None:
    """The field of `edgc.LowRankConfig` that turns CUDA graphs on, or None in a build without one."""
    from edgc.config import LowRankConfig

    fields = {f.name for f in dataclasses.fields(LowRankConfig)}
    return next((name for name in GRAPHS_OPTIONS if name in fields), None)


def not_available(mode: str) -> str | None:
    """Why ``mode`` cannot be measured in this build, or None."""
    if mode == "graphs" and graphs_option() is None:
        return f"not available in this build: edgc.LowRankConfig has none of {', '.join(GRAPHS_OPTIONS)}"
    return None


def edgc_config(kind: str, rank: int, mode: str):
    """EDGC's config of a ``kind`` ("static" or "sampled") step at ``rank``, in ``mode`` ("eager", "graphs")."""
    from edgc import EDGCConfig
    from edgc_probes.hook_steps import sampled_config

    if kind == "sampled":
        config = sampled_config(rank)
    else:
        config = EDGCConfig.static(rank, total_steps=100_000, warmup_fraction=0.0)
    if mode == "graphs":
        config = dataclasses.replace(config, engine=dataclasses.replace(config.engine, **{graphs_option(): True}))
    return config


class RegionModes:
    """The graph regions' calls seen while active, by mode (`edgc.device.graphs.observing`)."""

    def __init__(self):
        self.modes: collections.Counter[str] = collections.Counter()
        self.replayed: set[str] = set()

    def region_begin(self, region, buffers, mode) -> None:
        self.modes[mode] += 1
        if mode == graphs.REPLAY:
            self.replayed.add(region.name)

    def region_end(self, region, buffers, mode) -> None:
        pass


def _dispatches(hook: PreparedHook, replayed: set[str]) -> dict:
    from edgc_probes.dispatch_count import DispatchCounter

    hook.restore()
    with DispatchCounter(replayed) as counter:
        hook.call()
    top = sorted(counter.by_op.items(), key=lambda item: -item[1])[:8]
    return {"dispatches": counter.total, "dispatches_top": dict(top), "in_graphs": sum(counter.in_graphs.values())}


def alone(saved: list, config, cap: float | None, timed: int, graphs_on: bool, kernel_top: int = 12) -> dict:
    """The hook alone over ``saved`` in DDP's buckets at ``cap``: see the module docstring."""
    device = saved[0][1].device
    hook = PreparedHook(saved, "edgc", torch.bfloat16, config.r_max, cap, config=config)
    timer = DeviceTimer(device)
    hook.warm_up(WARMUP_CALLS + (GRAPH_WARMUP_CALLS if graphs_on else 0))
    timer.synchronize()
    peak_memory(device, reset=True)
    seconds, host, seen = [], [], RegionModes()
    with counted_host_reads() as reads, graphs.observing(seen):
        for _ in range(timed):
            hook.restore()
            timer.synchronize()
            start, issued = timer.mark(), time.perf_counter()
            futures = hook.issue()
            host.append(time.perf_counter() - issued)
            for future in futures:
                future.wait()
            seconds.append(timer.seconds(start, timer.mark()))
    peak = peak_memory(device)
    counted = _dispatches(hook, seen.replayed)
    hook.restore()
    profiled = kernel_profile(hook.call, device, top=kernel_top)
    return {
        **_cap_label(cap),
        "buckets": len(hook.layout),
        "seconds": median(seconds),
        "seconds_all": seconds,
        "host_s": median(host),
        "host_s_all": host,
        **counted,
        "host_s_per_dispatch": median(host) / max(counted["dispatches"], 1),
        "host_reads_per_call": reads.reads / max(timed, 1),
        "region_calls_per_call": {mode: n / max(timed, 1) for mode, n in seen.modes.items()},
        "kernels": None if profiled is None else profiled["kernels"],
        "kernel_profile": profiled,
        "busy": None if not profiled else profiled["device_s"] / max(median(seconds), 1e-12),
        "peak_extra_bytes": None if peak is None or hook.base is None else peak - hook.base - hook.gradient_bytes,
    }


# ---------------------------------------------------------------------------- a training step
def _timed_steps(ddp, tokens, count: int, timer: DeviceTimer, last_bucket: list) -> list[dict]:
    """``count`` forward + backward steps: step, backward and drain seconds (the drain from the last
    bucket's hook call, which ``last_bucket`` receives, to backward's end; None with no hook)."""
    marks = []
    for _ in range(count):
        last_bucket.clear()
        start = timer.mark()
        loss = ddp(input_ids=tokens, labels=tokens).loss
        forward_done = timer.mark()
        loss.backward()
        end, host_end = timer.mark(), time.perf_counter()
        ddp.module.zero_grad(set_to_none=False)
        marks.append((start, forward_done, end, host_end, list(last_bucket)))
    timer.synchronize()
    rows = []
    for start, forward_done, end, host_end, last in marks:
        row = {"step_s": timer.seconds(start, end), "backward_s": timer.seconds(forward_done, end)}
        if last:
            row["drain_s"], row["drain_host_s"] = timer.seconds(last[-1][0], end), host_end - last[-1][1]
        rows.append(row)
    return rows


def step(model, tokens, config, cap: float | None, timed: int, device, graphs_on: bool = False) -> dict:
    """A DDP training step with EDGC's hook of ``config`` (None: DDP's own all-reduce)."""
    from edgc import EDGCState, edgc_hook

    _release(device, collect=True)
    ddp = DDP(
        model,
        device_ids=[device.index] if device.type == "cuda" else None,
        bucket_cap_mb=cap,
        gradient_as_bucket_view=True,
    )
    timer, last_bucket = DeviceTimer(device), []
    state = None
    if config is not None:
        state = EDGCState(None, config, model=ddp)

        def marking_hook(state, bucket):
            if bucket.is_last():
                last_bucket.append((timer.mark(), time.perf_counter()))
            return edgc_hook(state, bucket)

        ddp.register_comm_hook(state, marking_hook)
    _timed_steps(ddp, tokens, WARMUP_CALLS + 1 + (GRAPH_WARMUP_CALLS if graphs_on else 0), timer, last_bucket)
    peak_memory(device, reset=True)
    rows = _timed_steps(ddp, tokens, timed, timer, last_bucket)
    row = {
        **_cap_label(cap),
        "step_s": median([r["step_s"] for r in rows]),
        "backward_s": median([r["backward_s"] for r in rows]),
        "step_s_all": [r["step_s"] for r in rows],
        "peak_bytes": peak_memory(device),
    }
    if config is not None:
        row["drain_s"] = median([r["drain_s"] for r in rows])
        row["drain_host_s"] = median([r["drain_host_s"] for r in rows])
        row["phase"], row["edgc_rank"] = state.last_step_metrics["phase"], state.last_step_metrics["rank"]
    profiled = kernel_profile(lambda: _timed_steps(ddp, tokens, 1, timer, last_bucket), device, top=6)
    row["kernels"], row["kernel_profile"] = (None, None) if profiled is None else (profiled["kernels"], profiled)
    ddp = state = None
    model.zero_grad(set_to_none=True)
    _release(device, collect=True)
    return row


def added(row: dict, plain: dict) -> dict:
    """The hook's share of a step against the plain one at the same bucket size."""
    added_s = row["step_s"] - plain["step_s"]
    kernels = None if row["kernels"] is None or plain["kernels"] is None else row["kernels"] - plain["kernels"]
    return dict(
        row,
        added_s=added_s,
        added_over_backward=added_s / plain["backward_s"],
        hook_kernels=kernels,
        plain_step_s=plain["step_s"],
        plain_backward_s=plain["backward_s"],
    )


# ---------------------------------------------------------------------------- the parts
def hook_part(record, settings: dict) -> None:
    """Part "hook": per bucket size, the plain step, then per mode the hooked step and the hook alone."""
    device = torch.device("cuda", 0) if settings["cuda"] else torch.device("cpu")
    size, rank, timed = settings["size"], settings["rank"], settings["timed"]
    torch.manual_seed(0)
    model = gpt2(size, device)
    tokens = torch.randint(0, vocabulary(size), (settings["micro_batch"], settings["seq_len"])).to(device)
    saved = saved_gradients(model, tokens)
    what = {"model": size, "rank": rank, "params": sum(p.numel() for p in model.parameters())}
    for cap in settings["bucket_caps"]:
        label = {**what, **_cap_label(cap)}
        plain = record.attempt(
            "steps", {**label, "mode": "plain"}, lambda: step(model, tokens, None, cap, timed, device)
        )
        for mode in settings["modes"]:
            if record.unavailable("steps", {**label, "mode": mode}, not_available(mode)):
                continue
            config, graphs_on = edgc_config("static", rank, mode), mode == "graphs"
            if plain is not None:
                record.attempt(
                    "steps",
                    {**label, "mode": mode},
                    lambda: added(step(model, tokens, config, cap, timed, device, graphs_on), plain),
                )
            record.attempt("alone", {**label, "mode": mode}, lambda: alone(saved, config, cap, timed, graphs_on))


def random_gradients(size: str, device: torch.device) -> list[tuple[str, torch.Tensor]]:
    """Random bf16 gradients of GPT-2 ``size``'s parameters (no model built)."""
    from edgc_probes.gpt2_layout import gpt2_parameters

    torch.manual_seed(0)
    return [
        (name, torch.randn(shape, device=device, dtype=torch.bfloat16) * 1e-3) for name, shape in gpt2_parameters(size)
    ]


def only_in(profile: dict | None, other: dict | None) -> list:
    """[name, count, seconds] of the kernels ``profile`` ran that ``other`` did not, most time first."""
    if not profile or not other:
        return []
    theirs = {name for name, _, _ in other["top"]}
    return [entry for entry in profile["top"] if entry[0] not in theirs]


def sampled_part(record, settings: dict) -> None:
    """Part "sampled": per mode, the static step and the sampled step, the hook alone."""
    device = torch.device("cuda", 0) if settings["cuda"] else torch.device("cpu")
    size, rank, timed, cap = settings["size"], settings["rank"], settings["timed"], settings["bucket_caps"][0]
    saved = random_gradients(size, device)
    for mode in settings["modes"]:
        rows = {}
        for kind in ("static", "sampled"):
            what = {"model": size, "rank": rank, "mode": mode, "kind": kind}
            if record.unavailable("alone", what, not_available(mode)):
                continue
            config = edgc_config(kind, rank, mode)
            rows[kind] = record.attempt(
                "alone", what, lambda: alone(saved, config, cap, timed, mode == "graphs", kernel_top=400)
            )
        if rows.get("static") and rows.get("sampled"):
            static, sampled = rows["static"]["kernel_profile"], rows["sampled"]["kernel_profile"]
            record.add("sampled_only_kernels", {"mode": mode, "kernels": only_in(sampled, static)})
            for kind in rows:  # the full kernel list served the comparison; the file keeps the top
                if rows[kind]["kernel_profile"]:
                    rows[kind]["kernel_profile"]["top"] = rows[kind]["kernel_profile"]["top"][:12]
            record.save()
        _release(device, collect=True)
