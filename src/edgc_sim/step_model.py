"""The model of one measured bench step (see `calibrate_bench`'s docstring): the step's payloads, its
timeline of backward, compression and collectives on one link (`step_timeline`), the wire time of its
collectives and the compression's cost; and `median_interval`, the bootstrap interval of a median."""

from __future__ import annotations

import math
import random
import statistics
from collections.abc import Sequence
from dataclasses import dataclass

from edgc.config import nested_config_dict
from edgc.sync.sync_methods import sync_method

from . import collectives
from . import cost_model as cm
from .bench_link import BenchLink
from .calibrate import harness_model, host_model
from .hardware import DeviceSpec, LinkSpec

POWERSGD_METHODS = collectives.LOW_RANK
FORWARD_SHARE = 0.3  # of compute: backward costs about twice the forward's FLOPs (assumed)
OTHER_SHARE = 0.1  # of compute after the sync: optimizer step, zero_grad, bookkeeping (assumed)


def _quantile(values: Sequence[float], q: float) -> float:
    s = sorted(values)
    pos = q * (len(s) - 1)
    lo = int(pos)
    hi = min(lo + 1, len(s) - 1)
    return s[lo] + (s[hi] - s[lo]) * (pos - lo)


def median_interval(
    values: Sequence[float], level: float = 0.95, resamples: int = 2000, seed: int = 0
) -> tuple[float, float]:
    """Percentile-bootstrap interval of the median: how precisely a run's median is known.

    Seeded, so a table regenerates identically. Per-step comm times of the low-rank methods spread
    over 10–250 ms (peer waits), so their medians over 10–50 steps are known only to ±10–20%.
    """
    if not values:
        return (math.nan, math.nan)
    rng = random.Random(seed)
    n = len(values)
    medians = sorted(statistics.median(rng.choices(values, k=n)) for _ in range(resamples))
    tail = (1 - level) / 2
    return _quantile(medians, tail), _quantile(medians, 1 - tail)


def _compression_rate(config: dict) -> float:
    """The engine's ``min_compression_rate`` of a run's config.json (its ``edgc`` table, flat in a run
    begun before the engine's fields were nested), 2.0 by default."""
    edgc = nested_config_dict(config.get("edgc") or {})
    return float((edgc.get("engine") or {}).get("min_compression_rate") or 2.0)


def step_payloads(compressor: str, rank: int | None, config: dict, nbytes: float) -> list:
    """Bytes of each collective of one step (collectives.step_collectives for this run's model),
    rescaled to the measured `nbytes` per step."""
    rate = _compression_rate(config)
    if compressor == "torch-powersgd":
        rate = 2.0  # PowerSGDState's default, which edgc_train keeps
    payloads = collectives.step_collectives(compressor, harness_model(config), rank, 4, rate)
    return collectives.scale_to(payloads, nbytes)


def payload_groups(compressor: str, rank: int | None, config: dict, nbytes: float) -> list:
    """`step_payloads` grouped per DDP bucket (collectives.bucket_collectives), same scaling."""
    rate = _compression_rate(config)
    if compressor == "torch-powersgd":
        rate = 2.0
    groups = collectives.bucket_collectives(compressor, harness_model(config), rank, 4, rate)
    total = sum(p for g in groups for p in g)
    return [[p * nbytes / total for p in g] for g in groups] if total > 0 else groups


@dataclass(frozen=True)
class StepTimeline:
    """One step of an overlapped sync (step_timeline)."""

    end_s: float  #: host time when every collective has been waited for and the last job finished
    comm_s: float  #: sum over collectives of completion - issue (what our hook's timer sums)
    exposed_s: float  #: end_s - (forward + backward + compress): host time spent waiting on the link


