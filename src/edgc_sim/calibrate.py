"""Calibration: the cost model's predicted step and comm times vs runs measured on this machine.

A measured run is an `edgc train` run folder: config.json (preset, world_size, micro_batch, seq_len,
grad_accum, compressor, and the model shape) plus metrics.jsonl. Those runs are plain DP on one
host, so the same IterationModel is used with TP = PP = 1, one "node" of world_size processes, this
CPU as the device and the local gloo link as the intra-node link.
"""
from __future__ import annotations

import json
import math
import random
import statistics
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Optional, Sequence

from . import collectives
from . import cost_model as cm
from .hardware import ClusterSpec, DeviceSpec, LinkSpec
from .iteration import IterationModel
from .presets import ModelSpec, ParallelSpec, Preset
from .schedule import read_metrics

# `edgc train` writes the resolved GPT2Config shape under "model"; top-level keys are the user's
# overrides (often null) and are only a fallback. The first non-null key wins.
SHAPE_KEYS = {"layers": ("n_layer",), "hidden": ("n_embd",), "heads": ("n_head",),
              "vocab": ("vocab_size", "vocab_size_actual"), "positions": ("n_positions",)}
# these compressors time their compression inside comm_time_s (edgc_train/compressors.py)
COMM_INCLUDES_COMPRESS = ("torch-powersgd",)
REQUIRED = ("world_size", "micro_batch", "seq_len", "grad_accum", "compressor")
SKIP_FRACTION = 0.1  # the first steps of a run carry start-up costs (allocation, gloo connects)


@dataclass(frozen=True)
class MeasuredRun:
    """One run folder, parsed."""

    path: str  #: run folder
    config: dict  #: config.json
    records: tuple  #: "train" records of metrics.jsonl, by step
    link_s: Optional[dict] = None  #: step -> its collectives' time on the link (link_times), None without traces


@dataclass(frozen=True)
class CalibrationRow:
    """Predicted vs measured for one (run, rank) group of steps."""

    run: str  #: run folder name
    compressor: str  #: config["compressor"]
    rank: Optional[int]  #: PowerSGD rank of these steps, None = uncompressed
    steps: int  #: steps averaged (median)
    step_measured_s: float  #: median measured step time, seconds
    step_predicted_s: float  #: model's step time, seconds
    comm_measured_s: float  #: median measured comm time, seconds
    comm_predicted_s: float  #: model's DP all-reduce time (plus compression where the run's timer includes it)

    @property
    def step_error(self) -> float:
        """(predicted - measured) / measured."""
        return (self.step_predicted_s - self.step_measured_s) / self.step_measured_s

    @property
    def comm_error(self) -> float:
        return (self.comm_predicted_s - self.comm_measured_s) / self.comm_measured_s if self.comm_measured_s else 0.0


def link_times(traces: Sequence[dict]) -> dict:
    """Per step, the time its collectives took on the link: the sum over the step's collectives of the
    minimum over ranks of that collective's duration.

    `traces`: one {step: [seconds of each collective, in issue order]} per rank. A rank's timer also
    counts waiting for peers that reach the collective later; the last to arrive waits for nobody, so
    the minimum is the collective itself (the quantity Megatron-LM times behind a barrier). Steps
    missing on a rank or whose ranks logged different counts are left out."""
    if not traces:
        return {}
    out = {}
    for step in sorted(set.intersection(*(set(t) for t in traces))):
        per_rank = [t[step] for t in traces]
        if len({len(d) for d in per_rank}) == 1:
            out[step] = sum(min(ds) for ds in zip(*per_rank))
    return out


def read_comm_traces(run_dir: str | Path, world: int) -> Optional[dict]:
    """link_times of a run's comm_trace/rank*.jsonl (`edgc train --comm-trace`), None unless every
    one of the `world` ranks left one."""
    files = [Path(run_dir) / "comm_trace" / f"rank{r}.jsonl" for r in range(world)]
    if world < 2 or not all(f.is_file() for f in files):
        return None
    traces = []
    for f in files:
        try:
            rows = [json.loads(line) for line in f.read_text().splitlines() if line.strip()]
            traces.append({int(row["step"]): [float(x) for x in row["collective_s"]] for row in rows})
        except (ValueError, KeyError, TypeError) as e:
            raise ValueError(f"{f}: not a comm trace ({e})") from None
    return link_times(traces)


def load_run(run_dir: str | Path) -> MeasuredRun:
    run_dir = Path(run_dir)
    cfg_path, metrics_path = run_dir / "config.json", run_dir / "metrics.jsonl"
    for p in (cfg_path, metrics_path):
        if not p.is_file():
            raise ValueError(f"{run_dir}: missing {p.name}")
    config = json.loads(cfg_path.read_text())
    missing = [k for k in REQUIRED if k not in config]
    if missing:
        raise ValueError(f"{cfg_path}: missing keys {missing}")
    return MeasuredRun(str(run_dir), config, tuple(read_metrics(metrics_path)),
                       read_comm_traces(run_dir, int(config["world_size"])))


