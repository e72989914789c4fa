"""Calibration against `edgc bench` folders: predicted vs measured step, comm and link time per
(run, rank), from the fitted `bench_link.BenchLink`, the host profile and the runs' comm traces.

`edgc bench` runs: W emulated hosts, one process each, DP over a tbf rate-limited veth link.

Model of one measured step (the same formulas for every method, nothing fitted per method):
  comm  = wire + wait                              (what rank 0's comm_time_s times)
  wire is compared on its own with the traced link time (link_times: per collective, the minimum
  over ranks, i.e. the rank that arrived last and waited for nobody), wait through comm and step.
  wire  = sum over the step's collectives c of   lat + max(0, f * S_c - B) / beta
          lat = 2(n-1) alpha per all-reduce ((n-1) alpha per all-gather); f = 2(n-1)/n for an
          all-reduce, (n-1) for an all-gather (top-k, QSGD); B: the tbf burst, which passes at
          once because the compute between a step's collectives refills the token bucket.
          beta: the fit of the bench's calibration.json (fit_bench_link), B: its tbf burst.
          alpha: by default from the comm traces of the OTHER runs (traced_alpha: leave one run
          out); the sweep's fit (--latency sweep) misses it on this machine, where a collective's
          fixed cost is mostly waking the peer's threads and depends on what ran before it.
          S_c: collectives.step_collectives (DDP buckets x the method's pattern), rescaled to
          the run's median bytes_sent; the count: the run's logged `collectives` where the
          metrics have it (the extra ones, EDGC's decisions, carry lat only), else the pattern's.
  wait  = omega * (compute_ref + compress): rank 0 waits inside every collective for the slower peer;
          over a step that adds up to a share of the work both do between the collectives.
          omega = the reference run's (comm - link) / (compute + compress), one number; link:
          its traced link time, or its predicted wire where it was not traced.
  step  = compute_ref + compress + comm            (step_time_s = compute + compress + comm)
  compute_ref = the reference run's median compute_time_s (same model, data, batch for all)

Bench folders of the current layout (they have a `nosync`, `allreduce` or `allreduce-blocking` run):
  `none` is DDP's native all-reduce (no hook: no comm/compress timer, no comm trace; its step
  time is what is compared), `nosync` the compute floor (no collectives), `allreduce` our hook
  uncompressed (the old `none`'s collectives), `allreduce-blocking` one packed all-reduce after
  backward. compute_ref = `nosync`'s median step; omega from `allreduce-blocking` (a blocking
  run: its comm minus its traced link time), 0 without one. Our hook is non-blocking (edgc/
  reducer.py) and DDP's native all-reduce is asynchronous, so for `none`, `allreduce`, `powersgd`
  and `edgc` the step comes from a timeline (step_timeline) instead of the sum above:
    forward = FORWARD_SHARE, backward = 1 - FORWARD_SHARE - OTHER_SHARE of compute_ref; bucket k
    is ready after its share (by values) of backward; the link runs one collective at a time in
    issue order (gloo), each taking lat + bytes as above. Our hook (mode "hook"): bucket k's job
    does a third of its compress, issues raw + P; at hook k+1 it waits for them (blocking the
    host, i.e. backward, if they are not done), does the next third, issues Q; at hook k+2 it
    waits and decompresses; the last bucket runs every job to its end. DDP native (mode
    "native"): each bucket's all-reduce is issued when ready and waited for only after backward.
    step = (host time when every collective is waited for) + OTHER_SHARE x compute_ref + wait;
    comm (what the hook times) = the sum over collectives of completion - issue (queueing on the
    link included) + wait. So at least the last bucket's collectives are exposed; the others
    hide behind backward when the link keeps up. Older folders (every hook blocking): the sum.
  compress: PowerSGD FLOP/memory model (cost_model.powersgd_compute_time) with the host profile;
            a registered sync method (`edgc.sync.sync_methods`): the bytes its compression moves per
            value / memory bandwidth (fp16/bf16 casts: 12, 4 read + 2 written, then back), or, where
            its entry gives none (top-k / random-k / QSGD), not modelled: the measured median is used;
            none: 0.
torch-powersgd times its compression inside comm_time_s, so its comm adds the compress model, its
own (cost_model.torch_powersgd_hook_time: more passes over the whole bucket, two fresh allocations).
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Sequence
from dataclasses import dataclass, replace
from pathlib import Path

from . import collectives
from .bench_link import BenchLink
from .calibrate import COMM_INCLUDES_COMPRESS, SKIP_FRACTION, MeasuredRun, harness_model
from .hardware import DeviceSpec
from .step_model import (
    OTHER_SHARE,
    compress_model,
    median_interval,
    payload_groups,
    step_payloads,
    step_timeline,
    wire_parts,
    wire_time,
)

REFERENCE = "none"
# Today's bench folders (since our hook stopped blocking) run nosync, allreduce and allreduce-blocking
# beside the rest, and their none is DDP's native all-reduce; older folders have none of the three,
# and their none is our blocking hook.
COMPUTE_FLOOR = "nosync"  # today's folders: the compute reference
BLOCKING_REFERENCE = "allreduce-blocking"  # today's folders: the peer-wait reference
NEW_STYLE = ("nosync", "allreduce", "allreduce-blocking")  # a folder with any of these is of today's bench
OVERLAPPED = ("allreduce", "powersgd", "edgc")  # through our non-blocking hook (today's folders)
NATIVE = ("none",)  # DDP's own all-reduce in today's folders: asynchronous, no timer, no trace


@dataclass(frozen=True)
class BenchRow:
    """Predicted vs measured medians for one (run, rank) group of a bench run."""

    run: str  #: run folder name (the bench's method token)
    compressor: str
    rank: int | None
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
    link_measured_s: float = (
        math.nan
    )  #: median time of the step's collectives on the link (link_times); nan without traces
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


def _step_groups(run: MeasuredRun) -> list:
    """(rank, records) after the first SKIP_FRACTION; when a run has compressed steps (rank set),
    only those: its uncompressed warm-up / profiling steps are a different workload."""
    records = run.records[int(len(run.records) * SKIP_FRACTION) :] or run.records
    if any(r.get("rank") is not None for r in records):
        records = [r for r in records if r.get("rank") is not None]
    groups: dict = {}
    for rec in records:
        groups.setdefault(rec.get("rank"), []).append(rec)
    return sorted(groups.items(), key=lambda kv: (kv[0] is not None, -(kv[0] or 0)))


def _compressor(run: MeasuredRun) -> str:
    return str(run.config["compressor"])


def _measured_count(recs: Sequence[dict]) -> float | None:
    counts = [float(r["collectives"]) for r in recs if r.get("collectives") is not None]
    return statistics.median(counts) if counts else None


LATENCY_BOUND_SHARE = 0.5  # a traced group teaches the fixed cost only if bytes are at most this share of its link time
LATENCY_SOURCES = ("traced", "sweep")


@dataclass(frozen=True)
class RunGroup:
    """One (run, rank) group's inputs to the prediction (calibrate_bench's first pass)."""

    run: MeasuredRun
    rank: int | None
    recs: list
    payloads: list
    count: float | None
    transfer_s: float  #: bytes beyond the burst / beta, summed over the step's collectives
    link_s: list  #: traced link time of each of its steps (empty without traces)
    #: issued without blocking (our hook in today's folders): traced durations include queueing
    overlapped: bool = False

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
        return (
            bool(self.link_s)
            and self.collectives > 0
            and not self.overlapped
            and compressor not in COMM_INCLUDES_COMPRESS
            and not collectives.issues_all_gather(compressor)
            and self.transfer_s <= LATENCY_BOUND_SHARE * self.link_median_s
        )

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


def calibrate_bench(runs: Sequence[MeasuredRun], device: DeviceSpec, link: BenchLink, latency: str = "traced") -> list:
    """One BenchRow per (run, rank); needs the uncompressed reference run among `runs`.

    `latency`: where the fixed cost per collective comes from. "sweep": the link fit (`link`, from
    the bench's all-reduce sweep). "traced": from the comm traces of the other runs (traced_alpha),
    the sweep's where no other run teaches it. Rate and burst always come from `link`."""
    if latency not in LATENCY_SOURCES:
        raise ValueError(f"latency must be one of {LATENCY_SOURCES}, got {latency!r}")
    new_style = any(_compressor(r) in NEW_STYLE for r in runs)
    ref = reference_run(runs, new_style)
    groups = run_groups(runs, link, new_style)

    def link_of(group: RunGroup) -> tuple:
        alpha, teachers = traced_alpha(groups, group) if latency == "traced" else (None, ())
        if alpha is None:
            return link, "sweep"
        return replace(link, alpha_s=alpha), "traced: " + ", ".join(teachers)

    ref_group = next(g for g in groups if g.run is ref)  # uncompressed: one group, rank None
    compute_ref = group_medians(ref_group)("compute_time_s")
    # the peer wait: a blocking uncompressed run's comm minus its collectives' time (traced, else predicted)
    wait_run = next((r for r in runs if _compressor(r) == BLOCKING_REFERENCE), None) if new_style else ref
    omega = 0.0 if wait_run is None else peer_wait(next(g for g in groups if g.run is wait_run), link_of)
    return [predicted_row(g, device, link, *link_of(g), omega, compute_ref, new_style) for g in groups]


def reference_run(runs: Sequence[MeasuredRun], new_style: bool) -> MeasuredRun:
    """The uncompressed run whose compute time every prediction starts from."""
    ref = next((r for r in runs if _compressor(r) == (COMPUTE_FLOOR if new_style else REFERENCE)), None)
    if new_style and ref is None:
        ref = next((r for r in runs if _compressor(r) == BLOCKING_REFERENCE), None)
    if ref is None:
        raise ValueError(
            f"bench calibration needs the uncompressed run (compressor {REFERENCE!r}; in a folder of "
            f"today's bench {COMPUTE_FLOOR!r} or {BLOCKING_REFERENCE!r}) for its compute time and peer wait"
        )
    return ref


def run_groups(runs: Sequence[MeasuredRun], link: BenchLink, new_style: bool) -> list[RunGroup]:
    """Each run's steps grouped by the rank in force, with their payloads and what the link measured."""
    groups = []
    for run in runs:
        compressor, world = _compressor(run), int(run.config["world_size"])
        for rank, recs in _step_groups(run):
            payloads = step_payloads(
                compressor, rank, run.config, statistics.median(float(r.get("bytes_sent", 0.0)) for r in recs)
            )
            transfer = sum(link.bytes_s(world, p, collectives.issues_all_gather(compressor)) for p in payloads)
            on_link = [run.link_s[r["step"]] for r in recs if run.link_s and r["step"] in run.link_s]
            count = _measured_count(recs)
            if new_style and compressor in (REFERENCE, COMPUTE_FLOOR):
                # DDP's native all-reduce: nothing of ours counts or traces it (it logs 0 collectives
                # and empty traces), the pattern gives the count; nosync has nothing to trace
                count, on_link = None, []
            groups.append(
                RunGroup(run, rank, recs, payloads, count, transfer, on_link, new_style and compressor in OVERLAPPED)
            )
    return groups


def group_medians(group: RunGroup):
    return lambda key: statistics.median(float(r.get(key) or 0.0) for r in group.recs)


def peer_wait(wait_group: RunGroup, link_of) -> float:
    """The peer wait per second of compute: a blocking uncompressed run's comm minus its collectives'
    time (traced, else predicted)."""
    wait_run, wmed = wait_group.run, group_medians(wait_group)
    wait_link = (
        wait_group.link_median_s
        if wait_group.link_s
        else wire_time(
            _compressor(wait_run),
            int(wait_run.config["world_size"]),
            wait_group.payloads,
            link_of(wait_group)[0],
            wait_group.count,
        )
    )
    return max(0.0, wmed("comm_time_s") - wait_link) / (wmed("compute_time_s") + wmed("compress_time_s"))


def predicted_row(
    g: RunGroup,
    device: DeviceSpec,
    link: BenchLink,
    group_link: BenchLink,
    latency_from: str,
    omega: float,
    compute_ref: float,
    new_style: bool,
) -> BenchRow:
    """One group's measured medians beside the model's prediction of them."""
    compressor, world = _compressor(g.run), int(g.run.config["world_size"])
    med = group_medians(g)
    comp_meas = med("compress_time_s")
    comp_model = compress_model(compressor, g.rank, g.run.config, device)
    comp_pred = comp_meas if comp_model is None else comp_model
    latency_s, transfer = wire_parts(compressor, world, g.payloads, group_link, g.count)
    sweep_latency_s = wire_parts(compressor, world, g.payloads, link, g.count)[0]
    in_comm = comp_pred if compressor in COMM_INCLUDES_COMPRESS else 0.0
    untimed = new_style and compressor in NATIVE + (COMPUTE_FLOOR,)  # no comm timer at all
    wait = 0.0 if compressor == COMPUTE_FLOOR else omega * (compute_ref + comp_pred)
    mode = ("native" if compressor in NATIVE else "hook" if compressor in OVERLAPPED else None) if new_style else None
    if mode is None:
        comm_pred = latency_s + transfer + wait + in_comm
        step_pred = compute_ref + (0.0 if in_comm else comp_pred) + comm_pred
    else:
        all_gather = collectives.issues_all_gather(compressor)
        pattern = payload_groups(compressor, g.rank, g.run.config, med("bytes_sent"))
        durations = [[group_link.collective_s(world, p, all_gather) for p in grp] for grp in pattern]
        extra = max(0.0, g.collectives - sum(len(d) for d in durations)) * group_link.latency_s(world, all_gather)
        timeline = step_timeline(
            compute_ref,
            comp_pred,
            durations,
            collectives.bucket_values(compressor, harness_model(g.run.config)),
            mode,
        )
        # DDP native has no timer to compare with: report the link's own time, not the queueing
        comm_pred = (latency_s + transfer if mode == "native" else timeline.comm_s + extra) + wait
        step_pred = timeline.end_s + extra + compute_ref * OTHER_SHARE + wait
    comm_meas = math.nan if untimed else med("comm_time_s")
    return BenchRow(
        g.name,
        compressor,
        g.rank,
        len(g.recs),
        med("bytes_sent"),
        g.collectives,
        g.count is not None,
        comm_meas,
        comm_pred,
        latency_s,
        transfer,
        wait,
        med("step_time_s"),
        step_pred,
        med("compute_time_s"),
        comp_meas,
        comp_pred,
        comp_model is not None,
        (math.nan, math.nan) if untimed else median_interval([float(r.get("comm_time_s") or 0.0) for r in g.recs]),
        g.link_median_s,
        median_interval(g.link_s),
        latency_from,
        sweep_latency_s,
        mode or "sum",
    )