def step_timeline(
    compute_s: float, compress_s: float, durations: Sequence[Sequence[float]], values: Sequence[float], mode: str
) -> StepTimeline:
    """Event timeline of one step's backward and sync (see the comment block above).

    `durations[k]`: link time of each collective of bucket k (ready order); `values[k]`: its
    gradient values (its share of backward and of compress). mode "hook": our non-blocking hook
    (3 collectives: raw + P, then Q, then decompress; 1: issue, then wait); "native": DDP's own
    (issued when ready, waited after backward); "blocking": every collective waited at once."""
    if mode not in ("hook", "native", "blocking"):
        raise ValueError(f"mode must be hook, native or blocking, got {mode!r}")
    total_values = sum(values) or 1.0
    backward = compute_s * (1 - FORWARD_SHARE - OTHER_SHARE)
    host = compute_s * FORWARD_SHARE
    link_free, comm = 0.0, 0.0
    issued: dict = {}  # job -> ends of its collectives issued at its last stage

    def issue(ds):
        nonlocal link_free, comm
        ends = []
        for d in ds:
            link_free = max(host, link_free) + d
            comm += link_free - host
            ends.append(link_free)
        return ends

    def stages(k):
        ds, work = list(durations[k]), compress_s * values[k] / total_values
        if len(ds) == 3:  # our engine: raw + P | Q | decompress
            return [(work / 3, ds[:2]), (work / 3, ds[2:]), (work / 3, [])]
        return [(work, ds), (0.0, [])]

    plans = {k: stages(k) for k in range(len(durations))}
    cursor: dict = {}
    in_flight: list = []

    def advance(k):
        nonlocal host
        if k in issued and mode != "native":
            host = max([host] + issued.pop(k))
        work, ds = plans[k][cursor.get(k, 0)]
        host += work
        issued.setdefault(k, []).extend(issue(ds))
        cursor[k] = cursor.get(k, 0) + 1
        if cursor[k] >= len(plans[k]):
            if k in in_flight:
                in_flight.remove(k)
        elif k not in in_flight:
            in_flight.append(k)

    for k in range(len(durations)):
        host += backward * values[k] / total_values
        if mode == "blocking":
            for work, ds in plans[k]:
                host += work
                for end in issue(ds):
                    host = max(host, end)
            continue
        if mode == "hook":
            for j in list(in_flight):
                advance(j)
        advance(k)
    while in_flight:
        for j in list(in_flight):
            advance(j)
    host = max([host] + [e for ends in issued.values() for e in ends])
    if not durations:
        host += backward
    exposed = host - compute_s * (1 - OTHER_SHARE) - compress_s
    return StepTimeline(host, comm, max(0.0, exposed))


def wire_parts(
    compressor: str, world: int, payloads: Sequence[float], link: BenchLink, count: float | None = None
) -> tuple:
    """(latency, bytes) seconds of one step's collectives: `count` (a measured collectives per step,
    default len(payloads)) x the fixed cost, and each payload's bytes beyond the burst / beta. The
    collectives a measured count has beyond the payloads (EDGC's decision all-reduce and broadcast,
    a few bytes) cost the latency alone."""
    all_gather = collectives.issues_all_gather(compressor)
    n = len(payloads) if count is None else count
    return n * link.latency_s(world, all_gather), sum(link.bytes_s(world, p, all_gather) for p in payloads)


def wire_time(
    compressor: str, world: int, payloads: Sequence[float], link: BenchLink, count: float | None = None
) -> float:
    """Latency + bytes of one step's collectives (wire_parts)."""
    return sum(wire_parts(compressor, world, payloads, link, count))


# Device memory a registered sync method's compress and decompress move per gradient value, where
# the step model prices it; a method not here is not modelled (the bench's measured time stands).
# A cast reads fp32 and writes 16 bits, and after the all-reduce reads them and writes fp32 back.
COMPRESS_BYTES_PER_VALUE: dict[str, float] = {"fp16": 4 + 2 + 2 + 4, "bf16": 4 + 2 + 2 + 4}


def compress_model(compressor: str, rank: int | None, config: dict, device: DeviceSpec) -> float | None:
    """Modelled compress + decompress seconds of one step, None where not modelled."""
    if compressor in POWERSGD_METHODS:
        r = rank if rank is not None else int(config.get("powersgd_rank") or 8)
        stage = host_model(config, device, LinkSpec("-", 1.0, 1.0, 0.0)).stages[0]
        if compressor == "torch-powersgd":
            return cm.torch_powersgd_hook_time(
                stage.matrices,
                stage.values,
                r,
                device.flops_per_s("fp32"),
                device.mem_bytes_per_s,
                device.launch_s,
                device.alloc_s(1.0),
                4,
                device.hook_gemm_flops_per_s or None,
            )
        return cm.powersgd_compute_time(
            stage.matrices,
            r,
            device.flops_per_s("fp32"),
            device.mem_bytes_per_s,
            device.launch_s,
            4,
            device.skinny_rates(),
        )
    if sync_method(compressor) is not None:  # a registered sync method: its memory traffic, if known
        per_value = COMPRESS_BYTES_PER_VALUE.get(compressor)
        if per_value is None:
            return None
        values = host_model(config, device, LinkSpec("-", 1.0, 1.0, 0.0)).stages[0].values
        return per_value * values / device.mem_bytes_per_s
    if compressor in collectives.ONE_PACKED:  # torch.cat into a fresh buffer, copied back after the all-reduce
        nbytes = 4 * host_model(config, device, LinkSpec("-", 1.0, 1.0, 0.0)).stages[0].values
        return 4 * nbytes / device.mem_bytes_per_s + device.alloc_s(nbytes)
    return 0.0