def harness_model(config: dict) -> ModelSpec:
    """The GPT-2 shape of a run, from config.json ("model", then top level)."""
    sources = [config.get("model") or {}, config]
    shape = {}
    for field, keys in SHAPE_KEYS.items():
        value = next((src[k] for src in sources for k in keys if src.get(k) is not None), None)
        if value is None and field != "positions":
            raise ValueError(f"config.json has no model {field} (any of {keys})")
        shape[field] = int(value or 0)
    # HF GPT-2 does not pad its vocabulary
    return ModelSpec(shape["layers"], shape["hidden"], shape["heads"], int(config["seq_len"]),
                     shape["vocab"], vocab_pad=1, positions=shape["positions"])


def host_model(config: dict, device: DeviceSpec, link: LinkSpec) -> IterationModel:
    """IterationModel of a pure-DP run of `config` on this host."""
    world, micro, accum = (int(config[k]) for k in ("world_size", "micro_batch", "grad_accum"))
    preset = Preset(f"run:{config.get('preset', '?')}", harness_model(config),
                    ParallelSpec(1, 1, world, micro, micro * world * accum), 1, "host", "fp32", 4)
    cluster = ClusterSpec("host", device, 1, world, link, link, 1, "this machine (measured)")
    return IterationModel(preset, cluster)


def calibrate(runs: Sequence[MeasuredRun], device: DeviceSpec, link: LinkSpec) -> list:
    """One CalibrationRow per (run, rank) with the medians of the measured steps after the first
    SKIP_FRACTION of the run."""
    rows = []
    for run in runs:
        model = host_model(run.config, device, link)
        records = run.records[int(len(run.records) * SKIP_FRACTION):] or run.records
        by_rank: dict = {}
        for rec in records:
            by_rank.setdefault(rec.get("rank"), []).append(rec)
        for rank, recs in sorted(by_rank.items(), key=lambda kv: (kv[0] is not None, kv[0] or 0)):
            it = model.iteration((rank,))
            compressor = str(run.config["compressor"])
            sync = it.sync[0]
            predicted_comm = sync.total_s if compressor in COMM_INCLUDES_COMPRESS else sync.comm_s
            rows.append(CalibrationRow(
                Path(run.path).name, compressor, rank, len(recs),
                statistics.median(r["step_time_s"] for r in recs), it.iteration_s,
                statistics.median(r.get("comm_time_s", 0.0) for r in recs), predicted_comm))
    return rows


def format_calibration(rows: Sequence[CalibrationRow]) -> str:
    """Markdown table, one line per row, errors in percent."""
    head = ("| run | compressor | rank | steps | step meas (s) | step pred (s) | step err | "
            "comm meas (s) | comm pred (s) | comm err |")
    lines = [head, "|" + "---|" * 10]
    for r in rows:
        lines.append(
            f"| {r.run} | {r.compressor} | {'-' if r.rank is None else r.rank} | {r.steps} | "
            f"{r.step_measured_s:.4f} | {r.step_predicted_s:.4f} | {100 * r.step_error:+.1f}% | "
            f"{r.comm_measured_s:.4f} | {r.comm_predicted_s:.4f} | {100 * r.comm_error:+.1f}% |")
    return "\n".join(lines)


