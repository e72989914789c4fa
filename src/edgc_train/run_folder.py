"""A training run's folder: ``config.json`` (`write_run_config`, read back by `config_from_run`),
``metrics.jsonl`` (`MetricsLog`), ``comm_trace/rank{R}.jsonl`` (`CommTrace`) and ``summary.json``
(`write_summary`); `edgc report`, `edgc simulate --calibrate` and the bench read these files."""

from __future__ import annotations

import json
import logging
import statistics
from datetime import datetime, timezone
from pathlib import Path

import torch

from edgc.config import nested_config_dict

from . import checkpoint as ckpt
from .config import TrainConfig

# Fields of config.json beyond TrainConfig's own (the report tool reads these).
RUN_FORMAT = 1


def open_step_log(path: Path, resume_step: int | None):
    """Open a per-step JSON-lines log for appending: truncated on a fresh run, and on resume cut
    back to the checkpoint (lines after it belong to steps that will be run again)."""
    if resume_step is None:
        path.unlink(missing_ok=True)
    elif path.exists():
        keep = [
            line for line in path.read_text().splitlines() if line.strip() and json.loads(line)["step"] <= resume_step
        ]
        ckpt.atomic_write_bytes(path, "".join(line + "\n" for line in keep).encode())
    return open(path, "a")


class CommTrace:
    """``comm_trace/rank{R}.jsonl`` on every rank: each DP collective's seconds per step, in issue
    order. Rank 0's ``comm_time_s`` includes waiting for slower peers; the last rank to reach a
    collective waits for nobody, so the minimum over ranks of each collective is its time on the
    link (``edgc simulate --calibrate`` compares the α–β model with that)."""

    def __init__(self, run_dir: Path, rank: int, enabled: bool, resume_step: int | None):
        self.path = run_dir / "comm_trace" / f"rank{rank}.jsonl" if enabled else None
        self.resume_step, self.f = resume_step, None

    def write(self, step: int, durations) -> None:
        if self.path is None:
            return
        if self.f is None:  # opened at the first step's end: by then rank 0 has created the run folder
            self.path.parent.mkdir(exist_ok=True)
            self.f = open_step_log(self.path, self.resume_step)
        self.f.write(json.dumps({"step": step, "collective_s": list(durations or [])}) + "\n")
        self.f.flush()

    def close(self) -> None:
        if self.f is not None:
            self.f.close()


class MetricsLog:
    """``metrics.jsonl`` (flushed per line) and optionally TensorBoard; rank 0 only."""

    def __init__(self, run_dir: Path, enabled: bool, tensorboard: bool, resume_step: int | None):
        self.enabled, self.tb, self.f = enabled, None, None
        if not enabled:
            return
        self.f = open_step_log(run_dir / "metrics.jsonl", resume_step)
        if tensorboard:
            try:
                from torch.utils.tensorboard import SummaryWriter

                self.tb = SummaryWriter(str(run_dir / "tb"), purge_step=(resume_step + 1) if resume_step else None)
            except ImportError:  # tensorboard is optional
                self.tb = None

    def write(self, record: dict) -> None:
        if not self.enabled:
            return
        self.f.write(json.dumps(record) + "\n")
        self.f.flush()
        if self.tb is not None:
            for key, value in record.items():
                if isinstance(value, (int, float)) and not isinstance(value, bool) and key not in ("step", "rank"):
                    self.tb.add_scalar(f"{record['kind']}/{key}", value, record["step"])
                elif key == "rank" and value is not None:
                    self.tb.add_scalar(f"{record['kind']}/rank", value, record["step"])

    def close(self) -> None:
        if self.f is not None:
            self.f.close()
        if self.tb is not None:
            self.tb.close()
        self.f = self.tb = None


