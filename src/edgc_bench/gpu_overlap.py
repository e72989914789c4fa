"""The overlap part of the GPU bench: does backward ever wait for the compressed collectives?

Two runs of GPT-2 (``--overlap-size``, EDGC at a static rank, DDP, fused AdamW):
- "gloo": 2 processes sharing the one GPU over gloo (NCCL cannot put two ranks on one GPU):
  replicas identical, host reads per step, a profiler trace of one compressed step;
- "nccl": 1 process over NCCL, whose collectives finish at once. So each all-reduce issued
  through ``torch.distributed.all_reduce`` is made to finish ``--delay-ms`` later
  (`CollectiveDelay`): the collective is issued from a side stream that first sleeps on the GPU,
  so only work that waits for the collective is held up. Steps are timed without and with the
  delay: if backward never waits, the moment every gradient is computed (the last bucket's hook
  call, marked on the compute stream) does not move. The trace of a delayed step shows where.

In a smoke run (no GPU) both runs use gloo and the delay is a host sleep.
"""

from __future__ import annotations

import contextlib
import gzip
import time
from pathlib import Path

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

from edgc_probes.host_reads import counted_host_reads

from .gpu_support import DeviceTimer, gpt2, median, spawn_group, vocabulary

SETTLE_STEPS = 4  # DDP's bucket rebuild (2 warm-up steps), Q's creation, one more


class CollectiveDelay:
    """Within ``applied(seconds)``, every ``torch.distributed.all_reduce`` completes ``seconds``
    after it is issued, without holding up the issuing stream: on CUDA it is issued from a side
    stream that waits for the current one and then sleeps on the GPU (``torch.cuda._sleep``), so
    NCCL starts it after the sleep and ``Work.wait()`` makes the waiting stream wait for that; on a
    CPU the host sleeps. The sleeps queue on one stream, as transfers on one link would."""

    def __init__(self, device: torch.device):
        self.cuda = device.type == "cuda"
        self.delayed = 0  # collectives delayed so far
        if self.cuda:
            self.stream = torch.cuda.Stream(device)
            self.cycles_per_second = _sleep_cycles_per_second()

    @contextlib.contextmanager
    def applied(self, seconds: float):
        if not seconds:
            yield
            return
        real = dist.all_reduce

        def delayed_all_reduce(tensor, *args, **kwargs):
            self.delayed += 1
            if not self.cuda:
                time.sleep(seconds)
                return real(tensor, *args, **kwargs)
            self.stream.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(self.stream):
                torch.cuda._sleep(int(seconds * self.cycles_per_second))
                return real(tensor, *args, **kwargs)

        dist.all_reduce = delayed_all_reduce
        try:
            yield
        finally:
            dist.all_reduce = real


def _sleep_cycles_per_second(cycles: int = 50_000_000) -> float:
    """``torch.cuda._sleep`` spins for a number of GPU clock cycles: how many make a second here."""
    torch.cuda._sleep(1000)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    torch.cuda._sleep(cycles)
    end.record()
    end.synchronize()
    return cycles / (start.elapsed_time(end) / 1e3)


def _profiled(enabled: bool, cuda: bool):
    if not enabled:
        return contextlib.nullcontext()
    from torch.profiler import ProfilerActivity, profile

    return profile(activities=[ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else []))


def _export(prof, path: Path) -> None:
    plain = path.with_suffix("")  # trace_x.json
    prof.export_chrome_trace(str(plain))
    with open(plain, "rb") as src, gzip.open(path, "wb") as dst:
        dst.write(src.read())
    plain.unlink()