# ---------------------------------------------------------------------------------------------
# `edgc bench` runs: W emulated hosts, one process each, DP over a tbf rate-limited veth link.
#
# Model of one measured step (the same formulas for every method, nothing fitted per method):
#   comm  = wire + wait                              (what rank 0's comm_time_s times)
#   wire is compared on its own with the traced link time (link_times: per collective, the minimum
#   over ranks, i.e. the rank that arrived last and waited for nobody), wait through comm and step.
#   wire  = sum over the step's collectives c of   lat + max(0, f * S_c - B) / beta
#           lat = 2(n-1) alpha per all-reduce ((n-1) alpha per all-gather); f = 2(n-1)/n for an
#           all-reduce, (n-1) for an all-gather (top-k, QSGD); B: the tbf burst, which passes at
#           once because the compute between a step's collectives refills the token bucket.
#           beta: the fit of the bench's calibration.json (fit_bench_link), B: its tbf burst.
#           alpha: by default from the comm traces of the OTHER runs (traced_alpha: leave one run
#           out); the sweep's fit (--latency sweep) misses it on this machine, where a collective's
#           fixed cost is mostly waking the peer's threads and depends on what ran before it.
#           S_c: collectives.step_collectives (DDP buckets x the method's pattern), rescaled to
#           the run's median bytes_sent; the count: the run's logged `collectives` where the
#           metrics have it (the extra ones, EDGC's decisions, carry lat only), else the pattern's.
#   wait  = omega * (compute_ref + compress): rank 0 waits inside every collective for the slower peer;
#           over a step that adds up to a share of the work both do between the collectives.
#           omega = the reference run's (comm - link) / (compute + compress), one number; link:
#           its traced link time, or its predicted wire where it was not traced.
#   step  = compute_ref + compress + comm            (step_time_s = compute + compress + comm)
#   compute_ref = the reference run's median compute_time_s (same model, data, batch for all)
#
# Bench folders from issue 15 on (they have a `nosync`, `allreduce` or `allreduce-blocking` run):
#   `none` is DDP's native all-reduce (no hook: no comm/compress timer, no comm trace; its step
#   time is what is compared), `nosync` the compute floor (no collectives), `allreduce` our hook
#   uncompressed (the old `none`'s collectives), `allreduce-blocking` one packed all-reduce after
#   backward. compute_ref = `nosync`'s median step; omega from `allreduce-blocking` (a blocking
#   run: its comm minus its traced link time), 0 without one. Our hook is non-blocking (edgc/
#   reducer.py) and DDP's native all-reduce is asynchronous, so for `none`, `allreduce`, `powersgd`
#   and `edgc` the step comes from a timeline (step_timeline) instead of the sum above:
#     forward = FORWARD_SHARE, backward = 1 - FORWARD_SHARE - OTHER_SHARE of compute_ref; bucket k
#     is ready after its share (by values) of backward; the link runs one collective at a time in
#     issue order (gloo), each taking lat + bytes as above. Our hook (mode "hook"): bucket k's job
#     does a third of its compress, issues raw + P; at hook k+1 it waits for them (blocking the
#     host, i.e. backward, if they are not done), does the next third, issues Q; at hook k+2 it
#     waits and decompresses; the last bucket runs every job to its end. DDP native (mode
#     "native"): each bucket's all-reduce is issued when ready and waited for only after backward.
#     step = (host time when every collective is waited for) + OTHER_SHARE x compute_ref + wait;
#     comm (what the hook times) = the sum over collectives of completion - issue (queueing on the
#     link included) + wait. So at least the last bucket's collectives are exposed; the others
#     hide behind backward when the link keeps up. Older folders (every hook blocking): the sum.
#   compress: PowerSGD FLOP/memory model (cost_model.powersgd_compute_time) with the host profile;
#             fp16/bf16 casts: 12 bytes moved per value (4 read + 2 written, then back) / memory
#             bandwidth; none: 0; top-k / random-k / QSGD: not modelled, the measured median is used.
# torch-powersgd times its compression inside comm_time_s, so its comm adds the compress model, its
# own (cost_model.torch_powersgd_hook_time: more passes over the whole bucket, two fresh allocations).
# ---------------------------------------------------------------------------------------------
ALL_GATHER_METHODS = collectives.ALL_GATHER
CAST_METHODS = ("fp16", "bf16")
POWERSGD_METHODS = collectives.LOW_RANK
UNMODELLED_COMPRESS = ("topk", "randomk", "qsgd8")
REFERENCE = "none"
COMPUTE_FLOOR = "nosync"  # issue-15 bench folders: the compute reference
BLOCKING_REFERENCE = "allreduce-blocking"  # issue-15 bench folders: the peer-wait reference
NEW_STYLE = ("nosync", "allreduce", "allreduce-blocking")  # a folder with any of these is issue-15 style
OVERLAPPED = ("allreduce", "powersgd", "edgc")  # through our non-blocking hook (issue-15 folders)
NATIVE = ("none",)  # DDP's own all-reduce in issue-15 folders: asynchronous, no timer, no trace
FORWARD_SHARE = 0.3  # of compute: backward costs about twice the forward's FLOPs (assumed)
OTHER_SHARE = 0.1  # of compute after the sync: optimizer step, zero_grad, bookkeeping (assumed)
SMALL_WIRE = 64 * 1024  # bytes on the wire per host up to which an all-reduce is latency alone
LARGE_WIRE = 4 * 2 ** 20  # ... and from which bytes / beta dominates


@dataclass(frozen=True)
class BenchLink:
    """The emulated link as one collective sees it: tc tbf is a token bucket of `burst_bytes`
    refilled at `bytes_per_s`; every collective also pays a fixed latency."""

    alpha_s: float  #: fixed cost of one ring step; an all-reduce over n hosts pays 2(n-1) of them
    bytes_per_s: float  #: beta: the sustained rate per host and direction
    burst_bytes: float  #: what one message gets through at once after an idle gap
    source: str = ""

    def latency_s(self, world: int, all_gather: bool = False) -> float:
        """Fixed cost of one all-reduce (2(n-1) ring steps) or all-gather (n-1) over `world` hosts."""
        return (world - 1) * (1 if all_gather else 2) * self.alpha_s if world > 1 else 0.0

    def bytes_s(self, world: int, nbytes: float, all_gather: bool = False) -> float:
        """Transfer time of one collective of an `nbytes` buffer: what each host sends (2(n-1)/n of
        it for an all-reduce, (n-1) times it for an all-gather) beyond the burst, at beta."""
        if world <= 1:
            return 0.0
        factor = world - 1 if all_gather else 2 * (world - 1) / world
        return max(0.0, factor * nbytes - self.burst_bytes) / self.bytes_per_s

    def collective_s(self, world: int, nbytes: float, all_gather: bool = False) -> float:
        """One all-reduce (or all-gather) of an `nbytes` buffer over `world` hosts."""
        return self.latency_s(world, all_gather) + self.bytes_s(world, nbytes, all_gather)

    def describe(self, world: int = 2) -> str:
        return (f"beta {8 * self.bytes_per_s / 1e6:.0f} Mbit/s, {1e6 * self.latency_s(world):.0f} us per "
                f"all-reduce (alpha {1e6 * self.alpha_s:.0f} us per ring step), burst {self.burst_bytes / 1e3:.0f} kB")