class EDGCRecords(logging.Handler):
    """EDGC's records (`edgc.control.events`, logger ``edgc``, rank 0 of each group) as a run shows them: each
    on a line of its own (``say``: print, or the progress bar's write) and, with its data, as a
    ``metrics.jsonl`` line (``"kind"``: ``decision``, ``profiled``, ``notice``, ``warmup_over``, …).
    The library's own records: the harness adds no second way of telling them. Attached until `close`."""

    def __init__(self, say, metrics: MetricsLog):
        super().__init__(logging.INFO)
        self.say, self.metrics = say, metrics
        self._logger = logging.getLogger("edgc")
        self._level = self._logger.level
        if self._level == logging.NOTSET or self._level > logging.INFO:
            self._logger.setLevel(logging.INFO)
        self._logger.addHandler(self)

    def emit(self, record: logging.LogRecord) -> None:
        self.say(record.getMessage())
        data = getattr(record, "edgc", None)
        if data is not None:
            self.metrics.write(data)

    def close(self) -> None:
        self._logger.removeHandler(self)
        self._logger.setLevel(self._level)
        super().close()


def write_run_config(
    run_dir: Path, cfg: TrainConfig, n_params: int, world: int, shape: dict, data, device, tokens_per_step: int
) -> None:
    """``config.json``: the resolved TrainConfig plus what the run derived (contract for `edgc report`)."""
    resolved = cfg.to_dict()
    resolved.update(
        {
            "edgc": cfg.edgc_config.to_dict() if cfg.edgc_config is not None else None,  # the EDGCConfig actually used
            "edgc_overrides": cfg.edgc,  # what the user set; `--resume` rebuilds the config from this
            "format": RUN_FORMAT,
            "n_params": n_params,
            "world_size": world,
            "model": shape,
            "vocab_size_actual": data.vocab_size,
            "warmup_steps_resolved": cfg.resolved_warmup_steps,
            "tokens_per_step": tokens_per_step,
            "data_cache": str(data.dir),
            "train_tokens": data.meta["train_tokens"],
            "val_tokens": data.meta["val_tokens"],
            "device_type": device.type,
            "torch": torch.__version__,
            "started_at": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        }
    )
    ckpt.atomic_write_json(run_dir / "config.json", resolved)


def config_from_run(run_dir: Path) -> TrainConfig:
    """Rebuild the TrainConfig of an existing run from its ``config.json``."""
    values = json.loads((run_dir / "config.json").read_text())
    fields = set(TrainConfig.__dataclass_fields__)
    values["edgc"] = nested_config_dict(values.get("edgc_overrides") or {})  # flat before engine.FIELD
    return TrainConfig.from_dict({k: v for k, v in values.items() if k in fields})


def write_summary(run_dir: Path) -> dict:
    """``summary.json`` from the whole ``metrics.jsonl`` (so a resumed run summarises all its steps)."""
    lines = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]
    train_lines = [r for r in lines if r["kind"] == "train"]
    last_eval = [r for r in lines if r["kind"] == "eval"][-1]
    summary = {
        "steps": train_lines[-1]["step"],
        "wall_s": train_lines[-1]["wall_s"],
        "final_loss": train_lines[-1]["loss"],
        "val_loss": last_eval["val_loss"],
        "val_ppl": last_eval["val_ppl"],
        "median_step_time_s": statistics.median(r["step_time_s"] for r in train_lines),
        "median_comm_time_s": statistics.median(r["comm_time_s"] for r in train_lines),
        # the part of the step spent waiting on collectives (comm_time_s sums overlapping spans)
        "median_comm_wait_s": statistics.median(r.get("comm_wait_s", r["comm_time_s"]) for r in train_lines),
        "median_compress_time_s": statistics.median(r["compress_time_s"] for r in train_lines),
        "median_tokens_per_s": statistics.median(r["tokens_per_s"] for r in train_lines),
        "bytes_sent": sum(r["bytes_sent"] for r in train_lines),
        "bytes_raw": sum(r["bytes_raw"] for r in train_lines),
        "compression_notice": next((r for r in reversed(lines) if r["kind"] == "notice"), None),
        # The byte budget (EDGCConfig.rank_budget) and the mean rank the run actually spent on it.
        "rank_budget": train_lines[-1].get("rank_budget"),
        "mean_rank": train_lines[-1].get("mean_rank"),
        "rank_decisions": sum(1 for r in lines if r["kind"] == "decision"),
        "rank_changes": sum(1 for r in lines if r["kind"] == "decision" and r["rank"] != r["old_rank"]),
        "finished_at": datetime.now(timezone.utc).isoformat(timespec="seconds"),
    }
    ckpt.atomic_write_json(run_dir / "summary.json", summary)
    return summary
