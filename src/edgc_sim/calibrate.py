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