def fit_bench_link(world: int, sizes_bytes: Sequence[float], seconds: Sequence[float],
                   burst_bytes: float = 0.0) -> tuple:
    """(alpha_s, bytes_per_s) of an all-reduce sweep, T(S) = 2(n-1) alpha + max(0, f S - B) / beta
    with f = 2(n-1)/n and B the tbf burst the links were given; each number from the sizes where it
    dominates: beta from the least-squares slope over the sizes with f S >= 4 MiB (the burst only
    shifts them), alpha from the mean time of those with f S <= 64 KiB (latency alone), / 2(n-1);
    alpha = 0 without such sizes. (B itself is not fitted: on a loaded machine the sizes near it
    scatter by more than the burst is worth.)"""
    if world < 2:
        raise ValueError("a link fit needs at least 2 hosts")
    factor = 2 * (world - 1) / world
    points = [(factor * float(s), float(t)) for s, t in zip(sizes_bytes, seconds)]
    large = [(w, t) for w, t in points if w >= LARGE_WIRE]
    if len({w for w, _ in large}) < 2:
        raise ValueError("the link fit needs at least two sizes of >= 4 MiB on the wire")
    mean_w = statistics.fmean(w for w, _ in large)
    mean_t = statistics.fmean(t for _, t in large)
    slope = sum((w - mean_w) * (t - mean_t) for w, t in large) / sum((w - mean_w) ** 2 for w, _ in large)
    if slope <= 0:
        raise ValueError("all-reduce time did not grow with size; cannot fit a bandwidth")
    small = [t - max(0.0, w - burst_bytes) * slope for w, t in points if w <= SMALL_WIRE]
    latency = max(0.0, statistics.fmean(small)) if small else 0.0
    return latency / (2 * (world - 1)), 1.0 / slope


def _burst(rows: list, world: int) -> float:
    """The tbf burst of a calibration's links: recorded (newer files), else netns.burst_bytes of the
    rate implied by a row's bytes / rate bound (ideal_s = f S 8 / R), else 0 (unlimited)."""
    if rows[0].get("burst_bytes") is not None:
        return float(rows[0]["burst_bytes"])
    row = rows[-1]
    if not row.get("ideal_s"):
        return 0.0
    from edgc_bench.netns import burst_bytes

    wire = 2 * (world - 1) / world * float(row["mb"]) * 2 ** 20
    return float(burst_bytes(wire * 8 / float(row["ideal_s"]) / 1e6))


def bench_link(calibration_json: str | Path, world: int = 2) -> BenchLink:
    """fit_bench_link of an `edgc bench` calibration.json: rows of {"mb": MiB all-reduced,
    "seconds": median time, "mean_s": mean time and "burst_bytes" (newer files)}; the mean is used
    where present (a step's many collectives add up to their mean, not their median)."""
    rows = json.loads(Path(calibration_json).read_text())
    if not isinstance(rows, list) or not rows or any("mb" not in r or "seconds" not in r for r in rows):
        raise ValueError(f"{calibration_json}: expected a list of {{'mb', 'seconds'}} rows")
    sizes = [float(r["mb"]) * 2 ** 20 for r in rows]
    times = [float(r.get("mean_s", r["seconds"])) for r in rows]
    burst = _burst(rows, world)
    alpha, beta = fit_bench_link(world, sizes, times, burst)
    link = BenchLink(alpha, beta, burst)
    note = "" if any(2 * (world - 1) / world * s <= SMALL_WIRE for s in sizes) else \
        " (no size <= 64 KiB measured: latency unknown, taken as 0)"
    return replace(link, source=f"fit of {calibration_json}: {link.describe(world)}{note}")


def nominal_link(mbit: float) -> BenchLink:
    """The tbf rate as given (--link-mbit), no latency, no burst: a bound, not a fit."""
    return BenchLink(0.0, mbit * 1e6 / 8, 0.0, f"nominal {mbit:g} Mbit/s, no latency, no burst")


def find_bench_calibration(run_dirs: Sequence[str | Path]) -> Optional[Path]:
    """`<bench>/calibration.json` when every run folder is `<bench>/runs/<method>`."""
    parents = {Path(d).resolve().parent.parent for d in run_dirs}
    if len(parents) == 1:
        path = parents.pop() / "calibration.json"
        if path.is_file():
            return path
    return None


