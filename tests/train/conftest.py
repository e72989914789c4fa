"""Shared helpers for the training-harness tests: a small corpus slice, fast flags, subprocess runs."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from edgc_train.plan import cut_back  # noqa: F401  (the tests' interrupted runs)

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
# A 2-layer, 128-wide model: a third to a half of the tiny preset's step time, for the multi-process runs whose
# invariants (parity with one process, replicas identical, exact resume, bytes) do not depend on the model's size.
SMALL_MODEL = ["--n-layer", "2", "--n-embd", "128", "--n-head", "4"]


@pytest.fixture(scope="session")
def cache_dir(tmp_path_factory) -> Path:
    """One data cache for the whole session, so the tokenizer is trained once."""
    return tmp_path_factory.mktemp("data_cache")


def run_edgc(*args: str, timeout: int = 240) -> subprocess.CompletedProcess:
    """`edgc ...` in a subprocess, 1 thread per process, killed after ``timeout`` seconds."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"}
    return subprocess.run([*EDGC, *args], cwd=REPO, env=env, capture_output=True, text=True, timeout=timeout)


def run_plan(folder: Path, nproc: int, steps: list[dict], timeout: int = 900) -> None:
    """``steps`` (edgc_train.plan's: ``{"train": [...]}``, ``{"cut_back": [...]}``, each with an optional
    ``nproc``) in one launch of ``nproc`` processes; asserts it succeeded."""
    plan = folder / "plan.json"
    plan.write_text(json.dumps(steps))
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"}
    command = [sys.executable, "-m", "edgc_train.plan", "--nproc", str(nproc), str(plan)]
    proc = subprocess.run(command, cwd=REPO, env=env, capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-6000:]


def and_resumed(a: Path, b: Path, job: list[str], cache_dir: Path) -> list[dict]:
    """Plan steps: ``job`` into ``a``, uninterrupted; ``b``, a copy of ``a`` cut back before its last
    checkpoint (the ``--steps`` of ``job``), then resumed."""
    steps = int(job[job.index("--steps") + 1])
    return [
        {"train": ["--out", str(a), *job, "--cache-dir", str(cache_dir)]},
        {"cut_back": [str(a), str(b), steps]},
        {"train": ["--resume", str(b), "--no-progress"]},
    ]


def read_metrics(run_dir: Path) -> list[dict]:
    """The run's metric records; a last line still being written (no newline yet) is left out, so a
    test may poll the file of a running run."""
    text = (run_dir / "metrics.jsonl").read_text()
    complete = text if text.endswith("\n") else text[: text.rfind("\n") + 1]
    return [json.loads(line) for line in complete.splitlines() if line.strip()]


def train_losses(run_dir: Path) -> dict[int, float]:
    return {r["step"]: r["loss"] for r in read_metrics(run_dir) if r["kind"] == "train"}


@pytest.fixture(scope="session")
def shared_runs(tmp_path_factory, cache_dir) -> dict[str, Path]:
    """Every run of test_tensor_parallel, test_pipeline, test_fsdp_train and test_moe_train (name → run
    folder), in one launch of 8 processes: the TP × PP × DP runs on all 8, then the PP × DP, FSDP and MoE
    runs on 4, the 2-stage runs on 2, and the single-process run the TP and PP runs compare with on 1."""
    from .test_fsdp_train import fsdp_steps
    from .test_moe_train import moe_steps
    from .test_pipeline import pipeline_steps
    from .test_tensor_parallel import tensor_parallel_steps

    root = tmp_path_factory.mktemp("shared")
    runs: dict[str, Path] = {}
    steps = tensor_parallel_steps(root, cache_dir, runs) + fsdp_steps(root, cache_dir, runs)
    steps += moe_steps(root, cache_dir, runs) + pipeline_steps(root, cache_dir, runs)
    run_plan(root, 8, steps, timeout=1800)
    return runs


def assert_matches_solo(parallel: Path, solo: Path) -> None:
    """The same data in a parallel job and in one process with micro-batch 4: their train and eval
    losses agree to 1e-5, at every step."""
    losses = [train_losses(run) for run in (parallel, solo)]
    assert sorted(losses[0]) == sorted(losses[1]) and losses[1]
    for step in losses[1]:
        assert losses[0][step] == pytest.approx(losses[1][step], abs=1e-5), step
    evals = [[r["val_loss"] for r in read_metrics(run) if r["kind"] == "eval"] for run in (parallel, solo)]
    assert evals[0] == pytest.approx(evals[1], abs=1e-5)


# The 2-process EDGC job of test_torchrun (exact resume) and test_fault_tolerance (killed worker):
# 12 steps, evaluated and checkpointed at 6 and 12, compressing from step 3 (EDGC's floor of 2 warm-up steps).
EDGC_STEPS, EDGC_CHECKPOINT = 12, 6
EDGC_JOB = [
    "--steps",
    str(EDGC_STEPS),
    "--eval-every",
    str(EDGC_CHECKPOINT),
    "--ckpt-every",
    str(EDGC_CHECKPOINT),
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
