"""How many dispatches one job of our engine issues, as linear terms of its layout fitted to counts of the engine.

A job's dispatches (`edgc.engine.lowrank.LowRankCompressor.reduce_steps`, counted by
`edgc_probes.dispatch_count`'s rule) are a fixed number, plus a number per compressed matrix (what
touches the gradients where they lie), per shape group (the batched products), per P block and per
Q block (the orthonormalisations' per-block work), and a number when raw tensors ride along (and per
further `RAW_GATHER_BATCH` of them, the copies of their gather); a job with nothing to compress issues
a fixed number of its own. The numbers depend on the path (an
accelerator's or a CPU's), the gradients' dtype, whether a group divides, whether the error is
measured and whether the job runs within a hook's step (`SETTINGS`). So the simulator types none of
them: `fit_job_launches` reads them off the engine's own counts of a few probe jobs
(`PROBES`), and refuses when the counts are not linear in these terms (the engine's structure has
changed: the terms are to be revised). The hook around the jobs adds a number per job and per step,
fitted to the counted hook steps the same way (`fit_hook_launches`). ``python -m
edgc_bench.engine_launches`` counts and fits them into `TABLE_PATH`, which `LaunchTable.load` reads.
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np

TERMS = ("job", "raw", "raw_batch", "matrix", "group", "p_block", "q_block", "raw_only")
# Inputs per copy of a contiguous same-dtype ``cat`` on CUDA, the raw message's gather: a rule of the
# dispatch counter's (`edgc_probes.op_traffic.CAT_BATCH`), not of the engine.
RAW_GATHER_BATCH = 128
TABLE_PATH = Path(__file__).resolve().parents[2] / "docs" / "engine" / "launches.json"
PROBE_RANK = 32
# Probe jobs at `PROBE_RANK`, each a list of gradient shapes: a base matrix A, a second of its shape,
# one with a new m (a new P block), one with a new n (a new Q block), its transpose (both), raw tensors
# beside them (more than one gather's worth too), raw tensors alone; the last two check the fit rather
# than determine it.
_A, _NEW_M, _NEW_N, _AT, _RAW = (256, 1024), (512, 1024), (256, 768), (1024, 256), (256,)
_MANY_RAW = (_RAW,) * (RAW_GATHER_BATCH + 2)
PROBES = (
    (_A,),
    (_A, _RAW),
    (_A, *_MANY_RAW),
    (_A, _A),
    (_A, _NEW_M),
    (_A, _NEW_N),
    (_A, _AT),
    (_RAW,),
    (_A, _A, _NEW_M, _NEW_N, _AT, _RAW, _RAW),
    (_RAW, _RAW, (64, 4, 4), *_MANY_RAW),
)


@dataclass(frozen=True)
class Setting:
    """What a job's dispatches depend on besides its layout."""

    accelerator: bool  #: the accelerator's kernels (batched CholeskyQR2), not a CPU's (Householder per block)
    half_gradients: bool  #: bf16 gradients with float32 error feedback
    divides: bool  #: a group of more than one process (the averages divide)
    measure_error: bool  #: the step measures the compression error
    tracked: bool  #: within a hook's step (no select of the stored Q on the device)

    @property
    def key(self) -> str:
        flags = zip(
            ("accelerator", "bf16", "divides", "measured", "tracked"),
            (self.accelerator, self.half_gradients, self.divides, self.measure_error, self.tracked),
        )
        return "/".join(name if on else f"no-{name}" for name, on in flags)


SETTINGS = tuple(Setting(*(bool(bit >> k & 1) for k in range(5))) for bit in range(32))  # every combination


