"""`edgc train --tp`: tensor parallelism through DTensor, alone and in TP × PP × DP.

Runs (tiny preset, seq 32, 2 micro-batches of 2 per replica and step):
  tp3d   `--tp 2 --pp 2 --nproc 8` (TP2 × PP2 × DP2), GPipe, compression off, 6 steps, evaluated at 3 and 6;
         solo  the same data in 1 process (the one test_pipeline compares with)
  a / b  `--tp 2 --pp 2 --nproc 8` with EDGC and --interstage all, 8 steps, checkpoints at 4 and 8; b = a cut
         back to step 4 and `--resume`d (TP × DP without pipeline stages, with EDGC: tests/integrations/
         test_llama_tp_dp.py)
"""

from __future__ import annotations

import pytest
import torch

from .conftest import cut_back, read_metrics, run_edgc, run_parallel_and_solo, train_losses
from .test_pipeline import EDGC_DAC, SMALL, UNCOMPRESSED


def test_tp2_pp2_dp2_matches_the_single_process_run_when_uncompressed(tmp_path, cache_dir, solo_run):
    parallel, _ = run_parallel_and_solo(
        tmp_path,
        ["--nproc", "8", "--tp", "2", "--pp", "2", "--pp-schedule", "gpipe"],
        [*UNCOMPRESSED, "--cache-dir", str(cache_dir)],
        solo_run,
    )
    assert sorted(train_losses(parallel)) == list(range(1, 7))


@pytest.fixture(scope="module")
def runs_3d(tmp_path_factory, cache_dir):
    root = tmp_path_factory.mktemp("tp3d")
    a, b = root / "a", root / "b"
    proc = run_edgc(
        "train",
        "--out",
        str(a),
        "--nproc",
        "8",
        "--tp",
        "2",
        "--pp",
        "2",
        "--steps",
        "8",
        "--ckpt-every",
        "4",
        "--eval-every",
        "0",
        "--lr",
        "3e-3",
        "--cache-dir",
        str(cache_dir),
        *EDGC_DAC,
        *SMALL,
        timeout=400,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    cut_back(a, b, 8)
    proc = run_edgc("train", "--resume", str(b), "--nproc", "8", timeout=400)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return a, b


def test_tp2_pp2_dp2_with_edgc_keeps_replicas_identical_and_the_loss_falls(runs_3d):
    a, _ = runs_3d
    train = [r for r in read_metrics(a) if r["kind"] == "train"]
    assert any(r["phase"] == "compress" for r in train)
    # every DP replica of a stage, and every TP rank of every replica, used the same rank
    assert all(s["replicas_agree"] and s["tp_agree"] for r in train for s in r["stages"])
    assert any(r["bytes_sent"] < r["bytes_raw"] for r in train)
    assert any(r["interstage_bytes_sent"] for r in train)
    # Checkpoints are written only after the DP replicas of every TP shard had identical parameter
    # digests (train.verify_replicas); the replicated parameters are identical across TP ranks too.
    step = a / "checkpoints" / "step_000008"
    for stage in (0, 1):
        shards = [
            torch.load(step / f"model_stage{stage}_tp{t}.pt", map_location="cpu", weights_only=True) for t in (0, 1)
        ]
        replicated = [k for k in shards[0] if "ln_" in k or k.endswith("proj.bias") or k.startswith(("wte", "wpe"))]
        assert replicated and all(torch.equal(shards[0][k], shards[1][k]) for k in replicated)
        sharded = [k for k in shards[0] if k.endswith("attn.q.weight")]
        assert sharded and not torch.equal(shards[0][sharded[0]], shards[1][sharded[0]])
    losses = [r["loss"] for r in train]
    assert sum(losses[-3:]) / 3 < sum(losses[:3]) / 3 - 0.1


def test_tp2_pp2_dp2_resume_is_exact(runs_3d):
    a, b = runs_3d
    losses_a, losses_b = train_losses(a), train_losses(b)
    assert [losses_b[s] for s in range(5, 9)] == [losses_a[s] for s in range(5, 9)]
