"""Calibration: the cost model's predicted step and comm times vs runs measured on this machine.

A measured run is an `edgc train` run folder: config.json (preset, world_size, micro_batch, seq_len,
grad_accum, compressor, and the model shape) plus metrics.jsonl. Those runs are plain DP on one
host, so the same IterationModel is used with TP = PP = 1, one "node" of world_size processes, this
CPU as the device and the local gloo link as the intra-node link.
"""

from __future__ import annotations

import json
import statistics
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from .hardware import ClusterSpec, DeviceSpec, LinkSpec
from .iteration import IterationModel
from .presets import ModelSpec, ParallelSpec, Preset
from .rank_schedule import read_metrics

# `edgc train` writes the resolved GPT2Config shape under "model"; top-level keys are the user's
# overrides (often null) and are only a fallback. The first non-null key wins.
SHAPE_KEYS = {
    "layers": ("n_layer",),
    "hidden": ("n_embd",),
    "heads": ("n_head",),
    "vocab": ("vocab_size", "vocab_size_actual"),
    "positions": ("n_positions",),
}
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
    link_s: dict | None = None  #: step -> its collectives' time on the link (link_times), None without traces


@dataclass(frozen=True)
class CalibrationRow:
    """Predicted vs measured for one (run, rank) group of steps."""

    run: str  #: run folder name
    compressor: str  #: config["compressor"]
    rank: int | None  #: PowerSGD rank of these steps, None = uncompressed
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


def read_comm_traces(run_dir: str | Path, world: int) -> dict | None:
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
    return MeasuredRun(
        str(run_dir), config, tuple(read_metrics(metrics_path)), read_comm_traces(run_dir, int(config["world_size"]))
    )


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
    return ModelSpec(
        shape["layers"],
        shape["hidden"],
        shape["heads"],
        int(config["seq_len"]),
        shape["vocab"],
        vocab_pad=1,
        positions=shape["positions"],
    )


def host_model(config: dict, device: DeviceSpec, link: LinkSpec) -> IterationModel:
    """IterationModel of a pure-DP run of `config` on this host."""
    world, micro, accum = (int(config[k]) for k in ("world_size", "micro_batch", "grad_accum"))
    preset = Preset(
        f"run:{config.get('preset', '?')}",
        harness_model(config),
        ParallelSpec(1, 1, world, micro, micro * world * accum),
        1,
        "host",
        "fp32",
        4,
        reducer="edgc",
    )
    cluster = ClusterSpec("host", device, 1, world, link, link, 1, "this machine (measured)")
    return IterationModel(preset, cluster)


def calibrate(runs: Sequence[MeasuredRun], device: DeviceSpec, link: LinkSpec) -> list:
    """One CalibrationRow per (run, rank) with the medians of the measured steps after the first
    SKIP_FRACTION of the run."""
    rows = []
    for run in runs:
        model = host_model(run.config, device, link)
        records = run.records[int(len(run.records) * SKIP_FRACTION) :] or run.records
        by_rank: dict = {}
        for rec in records:
            by_rank.setdefault(rec.get("rank"), []).append(rec)
        for rank, recs in sorted(by_rank.items(), key=lambda kv: (kv[0] is not None, kv[0] or 0)):
            it = model.iteration((rank,))
            compressor = str(run.config["compressor"])
            sync = it.sync[0]
            predicted_comm = sync.total_s if compressor in COMM_INCLUDES_COMPRESS else sync.comm_s
            rows.append(
                CalibrationRow(
                    Path(run.path).name,
                    compressor,
                    rank,
                    len(recs),
                    statistics.median(r["step_time_s"] for r in recs),
                    it.iteration_s,
                    statistics.median(r.get("comm_time_s", 0.0) for r in recs),
                    predicted_comm,
                )
            )
    return rows