def job_terms(matrices: Sequence[tuple], raw_tensors: int, p_blocks: int, q_blocks: int) -> dict:
    """The terms of one job: ``matrices`` its compressed (m, n, rank), ``raw_tensors`` the non-empty
    tensors it sends raw, ``p_blocks`` and ``q_blocks`` its factors' blocks."""
    raw_batch = max(0, math.ceil(raw_tensors / RAW_GATHER_BATCH) - 1)
    if not matrices:
        return dict.fromkeys(TERMS, 0) | {"raw_only": 1, "raw_batch": raw_batch}
    return {
        "job": 1,
        "raw": int(raw_tensors > 0),
        "raw_batch": raw_batch,
        "matrix": len(matrices),
        "group": len(set(matrices)),
        "p_block": p_blocks,
        "q_block": q_blocks,
        "raw_only": 0,
    }


def fit_job_launches(count: Callable[[Sequence[tuple]], int], terms: Callable[[Sequence[tuple]], dict]) -> dict:
    """Each term's dispatches, from ``count`` (a probe's shapes -> the engine's dispatches) over `PROBES`
    (``terms``: a probe's shapes -> its `job_terms`). Raises when one linear form does not give every
    probe's count exactly."""
    rows = [terms(shapes) for shapes in PROBES]
    design = np.array([[row[name] for name in TERMS] for row in rows], dtype=float)
    counted = np.array([count(shapes) for shapes in PROBES], dtype=float)
    if np.linalg.matrix_rank(design) < len(TERMS):
        raise ValueError("the probes do not determine every term")
    solution = np.linalg.lstsq(design, counted, rcond=None)[0]
    coefficients = {name: int(round(value)) for name, value in zip(TERMS, solution)}
    predicted = design @ np.array([coefficients[name] for name in TERMS])
    if not np.array_equal(predicted, counted):
        misses = [(list(p), int(c), int(m)) for p, c, m in zip(PROBES, counted, predicted) if c != m]
        raise ValueError(f"the engine's dispatches are not linear in {TERMS}: (probe, counted, fitted) {misses}")
    return coefficients


def fit_hook_launches(rows: Iterable[tuple[int, int, int]]) -> dict:
    """The hook's own dispatches per job and per step, from rows of (counted step dispatches, the
    jobs' dispatches summed, jobs). Raises unless one pair gives every row exactly."""
    rows = list(rows)
    design = np.array([[1.0, jobs] for _, _, jobs in rows])
    rest = np.array([float(counted - in_jobs) for counted, in_jobs, _ in rows])
    if len(rows) < 2 or np.linalg.matrix_rank(design) < 2:
        raise ValueError("the hook's rows need at least two different job counts")
    per_step, per_job = (int(round(v)) for v in np.linalg.lstsq(design, rest, rcond=None)[0])
    misses = [row for row, left in zip(rows, rest) if per_step + per_job * row[2] != left]
    if misses:
        raise ValueError(f"the hook's dispatches are not one per-step and one per-job number: {misses}")
    return {"per_step": per_step, "per_job": per_job}


@dataclass(frozen=True)
class LaunchTable:
    """The fitted numbers: per setting key (`Setting.key`) each term's dispatches, and the hook's."""

    jobs: dict  #: setting key -> {term: dispatches}
    hook: dict  #: {"per_step": …, "per_job": …}
    source: str = ""  #: how they were counted

    def job(self, setting: Setting, terms: dict) -> int:
        coefficients = self.jobs.get(setting.key)
        if coefficients is None:
            raise ValueError(f"no dispatches counted for setting {setting.key} (recount: {self.source})")
        return sum(coefficients[name] * terms[name] for name in TERMS)

    @classmethod
    def load(cls, path: str | Path = TABLE_PATH) -> LaunchTable:
        path = Path(path)
        if not path.exists():
            raise FileNotFoundError(f"{path}: no engine launch table (python -m edgc_bench.engine_launches)")
        data = json.loads(path.read_text())
        return cls(data["jobs"], data["hook"], data.get("command", str(path)))


_loaded: dict = {}


def launch_table() -> LaunchTable:
    """The committed table (`TABLE_PATH`), read once."""
    if "table" not in _loaded:
        _loaded["table"] = LaunchTable.load()
    return _loaded["table"]
