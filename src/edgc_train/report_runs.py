"""The runs `edgc report` compares: a run folder loaded (`load_run`), its steady-state statistics
(`run_stats`), its rank schedule, and the number formats the report uses."""

from __future__ import annotations

import json
import math
import statistics
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from edgc.policies.rank_rules import RANK_MAPPINGS

SKIP_STEPS = 3  # steps excluded from the medians (one-off start-up costs)


class ReportError(ValueError):
    """A run folder cannot be read; the message is one line naming the folder."""


# ------------------------------------------------------------------------------------------ loading
@dataclass
class Run:
    path: Path
    config: dict
    train: list[dict]
    evals: list[dict]
    label: str = ""
    ignored_lines: int = 0  # a truncated last line (run killed while writing) is skipped
    notices: list[dict] = field(default_factory=list)  # "kind": "notice" lines (e.g. EDGC switched off)
    stats: dict = field(default_factory=dict)

    @property
    def compressor(self) -> str:
        return str(self.config.get("compressor", "?"))

    @property
    def comm_measured(self) -> bool:
        """False for native DDP / HSDP (``none`` without a pipeline): their all-reduce runs inside
        DDP or FSDP, overlapped with backward, with no time of its own to log."""
        return not (self.compressor == "none" and int(self.config.get("pp") or 1) == 1)

    def comm_wait(self, record: dict) -> float:
        """Seconds the step waited on its gradient collectives (what overlap did not hide)."""
        waited = record.get("comm_wait_s")
        return record["comm_time_s"] if waited is None else waited

    @property
    def compressed_steps(self) -> list[dict]:
        return [r for r in self.train if r.get("rank") is not None]

    @property
    def first_compressed_step(self) -> int | None:
        steps = self.compressed_steps
        return steps[0]["step"] if steps else None

    @property
    def edgc(self) -> dict:
        return self.config.get("edgc") or {}


