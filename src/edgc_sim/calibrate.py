"""Calibration: the cost model's predicted step and comm times vs runs measured on this machine.

A measured run is an `edgc train` run folder: config.json (preset, world_size, micro_batch, seq_len,
grad_accum, compressor, and the model shape) plus metrics.jsonl. Those runs are plain DP on one
host, so the same IterationModel is used with TP = PP = 1, one "node" of world_size processes, this
CPU as the device and the local gloo link as the intra-node link.
"""
from __future__ import annotations

import json
import statistics
from dataclasses import dataclass
from pathlib import Path
from typing import Optional, Sequence

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
    return MeasuredRun(str(run_dir), config, tuple(read_metrics(metrics_path)))


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
# Model of one measured step (every term below is the same formula for every method):
#   comm    = wire + wait                        (what rank 0's comm_time_s times)
#   wire    = factor(n) * bytes_sent / beta + alpha      beta, alpha: ONE link fit for all methods
#             factor = 2(n-1)/n for all-reduce methods, (n-1) for all-gather methods (top-k, QSGD)
#   wait    = the peer wait of the uncompressed reference run: its median comm_time_s minus its
#             predicted wire time. One host-load constant (a slower peer on the shared CPU), not
#             fitted per method; the reference row's comm error is therefore 0 by construction.
#   step    = compute_ref + compress + comm      (step_time_s = compute + compress + comm in the logs)
#   compute_ref = the reference run's median compute_time_s (same model, data, batch for all)
#   compress: PowerSGD FLOP/memory model (cost_model.powersgd_compute_time) with the host profile;
#             fp16/bf16 casts: 12 bytes moved per value (4 read + 2 written, then back) / memory
#             bandwidth; none: 0; top-k / random-k / QSGD: not modelled, the measured median is used.
# torch-powersgd times its compression inside comm_time_s, so its comm adds the compress model.
# ---------------------------------------------------------------------------------------------
ALL_GATHER_METHODS = ("topk", "qsgd8")
CAST_METHODS = ("fp16", "bf16")
POWERSGD_METHODS = ("powersgd", "edgc", "torch-powersgd")
UNMODELLED_COMPRESS = ("topk", "randomk", "qsgd8")
REFERENCE = "none"


def bench_link(calibration_json: str | Path, world: int = 2) -> LinkSpec:
    """alpha-beta fit (host.fit_alpha_beta: relative error, ring formula) of an `edgc bench`
    calibration.json: rows of {"mb": MiB all-reduced, "seconds": median time}."""
    from .host import fit_alpha_beta

    rows = json.loads(Path(calibration_json).read_text())
    if not isinstance(rows, list) or not rows or any("mb" not in r or "seconds" not in r for r in rows):
        raise ValueError(f"{calibration_json}: expected a list of {{'mb', 'seconds'}} rows")
    sizes = [float(r["mb"]) * 2 ** 20 for r in rows]
    alpha, beta = fit_alpha_beta(world, sizes, [float(r["seconds"]) for r in rows])
    return LinkSpec("bench-tbf", beta, 1.0, alpha,
                    f"fit of {calibration_json}: {8 * beta / 1e6:.0f} Mbit/s, alpha {alpha * 1e6:.0f} us")


def nominal_link(mbit: float) -> LinkSpec:
    """The tbf rate as given (--link-mbit), no latency: an upper bound on the bandwidth."""
    return LinkSpec("bench-nominal", mbit * 1e6 / 8, 1.0, 0.0, f"nominal {mbit:g} Mbit/s")


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
    comm_measured_s: float  #: median comm_time_s
    comm_predicted_s: float  #: wire + wait (+ compress for torch-powersgd)
    comm_p10_s: float  #: 10th percentile of comm_time_s: steps where the peer was (nearly) not waited for
    wire_predicted_s: float  #: wire time alone (+ compress for torch-powersgd)
    step_measured_s: float
    step_predicted_s: float
    compute_measured_s: float  #: this run's median compute_time_s (for reading the step error)
    compress_measured_s: float
    compress_predicted_s: float
    compress_modelled: bool  #: False: compress_predicted_s is the measured median

    @staticmethod
    def _err(pred: float, meas: float) -> float:
        return (pred - meas) / meas if meas else 0.0

    @property
    def comm_error(self) -> float:
        return self._err(self.comm_predicted_s, self.comm_measured_s)

    @property
    def wire_error(self) -> float:
        return self._err(self.wire_predicted_s, self.comm_p10_s)

    @property
    def step_error(self) -> float:
        return self._err(self.step_predicted_s, self.step_measured_s)


def _quantile(values: Sequence[float], q: float) -> float:
    s = sorted(values)
    pos = q * (len(s) - 1)
    lo = int(pos)
    hi = min(lo + 1, len(s) - 1)
    return s[lo] + (s[hi] - s[lo]) * (pos - lo)


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


def wire_time(compressor: str, world: int, nbytes: float, link: LinkSpec) -> float:
    """Ring time of one step's payload: each host sends factor(n) x payload over its link."""
    factor = (world - 1) if compressor in ALL_GATHER_METHODS else 2 * (world - 1) / world
    return 2 * (world - 1) * link.latency_s + factor * nbytes / link.bytes_per_s


