"""A bench's folder: ``OUT/runs/<method>/`` per method (``@`` spelled ``-``), each an `edgc train` run
folder whose ``metrics.jsonl`` and ``config.json`` `read_run` loads. Beneath run.py (which writes
them) and table.py (which re-reads them), so neither imports the other."""

from __future__ import annotations

import json
from pathlib import Path


def method_dir(out: Path, method: str) -> Path:
    """The run folder of ``method`` in the bench folder ``out``."""
    return out / "runs" / method.replace("@", "-")


def read_run(run_dir: Path) -> dict:
    """One method's run: its train and eval records (rank 0's metrics.jsonl), its config.json, and
    EDGC's profiling record (what profiling found; None for other methods and older runs)."""
    lines = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]
    config = json.loads((run_dir / "config.json").read_text())
    profiling = next(
        (r for r in lines if r["kind"] in ("profiled", "notice") and str(r.get("event", "")).startswith("edgc_")), None
    )
    return {
        "train": [r for r in lines if r["kind"] == "train"],
        "eval": [r for r in lines if r["kind"] == "eval"],
        "config": config,
        "profiling": profiling,
    }
