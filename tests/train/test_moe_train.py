"""End to end: `edgc train --moe-experts 4 --ep 2` on 4 processes (EP 2 × DP 2), and an exact resume (steps
of the one launch of `shared_runs`, tests/train/conftest.py).

A: an 8-step EDGC job on both groups (ranks of the experts split by their tokens every 2-step window),
   uninterrupted, checkpoints at 4 and 8, compressing from step 2; its replicas are verified at each
   checkpoint (each expert over its two replicas, the dense parameters over all four).
B: A's folder cut back to its step-4 checkpoint, then `--resume`d: B's losses at steps 5-8 and its
   final checkpoint's model shards must equal A's bit for bit.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from edgc_train.config import TrainConfig

from .conftest import FAST, and_resumed, read_metrics, train_losses

# whichever test comes first sets up `shared_runs`: one launch of every run of four files (minutes on
# a loaded 2-core machine); the launch has its own timeout and every collective in it one
pytestmark = pytest.mark.timeout(1800)

MOE_JOB = [
    *"--moe-experts 4 --ep 2 --n-layer 2 --n-embd 64 --n-head 4 --steps 8 --eval-every 4 --ckpt-every 4".split(),
    *"--compressor edgc --edgc r_max=4 --edgc warmup_error_test=false --edgc window=2".split(),
    *"--edgc rank_split=tokens".split(),
    *FAST,
]


def moe_steps(root: Path, cache_dir: Path, runs: dict[str, Path]) -> list[dict]:
    """The plan steps of A and B (4 processes) in `shared_runs`' launch; their folders go into ``runs``."""
    runs |= {"moe-a": root / "moe-a", "moe-b": root / "moe-b"}
    return [{**step, "nproc": 4} for step in and_resumed(runs["moe-a"], runs["moe-b"], MOE_JOB, cache_dir)]


@pytest.fixture(scope="module")
def runs(shared_runs):
    return shared_runs["moe-a"], shared_runs["moe-b"]


def test_an_moe_run_compresses_both_groups_and_learns(runs):
    a, _ = runs
    train = [r for r in read_metrics(a) if r["kind"] == "train"]
    assert [r["step"] for r in train] == list(range(1, 9))
    compressed = [r for r in train if r["phase"] == "compress"]
    assert len(compressed) >= 6
    for r in compressed:
        assert 0 < r["dense_bytes_sent"] < r["dense_bytes_raw"] / 4
        assert 0 < r["expert_bytes_sent"] < r["expert_bytes_raw"] / 4
        assert r["bytes_sent"] == r["dense_bytes_sent"] + r["expert_bytes_sent"]
        assert any(name.endswith("experts.w1[0]") for name in r["ranks"])  # each expert its own matrix
    assert train[-1]["loss"] < train[0]["loss"] - 0.2  # 8 steps of a warming-up LR
    files = {p.name for p in (a / "checkpoints" / "step_000008").iterdir()}
    assert {"model_ep0.pt", "model_ep1.pt", "optimizer_ep0.pt", "optimizer_ep1.pt"} <= files
    assert all(r["aux_loss"] > 0 for r in train)


def test_an_moe_run_resumes_bit_for_bit(runs):
    a, b = runs
    resumed, uninterrupted = train_losses(b), train_losses(a)
    assert {step: resumed[step] for step in range(5, 9)} == {step: uninterrupted[step] for step in range(5, 9)}
    for shard in ("model_ep0.pt", "model_ep1.pt"):
        saved = [torch.load(run / "checkpoints" / "step_000008" / shard) for run in (a, b)]
        assert saved[0].keys() == saved[1].keys()
        assert all(torch.equal(saved[0][key], saved[1][key]) for key in saved[0]), shard


@pytest.mark.parametrize(
    "fields, words",
    [
        ({"ep": 2}, "ep: needs --moe-experts"),
        ({"moe_experts": 4, "ep": 3}, "ep: must divide --moe-experts 4"),
        ({"moe_experts": 4, "moe_top_k": 5}, "moe_top_k: must be an integer in [1, 4]"),
        ({"moe_experts": 4, "compressor": "topk"}, "compressor: with --moe-experts must be one of"),
        ({"moe_experts": 4, "fsdp": True, "compressor": "edgc"}, "not with --fsdp"),
    ],
)
def test_moe_flags_that_cannot_run_are_refused_in_one_line(fields, words):
    with pytest.raises(ValueError) as error:
        TrainConfig(**fields)
    assert words in str(error.value) and "\n" not in str(error.value)