@dataclass(frozen=True)
class BenchRow:
    """Predicted vs measured medians for one (run, rank) group of a bench run."""

    run: str  #: run folder name (the bench's method token)
    compressor: str
    rank: Optional[int]
    steps: int
    bytes_sent: float  #: median payload per rank per step
    collectives: float  #: collectives per step used by the model
    collectives_measured: bool  #: True: the median of the logged count, False: the method's pattern
    comm_measured_s: float  #: median comm_time_s
    comm_predicted_s: float  #: latency + bytes + wait (+ compress for torch-powersgd)
    latency_s: float  #: collectives x fixed cost per collective
    bytes_s: float  #: sum over the collectives of the bytes beyond the burst / beta
    wait_s: float  #: omega x (reference compute + modelled compress)
    step_measured_s: float
    step_predicted_s: float
    compute_measured_s: float  #: this run's median compute_time_s (for reading the step error)
    compress_measured_s: float
    compress_predicted_s: float
    compress_modelled: bool  #: False: compress_predicted_s is the measured median
    comm_ci_s: tuple = (math.nan, math.nan)  #: bootstrap 95% interval of the measured median comm
    link_measured_s: float = math.nan  #: median time of the step's collectives on the link (link_times); nan without traces
    link_ci_s: tuple = (math.nan, math.nan)  #: bootstrap 95% interval of that median
    latency_from: str = "sweep"  #: where latency_s's fixed cost per collective came from ("sweep" or "traced: <runs>")
    sweep_latency_s: float = math.nan  #: latency_s with the sweep's fixed cost (for comparison)
    step_model: str = "sum"  #: "sum" (blocking), "hook" / "native" (step_timeline: overlapped with backward)

    @property
    def link_predicted_s(self) -> float:
        """The model's time of the collectives themselves: comm without the peer wait."""
        return self.comm_predicted_s - self.wait_s

    @property
    def link_error(self) -> float:
        """(predicted - measured) / measured of the collectives' time on the link; nan without traces."""
        return self._err(self.link_predicted_s, self.link_measured_s) if self.link_measured else math.nan

    @property
    def link_sweep_error(self) -> float:
        """link_error as it would be with the fixed cost per collective of the bench's all-reduce sweep."""
        if not self.link_measured or math.isnan(self.sweep_latency_s):
            return math.nan
        return self._err(self.link_predicted_s - self.latency_s + self.sweep_latency_s, self.link_measured_s)

    @property
    def link_measured(self) -> bool:
        return not math.isnan(self.link_measured_s)

    @property
    def link_in_ci(self) -> bool:
        """The link prediction lies inside the measured median's 95% interval (within measurement noise)."""
        return self.link_ci_s[0] <= self.link_predicted_s <= self.link_ci_s[1]

    @staticmethod
    def _err(pred: float, meas: float) -> float:
        if math.isnan(meas):
            return math.nan
        return (pred - meas) / meas if meas else 0.0

    @property
    def comm_error(self) -> float:
        return self._err(self.comm_predicted_s, self.comm_measured_s)

    @property
    def step_error(self) -> float:
        return self._err(self.step_predicted_s, self.step_measured_s)


def _quantile(values: Sequence[float], q: float) -> float:
    s = sorted(values)
    pos = q * (len(s) - 1)
    lo = int(pos)
    hi = min(lo + 1, len(s) - 1)
    return s[lo] + (s[hi] - s[lo]) * (pos - lo)


def median_interval(values: Sequence[float], level: float = 0.95, resamples: int = 2000,
                    seed: int = 0) -> tuple[float, float]:
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


def _step_groups(run: MeasuredRun) -> list:
    """(rank, records) after the first SKIP_FRACTION; when a run has compressed steps (rank set),
    only those: its uncompressed warm-up / profiling steps are a different workload."""
    records = run.records[int(len(run.records) * SKIP_FRACTION):] or run.records
    if any(r.get("rank") is not None for r in records):
        records = [r for r in records if r.get("rank") is not None]
    groups: dict = {}
    for rec in records:
        groups.setdefault(rec.get("rank"), []).append(rec)
    return sorted(groups.items(), key=lambda kv: (kv[0] is not None, -(kv[0] or 0)))


def _compressor(run: MeasuredRun) -> str:
    return str(run.config["compressor"])


def step_payloads(compressor: str, rank: Optional[int], config: dict, nbytes: float) -> list:
    """Bytes of each collective of one step (collectives.step_collectives for this run's model),
    rescaled to the measured `nbytes` per step."""
    rate = float((config.get("edgc") or {}).get("min_compression_rate") or 2.0)
    if compressor == "torch-powersgd":
        rate = 2.0  # PowerSGDState's default, which edgc_train keeps
    payloads = collectives.step_collectives(compressor, harness_model(config), rank, 4, rate)
    return collectives.scale_to(payloads, nbytes)


def payload_groups(compressor: str, rank: Optional[int], config: dict, nbytes: float) -> list:
    """`step_payloads` grouped per DDP bucket (collectives.bucket_collectives), same scaling."""
    rate = float((config.get("edgc") or {}).get("min_compression_rate") or 2.0)
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


def step_timeline(compute_s: float, compress_s: float, durations: Sequence[Sequence[float]],
                  values: Sequence[float], mode: str) -> StepTimeline:
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