def load_run(path: str | Path) -> Run:
    """Read one run folder; raise ReportError (one line) when it is missing, empty or unreadable."""
    path = Path(path)
    if not path.exists():
        raise ReportError(f"{path}: no such run folder")
    if not path.is_dir():
        raise ReportError(f"{path}: not a folder (give the run folder that `edgc train --out` created)")
    config_path, metrics_path = path / "config.json", path / "metrics.jsonl"
    if not config_path.is_file():
        raise ReportError(f"{path}: not a run folder (no config.json)")
    try:
        config = json.loads(config_path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        raise ReportError(f"{config_path}: unreadable ({exc})") from None
    if not isinstance(config, dict):
        raise ReportError(f"{config_path}: expected a JSON object")
    if not metrics_path.is_file():
        raise ReportError(f"{path}: no metrics.jsonl (the run never logged a step)")
    try:
        text = metrics_path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise ReportError(f"{metrics_path}: unreadable ({exc})") from None
    lines = [(n, line) for n, line in enumerate(text.splitlines(), 1) if line.strip()]
    records, ignored = [], 0
    for i, (n, line) in enumerate(lines):
        try:
            record = json.loads(line)
            if not isinstance(record, dict) or "kind" not in record or "step" not in record:
                raise ValueError("not a metrics record")
        except ValueError as exc:
            if i == len(lines) - 1:  # the writer was killed mid-line: keep what is complete
                ignored += 1
                continue
            raise ReportError(f"{metrics_path}:{n}: bad line ({exc})") from None
        records.append(record)
    train = [r for r in records if r["kind"] == "train"]
    evals = [r for r in records if r["kind"] == "eval"]
    if not train:
        raise ReportError(f"{path}: metrics.jsonl holds no training steps (empty run)")
    missing = sorted({"step", "wall_s", "loss", "step_time_s", "comm_time_s"} - set(train[0]))
    if missing:
        raise ReportError(f"{metrics_path}: train lines lack {', '.join(missing)} (not written by `edgc train`?)")
    # A resumed run may have re-logged steps: keep the last record of each step, in order.
    train = list({r["step"]: r for r in train}.values())
    evals = list({r["step"]: r for r in evals}.values())
    train.sort(key=lambda r: r["step"])
    evals.sort(key=lambda r: r["step"])
    notices = [r for r in records if r["kind"] == "notice"]
    return Run(path=path, config=config, train=train, evals=evals, ignored_lines=ignored, notices=notices)


def load_runs(paths: list[str | Path]) -> list[Run]:
    runs = [load_run(p) for p in paths]
    resolved = [r.path.resolve() for r in runs]
    if len(set(resolved)) != len(resolved):
        raise ReportError("the same run folder is given twice")
    _label(runs)
    for run in runs:
        run.stats = run_stats(run)
    return runs


def _label(runs: list[Run]) -> None:
    """Label = folder name + compressor: "e120 (edgc)", "edgc", "base (none: DDP all-reduce)", "none (DDP "
    "all-reduce)"."""

    def make(run: Run, name: str) -> str:
        if run.compressor == "none":
            return f"{name} (DDP all-reduce)" if name == "none" else f"{name} (none: DDP all-reduce)"
        return name if name == run.compressor else f"{name} ({run.compressor})"

    labels = [make(r, r.path.name) for r in runs]
    for i, run in enumerate(runs):
        if labels.count(labels[i]) > 1:
            run.label = make(run, f"{run.path.parent.name}/{run.path.name}")
        else:
            run.label = labels[i]
    seen: dict[str, int] = {}
    for run in runs:  # still equal (same parent names too): number them
        seen[run.label] = seen.get(run.label, 0) + 1
        if seen[run.label] > 1:
            run.label = f"{run.label} #{seen[run.label]}"


# ------------------------------------------------------------------------------------------ numbers
def _median(values: list[float]) -> float | None:
    values = [v for v in values if v is not None and math.isfinite(v)]
    return statistics.median(values) if values else None


def steady(run: Run) -> list[dict]:
    """Train lines used for medians: all but the first SKIP_STEPS (all of them for very short runs)."""
    return run.train[SKIP_STEPS:] if len(run.train) > 2 * SKIP_STEPS else run.train


def rank_schedule(run: Run) -> list[tuple[int, int, int | None]]:
    """(first step, last step, rank) segments; rank None = uncompressed."""
    segments: list[list] = []
    for r in run.train:
        rank = r.get("rank")
        if segments and segments[-1][2] == rank and segments[-1][1] == r["step"] - 1:
            segments[-1][1] = r["step"]
        else:
            segments.append([r["step"], r["step"], rank])
    return [tuple(s) for s in segments]  # type: ignore[misc]


def format_schedule(run: Run, limit: int = 14) -> str:
    parts = []
    for first, last, rank in rank_schedule(run):
        span = f"{first}" if first == last else f"{first}–{last}"
        parts.append(f"{span}: {'uncompressed' if rank is None else f'r={rank}'}")
    if len(parts) > limit:
        parts = parts[: limit // 2] + [f"… ({len(parts) - limit} more) …"] + parts[-limit // 2 :]
    return "; ".join(parts)


def estimator_name(edgc: dict) -> str:
    """The entropy estimator a run used ('auto' resolves as EDGCConfig does)."""
    name = edgc.get("entropy_estimator", "histogram")
    if name == "auto":
        mapping = RANK_MAPPINGS.get(edgc.get("rank_mapping", "delta"))  # one this process registered
        return mapping.entropy_estimator if mapping is not None else "histogram"
    return name


def run_stats(run: Run) -> dict[str, Any]:
    core = steady(run)
    n = len(run.train)
    last_eval = run.evals[-1] if run.evals else None
    bytes_sent = sum(r.get("bytes_sent") or 0 for r in run.train)
    bytes_raw = sum(r.get("bytes_raw") or 0 for r in run.train)
    compressed = run.compressed_steps
    ranks = [r["rank"] for r in compressed]
    return {
        "steps": run.train[-1]["step"],
        "planned_steps": run.config.get("steps"),
        "wall_s": run.train[-1]["wall_s"],
        "final_loss": run.train[-1]["loss"],
        "val_loss": last_eval["val_loss"] if last_eval else None,
        "val_ppl": last_eval["val_ppl"] if last_eval else None,
        "val_step": last_eval["step"] if last_eval else None,
        "median_step_s": _median([r["step_time_s"] for r in core]),
        "median_comm_s": _median([run.comm_wait(r) for r in core]) if run.comm_measured else None,
        "median_compress_s": _median([r.get("compress_time_s") for r in core]),
        "median_compute_s": _median([r.get("compute_time_s") for r in core]),
        "median_tokens_per_s": _median([r.get("tokens_per_s") for r in core]),
        "median_from_step": core[0]["step"] if core else None,
        "bytes_per_step": bytes_sent / n,
        "raw_bytes_per_step": bytes_raw / n,
        "compressed_bytes_per_step": (
            sum(r.get("bytes_sent") or 0 for r in compressed) / len(compressed) if compressed else None
        ),
        "compressed_fraction": len(compressed) / n,
        "first_compressed_step": run.first_compressed_step,
        "rank_min": min(ranks) if ranks else None,
        "rank_max": max(ranks) if ranks else None,
        "rank_changes": max(0, sum(1 for s in rank_schedule(run) if s[2] is not None) - 1),
        "entropy_samples": sum(1 for r in run.train if r.get("entropy") is not None),
    }


def baseline(runs: list[Run]) -> Run | None:
    """The uncompressed run the ratios refer to (the first one given with compressor none)."""
    return next((r for r in runs if r.compressor == "none"), None)


def ratio(value: float | None, base: float | None) -> float | None:
    if value is None or base is None or base == 0:
        return None
    return value / base


# ------------------------------------------------------------------------------------------ formatting
def fmt(value: Any, spec: str = ".3f", none: str = "–") -> str:
    if value is None or (isinstance(value, float) and not math.isfinite(value)):
        return none
    return format(value, spec)


def fmt_ms(seconds: float | None) -> str:
    return fmt(None if seconds is None else seconds * 1000, ".1f")


def fmt_mb(nbytes: float | None) -> str:
    return fmt(None if nbytes is None else nbytes / 1e6, ".2f")


def fmt_ratio(value: float | None) -> str:
    return fmt(value, ".3f") + ("×" if value is not None else "")


def fmt_duration(seconds: float) -> str:
    return f"{seconds:.0f} s" if seconds < 120 else f"{seconds / 60:.1f} min"
