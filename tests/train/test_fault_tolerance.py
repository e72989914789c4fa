"""A worker killed with SIGKILL mid-run: torchrun restarts the group, `--auto-resume` continues from
the last complete checkpoint with every rank's EDGC state, and the result equals an uninterrupted run."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest
import torch

from .conftest import EDGC_CHECKPOINT, EDGC_JOB, EDGC_STEPS, REPO, read_metrics, train_losses


def torchrun(run_dir, cache_dir, *extra):
    return [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nnodes",
        "1",
        "--nproc_per_node",
        "2",
        "--standalone",  # c10d rendezvous on a port the agent binds as 0, kept across restarts
        *extra,
        "-m",
        "edgc_cli.main",
        "train",
        "--out",
        str(run_dir),
        "--auto-resume",
        "--cache-dir",
        str(cache_dir),
        *EDGC_JOB,
    ]


def final_model(run_dir):
    return torch.load(run_dir / "checkpoints" / f"step_{EDGC_STEPS:06d}" / "model.pt", weights_only=True)


@pytest.mark.timeout(600)
def test_killed_worker_restarts_and_matches_the_uninterrupted_run(tmp_path, cache_dir, reference_run):
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"}
    reference = reference_run

    killed = tmp_path / "killed"
    log = open(tmp_path / "torchrun.log", "w")  # a file, not a pipe: a full pipe would block the agent
    agent = subprocess.Popen(
        torchrun(killed, cache_dir, "--max-restarts", "1"),
        cwd=REPO,
        env=env,
        stdout=log,
        stderr=subprocess.STDOUT,
        text=True,
    )
    victim = None
    try:
        deadline = time.monotonic() + 180
        while victim is None and time.monotonic() < deadline and agent.poll() is None:
            metrics = killed / "metrics.jsonl"
            steps = [r["step"] for r in read_metrics(killed)] if metrics.exists() else []
            if steps and max(steps) >= EDGC_CHECKPOINT + 2:  # after a checkpoint, before the run's end
                workers = subprocess.run(["pgrep", "-P", str(agent.pid)], capture_output=True, text=True).stdout.split()
                victim = int(workers[-1])
                os.kill(victim, signal.SIGKILL)
            time.sleep(0.02)
        agent.wait(timeout=300)
    finally:
        if agent.poll() is None:
            agent.kill()
        log.close()
    output = (tmp_path / "torchrun.log").read_text()
    assert victim is not None, "the run finished before a worker could be killed"
    assert agent.returncode == 0, output[-3000:]  # a dead worker, yet the job succeeded: it was restarted

    # Training continued from a checkpoint (steps after it were run again) and ended identical.
    losses, expected = train_losses(killed), train_losses(reference)
    assert sorted(losses) == list(range(1, EDGC_STEPS + 1))
    assert losses == expected
    reference_model, resumed_model = final_model(reference), final_model(killed)
    assert all(torch.equal(reference_model[k], resumed_model[k]) for k in reference_model)
