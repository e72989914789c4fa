"""Shared helpers for the integration tests: the core tests' process harness, subprocess runs."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "tests" / "core"))  # distributed_harness, models

SUMMARY = re.compile(r"\[rank (\d+)\] edgc: step (\d+) phase (\w+) rank (\d+) sent (\d+) of (\d+) bytes")


def run_script(args: list[str], timeout: int = 180, **env: str) -> subprocess.CompletedProcess:
    """A script or launcher in a subprocess, one thread per process, offline, killed after ``timeout`` s."""
    full_env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1", "PYTHONUNBUFFERED": "1", **env}
    return subprocess.run(args, cwd=REPO, env=full_env, capture_output=True, text=True, timeout=timeout)


def summaries(output: str) -> dict[int, dict]:
    """The ``[rank R] edgc: ...`` line every example prints, per rank."""
    found = {}
    for match in SUMMARY.finditer(output):
        rank, step, phase, r, sent, raw = match.groups()
        found[int(rank)] = {"step": int(step), "phase": phase, "rank": int(r), "sent": int(sent), "raw": int(raw)}
    return found


@pytest.fixture(scope="session")
def two_process_results():
    """test_composability's worker, run once for that file and test_register (2 gloo processes)."""
    from distributed_harness import run_distributed

    from .test_composability import worker

    return run_distributed(worker, 2)
