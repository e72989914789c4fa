"""`edgc train --tp`: tensor parallelism through DTensor, alone and in TP × PP × DP.

Runs (a 2-layer, 128-wide model, seq 32, 2 micro-batches of 2 per replica and step), the first steps of the one
launch of `shared_runs` (tests/train/conftest.py), on all 8 of its processes:
  tp3d   `--tp 2 --pp 2` on 8 processes (TP2 × PP2 × DP2), GPipe, compression off, 6 steps, evaluated at 3 and 6;
         solo  the same data in 1 process (the one test_pipeline compares with)
  a / b  `--tp 2 --pp 2` on 8 processes with EDGC and --interstage all, 8 steps, checkpoints at 4 and 8; b = a cut
         back to step 4 and `--resume`d (TP × DP without pipeline stages, with EDGC: tests/integrations/
         test_llama_tp_dp.py)
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from .conftest import and_resumed, assert_matches_solo, read_metrics, train_losses
from .test_pipeline import EDGC_DAC, SMALL, UNCOMPRESSED

# whichever test comes first sets up `shared_runs`: one launch of every run of four files (minutes on
# a loaded 2-core machine); the launch has its own timeout and every collective in it one
pytestmark = pytest.mark.timeout(1800)

TP_PP = ["--tp", "2", "--pp", "2"]
TP_EDGC_JOB = [*TP_PP, "--steps", "8", "--ckpt-every", "4", "--eval-every", "0", "--lr", "3e-3", *EDGC_DAC, *SMALL]


def tensor_parallel_steps(root: Path, cache_dir: Path, runs: dict[str, Path]) -> list[dict]:
    """The plan steps of this file's runs (8 processes each); their folders go into ``runs``."""
    runs |= {"tp3d": root / "tp3d", "tp-a": root / "tp-a", "tp-b": root / "tp-b"}
    parity = ["--out", str(runs["tp3d"]), *TP_PP, "--pp-schedule", "gpipe", *UNCOMPRESSED]
    parity += ["--cache-dir", str(cache_dir)]
    return [{"train": parity}, *and_resumed(runs["tp-a"], runs["tp-b"], TP_EDGC_JOB, cache_dir)]


@pytest.fixture(scope="module")
def runs_3d(shared_runs):
    return shared_runs["tp-a"], shared_runs["tp-b"]


def test_tp2_pp2_dp2_matches_the_single_process_run_when_uncompressed(shared_runs):
    assert_matches_solo(shared_runs["tp3d"], shared_runs["solo"])
    assert sorted(train_losses(shared_runs["tp3d"])) == list(range(1, 7))


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
