"""`edgc experiment moe`: the arms it runs, the default the paired interval sets, one small run in process.

The run is the smoke setting on one process (no expert parallelism: `tests/train/test_moe_train.py`
runs EP 2 × DP 2); it checks what the experiment measures, not what it finds."""

from __future__ import annotations

import argparse
import json

import pytest

from edgc_cli.main import main
from edgc_experiments import moe


def test_routed_and_one_rank_differ_only_in_the_split():
    args = argparse.Namespace(experts=4, top_k=2, ep=2, rank=4, tiny=False)
    one, routed = moe.arm_flags(args, "one-rank", 400), moe.arm_flags(args, "routed", 400)
    assert [f for f in one if "rank_split" not in f] == [f for f in routed if "rank_split" not in f]
    assert "rank_split=uniform" in one and "rank_split=tokens" in routed
    assert "window=20" in routed  # EDGC's window at 400 steps: the split follows the tokens every 20 steps
    assert moe.arm_flags(args, "uncompressed", 400)[-2:] == ["--compressor", "allreduce"]


@pytest.mark.parametrize("high, split", [(-0.001, "tokens"), (0.0, "uniform"), (0.02, "uniform")])
def test_the_default_split_is_tokens_only_where_its_whole_interval_is_below_zero(high, split):
    assert moe.default_split({"mean": high - 0.01, "low": high - 0.02, "high": high}) == split


def test_a_small_run_measures_both_groups_and_pairs_the_arms(tmp_path):
    flags = "experiment moe --tiny --steps 8 --seeds 1 --nproc 1 --ep 1 --experts 4 --top-k 1 --rank 8"
    flags += " --n-layer 1 --n-embd 32 --n-head 2"
    assert main([*flags.split(), "--out", str(tmp_path)]) == 0
    out = tmp_path / "moe"
    data = json.loads((out / "results.json").read_text())
    results = data["results"]
    assert list(results) == list(moe.ARMS)
    assert results["uncompressed"][0]["both"] == 1.0
    for arm in ("edgc", "one-rank", "routed"):
        assert 0 < results[arm][0]["dense"] < 1 and 0 < results[arm][0]["expert"] < 1, arm
    # routed shares one rank's bytes among the experts; a grown Q's exchange at a rank change comes on top
    assert 1.0 <= data["same_bytes"][0] < 1.01
    lines = [json.loads(line) for line in (out / "seed1337" / "routed" / "metrics.jsonl").read_text().splitlines()]
    ranks = [r["ranks"] for r in lines if r["kind"] == "train" and r["phase"] == "compress"]
    w1 = [{r[n[:-2] + f"{i}]"] for i in range(4)} for r in ranks for n in r if n.endswith("experts.w1[0]")]
    assert any(len(experts) > 1 for experts in w1)  # the tokens of a window gave the experts different ranks
    assert "**Headline:** EDGC sends" in (out / "summary.md").read_text()