def wire_parts(compressor: str, world: int, payloads: Sequence[float], link: BenchLink,
               count: Optional[float] = None) -> tuple:
    """(latency, bytes) seconds of one step's collectives: `count` (a measured collectives per step,
    default len(payloads)) x the fixed cost, and each payload's bytes beyond the burst / beta. The
    collectives a measured count has beyond the payloads (EDGC's decision all-reduce and broadcast,
    a few bytes) cost the latency alone."""
    all_gather = compressor in ALL_GATHER_METHODS
    n = len(payloads) if count is None else count
    return n * link.latency_s(world, all_gather), sum(link.bytes_s(world, p, all_gather) for p in payloads)


def wire_time(compressor: str, world: int, payloads: Sequence[float], link: BenchLink,
              count: Optional[float] = None) -> float:
    """Latency + bytes of one step's collectives (wire_parts)."""
    return sum(wire_parts(compressor, world, payloads, link, count))


def compress_model(compressor: str, rank: Optional[int], config: dict, device: DeviceSpec) -> Optional[float]:
    """Modelled compress + decompress seconds of one step, None where not modelled."""
    if compressor in POWERSGD_METHODS:
        r = rank if rank is not None else int(config.get("powersgd_rank") or 8)
        stage = host_model(config, device, LinkSpec("-", 1.0, 1.0, 0.0)).stages[0]
        if compressor == "torch-powersgd":
            return cm.torch_powersgd_hook_time(stage.matrices, stage.values, r, device.flops_per_s("fp32"),
                                               device.mem_bytes_per_s, device.launch_s, device.alloc_s(1.0), 4,
                                               device.hook_gemm_flops_per_s or None)
        return cm.powersgd_compute_time(stage.matrices, r, device.flops_per_s("fp32"), device.mem_bytes_per_s,
                                        device.launch_s, 4, device.skinny_rates())
    if compressor in CAST_METHODS:
        values = host_model(config, device, LinkSpec("-", 1.0, 1.0, 0.0)).stages[0].values
        return 12 * values / device.mem_bytes_per_s
    if compressor in collectives.ONE_PACKED:  # torch.cat into a fresh buffer, copied back after the all-reduce
        nbytes = 4 * host_model(config, device, LinkSpec("-", 1.0, 1.0, 0.0)).stages[0].values
        return 4 * nbytes / device.mem_bytes_per_s + device.alloc_s(nbytes)
    if compressor in UNMODELLED_COMPRESS:
        return None
    return 0.0


def _measured_count(recs: Sequence[dict]) -> Optional[float]:
    counts = [float(r["collectives"]) for r in recs if r.get("collectives") is not None]
    return statistics.median(counts) if counts else None


LATENCY_BOUND_SHARE = 0.5  # a traced group teaches the fixed cost only if bytes are at most this share of its link time
LATENCY_SOURCES = ("traced", "sweep")


@dataclass(frozen=True)
class RunGroup:
    """One (run, rank) group's inputs to the prediction (calibrate_bench's first pass)."""

    run: MeasuredRun
    rank: Optional[int]
    recs: list
    payloads: list
    count: Optional[float]
    transfer_s: float  #: bytes beyond the burst / beta, summed over the step's collectives
    link_s: list  #: traced link time of each of its steps (empty without traces)
    overlapped: bool = False  #: issued without blocking (issue-15 hook): traced durations include queueing

    @property
    def name(self) -> str:
        return Path(self.run.path).name

    @property
    def collectives(self) -> float:
        return len(self.payloads) if self.count is None else self.count

    @property
    def link_median_s(self) -> float:
        return statistics.median(self.link_s) if self.link_s else math.nan

    def teaches_latency(self) -> bool:
        """Traced, all-reduce only, compression outside the timer, and latency-bound: its link time
        minus its bytes is the fixed cost of its collectives."""
        compressor = _compressor(self.run)
        return (bool(self.link_s) and self.collectives > 0 and not self.overlapped
                and compressor not in COMM_INCLUDES_COMPRESS + ALL_GATHER_METHODS
                and self.transfer_s <= LATENCY_BOUND_SHARE * self.link_median_s)

    def alpha_s(self) -> float:
        """Fixed cost per ring step in training: (median link time - bytes) / collectives / 2(n-1)."""
        world = int(self.run.config["world_size"])
        return max(0.0, self.link_median_s - self.transfer_s) / self.collectives / (2 * (world - 1))


def traced_alpha(groups: Sequence[RunGroup], group: RunGroup) -> tuple:
    """(alpha_s, run names) from the latency-bound traced groups of the *other* runs (leave one run
    out, so a run's prediction never sees its own measurement), or (None, ()) when there are none."""
    teachers = [g for g in groups if g.run is not group.run and g.teaches_latency()]
    if not teachers:
        return None, ()
    return statistics.fmean(g.alpha_s() for g in teachers), tuple(sorted({g.name for g in teachers}))


