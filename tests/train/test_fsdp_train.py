"""End to end: `edgc train --fsdp` on 4 processes (2 replicas × 2 shards), and an exact resume (steps of
the one launch of `shared_runs`, tests/train/conftest.py).

A: an 8-step EDGC job, uninterrupted, checkpoints at 4 and 8, compressing from step 3.
B: A's folder cut back to its step-4 checkpoint, then `--resume`d: B's losses at steps 5-8 and its
   final checkpoint's model and optimizer shards must equal A's bit for bit.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from .conftest import FAST, SMALL_MODEL, and_resumed, read_metrics, train_losses

# whichever test comes first sets up `shared_runs`: one launch of every run of four files (minutes on
# a loaded 2-core machine); the launch has its own timeout and every collective in it one
pytestmark = pytest.mark.timeout(1800)

# lr 3e-3: the small model's loss falls by ~0.9 in the 8 steps, as the tiny preset's did at 1e-3
FSDP_JOB = [
    *SMALL_MODEL,
    "--lr",
    "3e-3",
    "--fsdp",
    "--fsdp-shard",
    "2",
    "--steps",
    "8",
    "--eval-every",
    "4",
    "--ckpt-every",
    "4",
    "--compressor",
    "edgc",
    "--edgc",
    "r_max=8",
    "--edgc",
    "warmup_error_test=false",
    "--edgc",
    "warmup_fraction=0.1",
    *FAST,
]


def fsdp_steps(root: Path, cache_dir: Path, runs: dict[str, Path]) -> list[dict]:
    """The plan steps of A and B (4 processes) in `shared_runs`' launch; their folders go into ``runs``."""
    runs |= {"fsdp-a": root / "fsdp-a", "fsdp-b": root / "fsdp-b"}
    return [{**step, "nproc": 4} for step in and_resumed(runs["fsdp-a"], runs["fsdp-b"], FSDP_JOB, cache_dir)]


@pytest.fixture(scope="module")
def runs(shared_runs):
    return shared_runs["fsdp-a"], shared_runs["fsdp-b"]


def test_fsdp_run_compresses_and_learns(runs):
    a, _ = runs
    train = [r for r in read_metrics(a) if r["kind"] == "train"]
    assert [r["step"] for r in train] == list(range(1, 9))
    compressed = [r for r in train if r["phase"] == "compress"]
    assert len(compressed) >= 6
    assert all(0 < r["bytes_sent"] < r["bytes_raw"] / 4 for r in compressed)
    assert train[-1]["loss"] < train[0]["loss"] - 0.5
    files = {p.name for p in (a / "checkpoints" / "step_000008").iterdir()}
    assert {"model_shard0.pt", "model_shard1.pt", "optimizer_shard0.pt", "optimizer_shard1.pt"} <= files
    assert json.loads((a / "config.json").read_text())["fsdp"] is True


def test_fsdp_resume_reproduces_the_uninterrupted_run(runs):
    a, b = runs
    la, lb = train_losses(a), train_losses(b)
    for step in range(5, 9):
        assert lb[step] == la[step], (step, la[step], lb[step])
    assert [r["val_loss"] for r in read_metrics(a) if r["kind"] == "eval"] == [
        r["val_loss"] for r in read_metrics(b) if r["kind"] == "eval"
    ]
    manifest_a = json.loads((a / "checkpoints" / "step_000008" / "manifest.json").read_text())["files"]
    manifest_b = json.loads((b / "checkpoints" / "step_000008" / "manifest.json").read_text())["files"]
    for name in ("model_shard0.pt", "model_shard1.pt"):
        assert manifest_a[name]["sha256"] == manifest_b[name]["sha256"], name


@pytest.mark.parametrize(
    "values, match",
    [
        ({"fsdp": True, "compressor": "topk"}, "with --fsdp must be one of"),
        ({"fsdp": True, "pp": 2, "grad_accum": 2}, "cannot be combined with --pp"),
        ({"fsdp": True, "fsdp_shard": -1}, "fsdp_shard"),
    ],
)
def test_fsdp_config_is_checked(values, match):
    from edgc_train.config import TrainConfig

    with pytest.raises(ValueError, match=match):
        TrainConfig.from_dict(values)
