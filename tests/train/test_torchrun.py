"""End to end: `edgc train --nproc 2` (torchrun, gloo) on the tiny preset, and an exact resume.

Two 2-process runs (~15-40 s each on 2 shared cores):
  A  a 12-step EDGC job, uninterrupted, checkpoints at steps 6 and 12;
  B  a copy of A's folder cut back to its step-6 checkpoint (as if A had died after step 6; the
     metric lines of steps 7-12 are still there and must be dropped), then `--resume`d to step 12.
B's losses at steps 7-12 must equal A's bit for bit. (`--stop-at` is covered in test_cli.py.)
EDGC is given r_max=8 and no warm-up error test, so it compresses from step 3 on (warm-up floor
of 2 steps): the resume must then restore error feedback and Q factors, not just the model.
"""

from __future__ import annotations

import json
import math

import pytest

from .conftest import EDGC_CHECKPOINT, EDGC_STEPS, cut_back, read_metrics, run_edgc, train_losses

STEPS = list(range(1, EDGC_STEPS + 1))
CHECKPOINTS = [f"step_{step:06d}" for step in (EDGC_CHECKPOINT, EDGC_STEPS)]
TRAIN_KEYS = {
    "kind",
    "step",
    "wall_s",
    "loss",
    "lr",
    "step_time_s",
    "compute_time_s",
    "comm_time_s",
    "comm_wait_s",
    "compress_time_s",
    "collectives",
    "tokens_per_s",
    "phase",
    "rank",
    "ranks",
    "entropy",
    "elements_sent",
    "elements_raw",
    "bytes_sent",
    "bytes_raw",
}


@pytest.fixture(scope="module")
def runs(tmp_path_factory, reference_run):
    a, b = reference_run, tmp_path_factory.mktemp("runs") / "b"
    cut_back(a, b, EDGC_STEPS)
    # A crashed save of the last step left its temp folder: not a checkpoint, and cleared when that step is saved.
    (b / "checkpoints" / f".{CHECKPOINTS[-1]}.tmp").mkdir()
    (b / "checkpoints" / f".{CHECKPOINTS[-1]}.tmp" / "model.pt").write_bytes(b"partial")
    proc = run_edgc("train", "--resume", str(b), "--nproc", "2", "--no-progress")
    assert proc.returncode == 0, proc.stderr[-3000:]
    return a, b


def test_two_process_run_learns(runs):
    a, _ = runs
    losses = train_losses(a)
    assert sorted(losses) == STEPS
    first, last = sum(losses[s] for s in STEPS[:3]) / 3, sum(losses[s] for s in STEPS[-3:]) / 3
    assert last < first - 0.5, losses
    evals = [r for r in read_metrics(a) if r["kind"] == "eval"]
    assert [r["step"] for r in evals] == [EDGC_CHECKPOINT, EDGC_STEPS]
    assert evals[-1]["val_loss"] < math.log(512) - 0.5  # clearly better than a uniform guess
    assert evals[-1]["val_ppl"] == pytest.approx(math.exp(evals[-1]["val_loss"]))


def test_metrics_follow_the_contract(runs):
    a, _ = runs
    train = [r for r in read_metrics(a) if r["kind"] == "train"]
    for r in train:
        assert TRAIN_KEYS <= set(r), TRAIN_KEYS - set(r)
        assert r["step_time_s"] > 0 and r["tokens_per_s"] == pytest.approx(2 * 4 * 64 / r["step_time_s"])
        assert r["compute_time_s"] == pytest.approx(
            max(0.0, r["step_time_s"] - r["comm_wait_s"] - r["compress_time_s"])
        )
        assert r["bytes_raw"] == 4 * r["elements_raw"] > 0
    # Warm-up (steps 1-2) sends everything; afterwards rank-8 factors, far fewer elements.
    assert [r["phase"] for r in train[:2]] == ["warmup", "warmup"]
    assert all(r["phase"] == "compress" and r["rank"] == 8 for r in train[2:])
    assert all(r["elements_sent"] == r["elements_raw"] for r in train[:2])
    assert all(r["elements_sent"] < r["elements_raw"] / 5 for r in train[2:])
    # one collective per DDP bucket in the warm-up, at least three (raw tensors, P, Q) per bucket after
    assert all(r["collectives"] >= 1 for r in train[:2]) and all(r["collectives"] >= 3 for r in train[2:])
    assert 8 in set(train[-1]["ranks"].values())
    assert any(r["entropy"] is not None for r in train)
    config = json.loads((a / "config.json").read_text())
    for key in (
        "preset",
        "n_params",
        "world_size",
        "micro_batch",
        "seq_len",
        "grad_accum",
        "steps",
        "compressor",
        "seed",
        "edgc",
        "started_at",
    ):
        assert key in config
    assert config["world_size"] == 2 and config["compressor"] == "edgc" and config["edgc"]["r_max"] == 8
    assert 3_000_000 < config["n_params"] < 5_000_000
    summary = json.loads((a / "summary.json").read_text())
    assert (
        summary["steps"] == EDGC_STEPS
        and summary["val_loss"] == [r for r in read_metrics(a) if r["kind"] == "eval"][-1]["val_loss"]
    )


def test_comm_trace_lines_up_with_the_metrics_on_every_rank(runs):
    """--comm-trace: each rank logs its collectives' durations per step; rank 0's sum is its comm_time_s,
    and a resume cuts the traces back to the checkpoint like metrics.jsonl (steps 7-12 once each)."""
    for run in runs:
        train = {r["step"]: r for r in read_metrics(run) if r["kind"] == "train"}
        traces = [
            [json.loads(line) for line in (run / "comm_trace" / f"rank{k}.jsonl").read_text().splitlines()]
            for k in (0, 1)
        ]
        for trace in traces:
            assert [t["step"] for t in trace] == STEPS
            for t in trace:  # the same collectives in the same order on both ranks
                assert len(t["collective_s"]) == train[t["step"]]["collectives"] and min(t["collective_s"]) > 0
        for t in traces[0]:
            assert sum(t["collective_s"]) == pytest.approx(train[t["step"]]["comm_time_s"], rel=1e-9)


def test_checkpoint_layout(runs):
    a, b = runs
    for run in runs:
        assert sorted(p.name for p in (run / "checkpoints").iterdir()) == CHECKPOINTS
    files = {p.name for p in (a / "checkpoints" / CHECKPOINTS[0]).iterdir()}
    assert files == {
        "model.pt",
        "optimizer.pt",
        "scheduler.pt",
        "trainer.json",
        "manifest.json",
        "rank0.pt",
        "rank1.pt",
        "edgc_rank0.pt",
        "edgc_rank1.pt",
    }


def test_resume_reproduces_uninterrupted_losses_exactly(runs):
    a, b = runs
    la, lb = train_losses(a), train_losses(b)
    steps = [r["step"] for r in read_metrics(b) if r["kind"] == "train"]
    assert steps == STEPS  # lines 7-12 of the copy were dropped, then written anew
    for step in STEPS[EDGC_CHECKPOINT:]:
        assert lb[step] == la[step], (step, la[step], lb[step])
    ea = [r["val_loss"] for r in read_metrics(a) if r["kind"] == "eval"]
    eb = [r["val_loss"] for r in read_metrics(b) if r["kind"] == "eval"]
    assert ea == eb