def calibrate_bench(runs: Sequence[MeasuredRun], device: DeviceSpec, link: BenchLink,
                    latency: str = "traced") -> list:
    """One BenchRow per (run, rank); needs the uncompressed reference run among `runs`.

    `latency`: where the fixed cost per collective comes from. "sweep": the link fit (`link`, from
    the bench's all-reduce sweep). "traced": from the comm traces of the other runs (traced_alpha),
    the sweep's where no other run teaches it. Rate and burst always come from `link`."""
    if latency not in LATENCY_SOURCES:
        raise ValueError(f"latency must be one of {LATENCY_SOURCES}, got {latency!r}")
    new_style = any(_compressor(r) in NEW_STYLE for r in runs)
    ref = next((r for r in runs if _compressor(r) == (COMPUTE_FLOOR if new_style else REFERENCE)), None)
    if new_style and ref is None:
        ref = next((r for r in runs if _compressor(r) == BLOCKING_REFERENCE), None)
    if ref is None:
        raise ValueError(f"bench calibration needs the uncompressed run (compressor {REFERENCE!r}; in an issue-15 "
                         f"folder {COMPUTE_FLOOR!r} or {BLOCKING_REFERENCE!r}) for its compute time and peer wait")
    groups = []
    for run in runs:
        compressor, world = _compressor(run), int(run.config["world_size"])
        for rank, recs in _step_groups(run):
            payloads = step_payloads(compressor, rank, run.config,
                                     statistics.median(float(r.get("bytes_sent", 0.0)) for r in recs))
            transfer = sum(link.bytes_s(world, p, compressor in ALL_GATHER_METHODS) for p in payloads)
            on_link = [run.link_s[r["step"]] for r in recs if run.link_s and r["step"] in run.link_s]
            count = _measured_count(recs)
            if new_style and compressor in (REFERENCE, COMPUTE_FLOOR):
                # DDP's native all-reduce: nothing of ours counts or traces it (it logs 0 collectives
                # and empty traces), the pattern gives the count; nosync has nothing to trace
                count, on_link = None, []
            groups.append(RunGroup(run, rank, recs, payloads, count, transfer, on_link,
                                   new_style and compressor in OVERLAPPED))

    def link_of(group: RunGroup) -> tuple:
        alpha, teachers = traced_alpha(groups, group) if latency == "traced" else (None, ())
        if alpha is None:
            return link, "sweep"
        return replace(link, alpha_s=alpha), "traced: " + ", ".join(teachers)

    def medians(group: RunGroup):
        return lambda key: statistics.median(float(r.get(key) or 0.0) for r in group.recs)

    ref_group = next(g for g in groups if g.run is ref)  # uncompressed: one group, rank None
    compute_ref = medians(ref_group)("compute_time_s")
    # the peer wait: a blocking uncompressed run's comm minus its collectives' time (traced, else predicted)
    wait_run = next((r for r in runs if _compressor(r) == BLOCKING_REFERENCE), None) if new_style else ref
    omega = 0.0
    if wait_run is not None:
        wait_group = next(g for g in groups if g.run is wait_run)
        wmed = medians(wait_group)
        wait_link = wait_group.link_median_s if wait_group.link_s else wire_time(
            _compressor(wait_run), int(wait_run.config["world_size"]), wait_group.payloads,
            link_of(wait_group)[0], wait_group.count)
        omega = max(0.0, wmed("comm_time_s") - wait_link) / (wmed("compute_time_s") + wmed("compress_time_s"))
    rows = []
    for g in groups:
        compressor, world = _compressor(g.run), int(g.run.config["world_size"])
        med = medians(g)
        comp_meas = med("compress_time_s")
        comp_model = compress_model(compressor, g.rank, g.run.config, device)
        comp_pred = comp_meas if comp_model is None else comp_model
        group_link, latency_from = link_of(g)
        latency_s, transfer = wire_parts(compressor, world, g.payloads, group_link, g.count)
        sweep_latency_s = wire_parts(compressor, world, g.payloads, link, g.count)[0]
        in_comm = comp_pred if compressor in COMM_INCLUDES_COMPRESS else 0.0
        untimed = new_style and compressor in NATIVE + (COMPUTE_FLOOR,)  # no comm timer at all
        wait = 0.0 if compressor == COMPUTE_FLOOR else omega * (compute_ref + comp_pred)
        mode = ("native" if compressor in NATIVE else "hook" if compressor in OVERLAPPED else None) \
            if new_style else None
        if mode is None:
            comm_pred = latency_s + transfer + wait + in_comm
            step_pred = compute_ref + (0.0 if in_comm else comp_pred) + comm_pred
        else:
            all_gather = compressor in ALL_GATHER_METHODS
            pattern = payload_groups(compressor, g.rank, g.run.config, med("bytes_sent"))
            durations = [[group_link.collective_s(world, p, all_gather) for p in grp] for grp in pattern]
            extra = max(0.0, g.collectives - sum(len(d) for d in durations)) * group_link.latency_s(world, all_gather)
            timeline = step_timeline(compute_ref, comp_pred, durations,
                                     collectives.bucket_values(compressor, harness_model(g.run.config)), mode)
            # DDP native has no timer to compare with: report the link's own time, not the queueing
            comm_pred = (latency_s + transfer if mode == "native" else timeline.comm_s + extra) + wait
            step_pred = timeline.end_s + extra + compute_ref * OTHER_SHARE + wait
        comm_meas = math.nan if untimed else med("comm_time_s")
        rows.append(BenchRow(
            g.name, compressor, g.rank, len(g.recs), med("bytes_sent"), g.collectives, g.count is not None,
            comm_meas, comm_pred, latency_s, transfer, wait, med("step_time_s"),
            step_pred, med("compute_time_s"), comp_meas, comp_pred, comp_model is not None,
            (math.nan, math.nan) if untimed else median_interval([float(r.get("comm_time_s") or 0.0) for r in g.recs]),
            g.link_median_s, median_interval(g.link_s),
            latency_from, sweep_latency_s, mode or "sum"))
    return rows


