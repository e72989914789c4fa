"""Shared helpers for the training-harness tests: a small corpus slice, fast flags, subprocess runs."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
EDGC = [sys.executable, "-m", "edgc_cli.main"]

# Small enough for 2 cores: tiny preset (3.4M params at vocab 512), 4 x 64 tokens per rank.
FAST = [
    "--max-chars",
    "200000",
    "--vocab-size",
    "512",
    "--seq-len",
    "64",
    "--micro-batch",
    "4",
    "--eval-batches",
    "4",
    "--no-progress",
    "--no-tensorboard",
]


@pytest.fixture(scope="session")
def cache_dir(tmp_path_factory) -> Path:
    """One data cache for the whole session, so the tokenizer is trained once."""
    return tmp_path_factory.mktemp("data_cache")


def run_edgc(*args: str, timeout: int = 240) -> subprocess.CompletedProcess:
    """`edgc ...` in a subprocess, 1 thread per process, killed after ``timeout`` seconds."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"}
    return subprocess.run([*EDGC, *args], cwd=REPO, env=env, capture_output=True, text=True, timeout=timeout)


def cut_back(run_dir: Path, copy: Path, latest_step: int) -> Path:
    """``copy`` = ``run_dir`` without its ``latest_step`` checkpoint and summary: an interrupted run to resume."""
    shutil.copytree(run_dir, copy)
    shutil.rmtree(copy / "checkpoints" / f"step_{latest_step:06d}")
    (copy / "summary.json").unlink()
    return copy


def run_and_resume(folder: Path, job: list[str], cache_dir: Path, nproc: int = 4) -> tuple[Path, Path]:
    """``folder/a``: ``job`` on ``nproc`` processes, uninterrupted; ``folder/b``: a copy cut back before its
    last checkpoint (the ``--steps`` of ``job``), then resumed. Both must succeed."""
    a, steps = folder / "a", int(job[job.index("--steps") + 1])
    proc = run_edgc("train", "--out", str(a), "--nproc", str(nproc), *job, "--cache-dir", str(cache_dir), timeout=400)
    assert proc.returncode == 0, proc.stderr[-3000:]
    b = cut_back(a, folder / "b", steps)
    proc = run_edgc("train", "--resume", str(b), "--nproc", str(nproc), "--no-progress", timeout=400)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return a, b


def read_metrics(run_dir: Path) -> list[dict]:
    """The run's metric records; a last line still being written (no newline yet) is left out, so a
    test may poll the file of a running run."""
    text = (run_dir / "metrics.jsonl").read_text()
    complete = text if text.endswith("\n") else text[: text.rfind("\n") + 1]
    return [json.loads(line) for line in complete.splitlines() if line.strip()]


def train_losses(run_dir: Path) -> dict[int, float]:
    return {r["step"]: r["loss"] for r in read_metrics(run_dir) if r["kind"] == "train"}


@pytest.fixture(scope="session")
def solo_run(tmp_path_factory):
    """``solo_run(common)``: the single-process run with micro-batch 4 of ``common``'s flags, run once
    per session (the PP and TP × PP × DP comparisons compare with the same one)."""
    runs: dict[tuple, Path] = {}

    def run(common: list[str]) -> Path:
        if tuple(common) not in runs:
            solo = tmp_path_factory.mktemp("solo") / "solo"
            proc = run_edgc("train", "--out", str(solo), *common, "--micro-batch", "4")
            assert proc.returncode == 0, proc.stderr[-3000:]
            runs[tuple(common)] = solo
        return runs[tuple(common)]

    return run


def run_parallel_and_solo(tmp_path: Path, parallel: list[str], common: list[str], solo_run) -> tuple[Path, Path]:
    """The same data in a parallel job (``parallel`` flags) and in one process with micro-batch 4
    (``solo_run``'s); asserts both finished and their train and eval losses agree to 1e-5."""
    proc = run_edgc("train", "--out", str(tmp_path / "parallel"), *parallel, *common, timeout=400)
    assert proc.returncode == 0, proc.stderr[-3000:]
    runs = (tmp_path / "parallel", solo_run(common))
    losses = [train_losses(run) for run in runs]
    assert sorted(losses[0]) == sorted(losses[1]) and losses[1]
    for step in losses[1]:
        assert losses[0][step] == pytest.approx(losses[1][step], abs=1e-5), step
    evals = [[r["val_loss"] for r in read_metrics(run) if r["kind"] == "eval"] for run in runs]
    assert evals[0] == pytest.approx(evals[1], abs=1e-5)
    return runs


# The 2-process EDGC job of test_torchrun (exact resume) and test_fault_tolerance (killed worker):
# 20 steps, checkpoints at 10 and 20, compressing from step 3 (warm-up floor ⌊0.1·20⌋ = 2).
EDGC_JOB = [
    "--steps",
    "20",
    "--eval-every",
    "10",
    "--ckpt-every",
    "10",
    "--compressor",
    "edgc",
    "--edgc",
    "r_max=8",
    "--edgc",
    "warmup_error_test=false",
    "--comm-trace",
    *FAST,
]


@pytest.fixture(scope="session")
def reference_run(tmp_path_factory, cache_dir) -> Path:
    """One uninterrupted 2-process run of EDGC_JOB, shared by the tests that compare against it."""
    run_dir = tmp_path_factory.mktemp("reference") / "a"
    proc = run_edgc("train", "--out", str(run_dir), "--nproc", "2", *EDGC_JOB, "--cache-dir", str(cache_dir))
    assert proc.returncode == 0, proc.stderr[-3000:]
    return run_dir