def compress_model(compressor: str, rank: Optional[int], config: dict, device: DeviceSpec) -> Optional[float]:
    """Modelled compress + decompress seconds of one step, None where not modelled."""
    if compressor in POWERSGD_METHODS:
        r = rank if rank is not None else int(config.get("powersgd_rank") or 8)
        matrices = host_model(config, device, LinkSpec("-", 1.0, 1.0, 0.0)).stages[0].matrices
        return cm.powersgd_compute_time(matrices, r, device.flops_per_s("fp32"), device.mem_bytes_per_s,
                                        device.launch_s, 4)
    if compressor in CAST_METHODS:
        values = host_model(config, device, LinkSpec("-", 1.0, 1.0, 0.0)).stages[0].values
        return 12 * values / device.mem_bytes_per_s
    if compressor in UNMODELLED_COMPRESS:
        return None
    return 0.0


def calibrate_bench(runs: Sequence[MeasuredRun], device: DeviceSpec, link: LinkSpec) -> list:
    """One BenchRow per (run, rank); needs the uncompressed reference run among `runs`."""
    ref = next((r for r in runs if _compressor(r) == REFERENCE), None)
    if ref is None:
        raise ValueError(f"bench calibration needs the uncompressed run (compressor {REFERENCE!r}) "
                         "for its compute time and peer wait")
    ref_recs = [rec for _, recs in _step_groups(ref) for rec in recs]
    world = int(ref.config["world_size"])
    compute_ref = statistics.median(r["compute_time_s"] for r in ref_recs)
    ref_wire = wire_time(REFERENCE, world, statistics.median(r["bytes_sent"] for r in ref_recs), link)
    wait = max(0.0, statistics.median(r["comm_time_s"] for r in ref_recs) - ref_wire)
    rows = []
    for run in runs:
        compressor = _compressor(run)
        for rank, recs in _step_groups(run):
            med = lambda key: statistics.median(float(r.get(key, 0.0)) for r in recs)  # noqa: E731
            nbytes = med("bytes_sent")
            comp_meas = med("compress_time_s")
            comp_model = compress_model(compressor, rank, run.config, device)
            comp_pred = comp_meas if comp_model is None else comp_model
            wire = wire_time(compressor, int(run.config["world_size"]), nbytes, link)
            in_comm = comp_pred if compressor in COMM_INCLUDES_COMPRESS else 0.0
            comm_pred = wire + wait + in_comm
            step_pred = compute_ref + (0.0 if in_comm else comp_pred) + comm_pred
            rows.append(BenchRow(
                Path(run.path).name, compressor, rank, len(recs), nbytes, med("comm_time_s"), comm_pred,
                _quantile([float(r.get("comm_time_s", 0.0)) for r in recs], 0.1), wire + in_comm,
                med("step_time_s"), step_pred, med("compute_time_s"), comp_meas, comp_pred, comp_model is not None))
    return rows


def format_bench_calibration(rows: Sequence[BenchRow], link: LinkSpec, device: DeviceSpec) -> str:
    """Markdown: the model's inputs, then one line per (run, rank), times in ms, errors in %."""
    ms = lambda s: f"{1e3 * s:.0f}"  # noqa: E731
    pct = lambda e: f"{100 * e:+.1f}%"  # noqa: E731
    lines = [f"link: {link.source or link.name} (beta {8 * link.bytes_per_s / 1e6:.0f} Mbit/s, "
             f"alpha {link.latency_s * 1e6:.0f} us); host: {device.flops_per_s('fp32') / 1e9:.1f} GFLOP/s, "
             f"{device.mem_bytes_per_s / 1e9:.1f} GB/s, {device.launch_s * 1e6:.1f} us/op ({device.source})",
             "",
             "| run | rank | steps | MB sent | comm meas | comm pred | comm err | comm p10 | wire pred | "
             "wire err | step meas | step pred | step err | compute meas | compress meas | compress pred |",
             "|" + "---|" * 16]
    for r in rows:
        comp = ms(r.compress_predicted_s) + ("" if r.compress_modelled else " (meas)")
        ref = " (ref)" if r.compressor == REFERENCE else ""
        lines.append(
            f"| {r.run} | {'-' if r.rank is None else r.rank} | {r.steps} | {r.bytes_sent / 1e6:.2f} | "
            f"{ms(r.comm_measured_s)} | {ms(r.comm_predicted_s)} | {pct(r.comm_error)}{ref} | {ms(r.comm_p10_s)} | "
            f"{ms(r.wire_predicted_s)} | {pct(r.wire_error)} | {ms(r.step_measured_s)} | {ms(r.step_predicted_s)} | "
            f"{pct(r.step_error)} | {ms(r.compute_measured_s)} | {ms(r.compress_measured_s)} | {comp} |")
    lines.append("")
    lines.append("times in ms (medians over the compressed steps after the first 10%); comm pred = wire + "
                 "peer wait of the reference run; wire err compares the wire time with the 10th-percentile "
                 "comm time (steps without waiting for the peer); step pred = reference compute + compress + "
                 "comm pred.")
    return "\n".join(lines)