def format_bench_calibration(rows: Sequence[BenchRow], link: BenchLink, device: DeviceSpec) -> str:
    """Markdown: the model's inputs, then one line per (run, rank), times in ms, errors in %."""
    ms = lambda s: "-" if math.isnan(s) else f"{1e3 * s:.0f}"  # noqa: E731
    pct = lambda e: "-" if math.isnan(e) else f"{100 * e:+.1f}%"  # noqa: E731
    ci = lambda lo_hi: "-" if math.isnan(lo_hi[0]) else f"{ms(lo_hi[0])}–{ms(lo_hi[1])}"  # noqa: E731
    lines = [f"link: {link.source or link.describe()}; host: {device.flops_per_s('fp32') / 1e9:.1f} GFLOP/s, "
             f"{device.mem_bytes_per_s / 1e9:.1f} GB/s, {device.launch_s * 1e6:.1f} us/op ({device.source})",
             "",
             "| run | rank | steps | MB sent | collectives | us per collective | latency | bytes | link pred "
             "| link meas | link meas 95% | link err | link err, sweep latency | wait pred | comm pred | comm meas "
             "| comm meas 95% | comm err | step pred | step meas | step err | compress pred | compress meas |",
             "|" + "---|" * 23]
    for r in rows:
        comp = ms(r.compress_predicted_s) + ("" if r.compress_modelled else " (meas)")
        ref = " (ref)" if r.compressor in (REFERENCE, COMPUTE_FLOOR, BLOCKING_REFERENCE) else ""
        count = f"{r.collectives:g}" + ("" if r.collectives_measured else " (pattern)")
        lines.append(
            f"| {r.run} | {'-' if r.rank is None else r.rank} | {r.steps} | {r.bytes_sent / 1e6:.2f} | {count} | "
            f"{f'{1e6 * r.latency_s / r.collectives:.0f}' if r.collectives else '-'}"
            f"{'' if r.latency_from == 'sweep' else ' (traced)'} | "
            f"{ms(r.latency_s)} | {ms(r.bytes_s)} | {ms(r.link_predicted_s)} | {ms(r.link_measured_s)} | "
            f"{ci(r.link_ci_s)} | {pct(r.link_error)} | {pct(r.link_sweep_error)} | {ms(r.wait_s)} | "
            f"{ms(r.comm_predicted_s)} | "
            f"{ms(r.comm_measured_s)} | {ci(r.comm_ci_s)} | {pct(r.comm_error)}{ref} | {ms(r.step_predicted_s)} | "
            f"{ms(r.step_measured_s)} | {pct(r.step_error)}{'' if r.step_model == 'sum' else f' ({r.step_model})'} | "
            f"{comp} | {ms(r.compress_measured_s)} |")
    lines.append("")
    lines.append("times in ms, medians over the compressed steps after the first 10%; 95%: bootstrap interval of "
                 "that median (how precisely the run pins it). collectives: per step, the logged median or "
                 "(pattern) the method's pattern over DDP's buckets. us per collective: the fixed cost of one, "
                 "from the link sweep or (traced) from the comm traces of the *other* runs (leave one run out: "
                 "the mean over their latency-bound groups of (link meas - bytes) / collectives; link err, sweep "
                 "latency: the same prediction with the sweep's fixed cost). link pred = latency (collectives x the "
                 "fixed cost of one) + bytes (each collective's bytes beyond the burst / beta) (+ compress pred for "
                 "torch-powersgd, whose timer spans its compression); link meas = per step, the sum over its "
                 "collectives of the minimum over ranks of each one's duration (the last rank to arrive waits for "
                 "nobody; `edgc train --comm-trace`). comm = rank 0's comm_time_s, which adds waiting for the "
                 "slower peer: comm pred = link pred + wait pred (the reference run's peer-wait share of its work "
                 "x reference compute + compress pred). step pred = reference compute + compress pred + comm pred; "
                 "(hook) / (native): overlapped with backward, from the step timeline (calibrate.step_timeline: "
                 "our non-blocking hook, DDP's native all-reduce), comm pred = the sum of each collective's issue "
                 "to completion + wait pred. In issue-15 folders the reference compute is nosync's step, the "
                 "peer wait allreduce-blocking's; none (DDP native) and nosync have no comm timer (-).")
    sources = {}
    for r in rows:
        sources.setdefault(r.latency_from, []).append(r.run + ("" if r.rank is None else f" r={r.rank}"))
    for source, members in sources.items():
        lines.append("")
        lines.append(f"fixed cost per collective of {', '.join(dict.fromkeys(members))}: " + (
            "the link sweep's" if source == "sweep" else "traced in " + source.removeprefix("traced: ")))
    return "\n".join(lines)