def overlap_run(rank: int, world_size: int, settings: dict, delay_s: float, trace: str) -> dict:
    """One process of a run (a process group exists): settle, timed steps without and (with a
    ``delay_s``) with the delay, one profiled step traced by rank 0 to ``trace``."""
    from edgc import EDGCConfig, EDGCState, edgc_hook

    cuda = settings["cuda"]
    device = torch.device("cuda", 0) if cuda else torch.device("cpu")
    torch.manual_seed(0)
    model = gpt2(settings["size"], device)
    ddp = DDP(model, device_ids=[0] if cuda else None, gradient_as_bucket_view=True)
    state = EDGCState(None, EDGCConfig.static(settings["rank"], total_steps=100_000, warmup_fraction=0.0), model=ddp)
    timer, ready = DeviceTimer(device), []

    def marking_hook(state, bucket):
        if bucket.is_last():  # every gradient of the step has been computed
            ready.append(timer.mark())
        return edgc_hook(state, bucket)

    ddp.register_comm_hook(state, marking_hook)
    optimizer = torch.optim.AdamW(ddp.parameters(), lr=1e-4, fused=cuda)
    delay, generator = CollectiveDelay(device), torch.Generator().manual_seed(rank)
    timed = settings["steps"]
    plan = ["settle"] * SETTLE_STEPS + ["plain"] * timed + ["delayed"] * (timed if delay_s else 0)
    plan.append("profiled")
    marks, reads, delayed = {"plain": [], "delayed": []}, [], []
    with counted_host_reads() as host:
        for phase in plan:
            tokens = torch.randint(
                0, vocabulary(settings["size"]), (settings["micro_batch"], settings["seq_len"]), generator=generator
            ).to(device)
            ready.clear()
            host.reads, delayed_so_far = 0, delay.delayed
            profiling = phase == "profiled" and rank == 0
            with _profiled(profiling, cuda) as prof, delay.applied(delay_s if phase in ("delayed", "profiled") else 0):
                start = timer.mark()
                ddp(input_ids=tokens, labels=tokens).loss.backward()
                optimizer.step()
                optimizer.zero_grad(set_to_none=False)
                end = timer.mark()
                timer.synchronize()
            if profiling:
                _export(prof, Path(trace))
            reads.append(host.reads)
            if phase in marks:
                marks[phase].append((start, ready[0], end))
            if phase == "delayed":
                delayed.append(delay.delayed - delayed_so_far)
    timing = {
        phase: {
            "gradients_ready_s": median([timer.seconds(a, b) for a, b, _ in stamps]),
            "step_s": median([timer.seconds(a, c) for a, _, c in stamps]),
        }
        for phase, stamps in marks.items()
        if stamps
    }
    result = dict(_summary(world_size, settings, model, state, reads), delay_ms=delay_s * 1e3, **timing)
    if delayed:
        per_step = sum(delayed) / len(delayed)
        result.update(
            delayed_collectives_per_step=per_step,
            injected_s_per_step=per_step * delay_s,
            backward_wait_s=timing["delayed"]["gradients_ready_s"] - timing["plain"]["gradients_ready_s"],
        )
    return result


def _summary(world_size: int, settings: dict, model, state, reads: list[int]) -> dict:
    """What every run reports: the state's last step, host reads per step, a checksum of the replica."""
    params = torch.cat([p.detach().reshape(-1).double() for p in model.parameters()])
    metrics = state.last_step_metrics
    return {
        "backend": dist.get_backend(),
        "world_size": world_size,
        "model": settings["size"],
        "rank": metrics["rank"],
        "phase": metrics["phase"],
        "steps": len(reads),
        "settle_steps": SETTLE_STEPS,
        "host_reads_per_step": reads,
        "collectives_last_step": metrics["collectives"],
        "bytes_sent": metrics["bytes_sent"],
        "bytes_raw": metrics["bytes_raw"],
        "checksum": [float(params.sum()), float(params.square().sum())],
    }


def overlap(out: Path, settings: dict, delay_ms: float, runner=spawn_group, timeout: float = 120) -> dict:
    """Both runs, each given ``timeout`` seconds; each one's summary (rank 0's, with every rank's
    checksum), or its error."""
    import traceback

    results = {}
    runs = [("gloo", "gloo", 2, 0.0), ("nccl", "nccl" if settings["cuda"] else "gloo", 1, delay_ms / 1e3)]
    for key, backend, world_size, delay_s in runs:
        trace = out / f"trace_{key}.json.gz"
        try:
            ranks = runner(overlap_run, world_size, backend, settings, delay_s, str(trace), timeout=timeout)
        except Exception:  # the other run and the other parts still count
            results[key] = {"error": traceback.format_exc(limit=8)}
            print(f"overlap {key}: failed\n{results[key]['error']}", flush=True)
            continue
        summary = dict(ranks[0], checksums=[r["checksum"] for r in ranks], trace=trace.name)
        summary["replicas_identical"] = all(r["checksum"] == ranks[0]["checksum"] for r in ranks)
        del summary["checksum"]
        results[key] = summary
        print(f"overlap {key}: {summary.get('plain')} delayed {summary.get('delayed')}", flush=True)
    return results
