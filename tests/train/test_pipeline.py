"""`edgc train --pp`: pipeline correctness against a single process, and PP2 × DP2 with EDGC's DAC.

Runs (the 2-layer, 128-wide SMALL_MODEL, 2 pipeline micro-batches per step), steps of the one
launch of `shared_runs` (tests/train/conftest.py) after those of test_tensor_parallel, test_fsdp_train and
test_moe_train, on the first 4, 2 or 1 of its 8 processes:
  pp   `--pp 2 --nproc 4` (PP2 × DP2), 1F1B, compression off, 6 steps;   solo  the same data in 1 process, no pipeline
  a    `--pp 2 --nproc 4` (PP2 × DP2) with EDGC, 12 steps, checkpoints every window (4, 8, 12)
  b    a copy of a cut back to its step-8 checkpoint, then `--resume`d. At a window boundary: a later
       stage's rank comes from timings measured in its window (DAC), so a resume inside a window
       would re-measure part of it and could rightly choose differently
  (a and b send their activation gradients compressed: --interstage all, rank following the DP rank)
  is   `--pp 2 --nproc 2` with --interstage all (static PowerSGD) / cooldown (Optimus-CC: PowerSGD on stage 0
       only; the Optimus-CC test reads this run too)
"""

from __future__ import annotations

from pathlib import Path

import pytest

from .conftest import FAST, SMALL_MODEL, and_resumed, assert_matches_solo, read_metrics, train_losses

# whichever test comes first sets up `shared_runs`: one launch of every run of four files (minutes on
# a loaded 2-core machine); the launch has its own timeout and every collective in it one
pytestmark = pytest.mark.timeout(1800)

SMALL = [*FAST, *SMALL_MODEL, "--seq-len", "32", "--micro-batch", "2", "--grad-accum", "2", "--eval-batches", "2"]
EDGC = [
    "--compressor",
    "edgc",
    "--edgc",
    "r_max=8",
    "--edgc",
    "window=4",
    "--edgc",
    "profile_max_rank=8",
    "--edgc",
    "profile_steps_per_rank=1",
    "--edgc",
    "warmup_error_test=false",
    "--edgc",
    "iteration_sample_ratio=0.5",
    "--edgc",
    "rank_mapping=cqm",
    "--edgc",
    "entropy_estimator=gaussian",
    "--edgc",
    "entropy_significance=0",
]  # no noise gate: 12 steps must show rank changes
EDGC_DAC = [*EDGC, "--interstage", "all", "--interstage-rank", "6", "--interstage-min-rank", "3"]
# The uncompressed runs compared with one process (test_tensor_parallel's too: one solo run for all)
UNCOMPRESSED = ["--steps", "6", "--eval-every", "3", "--compressor", "none", *SMALL]


# The data-parallel compressor of each interstage run. Optimus-CC pairs compressing the first stages'
# gradients with compressing activation gradients, so the cool-down run is also the Optimus-CC run: one
# run asserts both, and every interstage invariant below holds whatever the stages' compressor.
INTERSTAGE_COMPRESSOR = {
    "all": ["--compressor", "powersgd"],
    "cooldown": ["--compressor", "optimus-cc", "--selective-stages", "1"],
}
DAC_JOB = ["--pp", "2", "--steps", "12", "--ckpt-every", "4", "--eval-every", "0", *EDGC_DAC, *SMALL]


def interstage_job(mode: str) -> list[str]:
    """The 10-step `--pp 2` run on 2 processes with ``--interstage mode``."""
    job = ["--pp", "2", "--steps", "10", "--eval-every", "0", *INTERSTAGE_COMPRESSOR[mode], "--powersgd-rank", "4"]
    return [*job, "--interstage", mode, "--interstage-rank", "2", "--lr", "3e-3", *SMALL]


def pipeline_steps(root: Path, cache_dir: Path, runs: dict[str, Path]) -> list[dict]:
    """The plan steps of this file's runs and of the single-process run (last: 1 process); their folders
    go into ``runs``."""
    names = ["pp", "dac-a", "dac-b", "interstage-all", "interstage-cooldown", "solo"]
    runs |= {name: root / name for name in names}
    cache = ["--cache-dir", str(cache_dir)]
    # PP2 × DP2 with micro-batch 2 per replica reads exactly the blocks of one process with micro-batch 4.
    # The 1F1B schedule here; GPipe's in test_tensor_parallel's TP × PP × DP comparison.
    parity = ["--out", str(runs["pp"]), "--pp", "2", "--pp-schedule", "1f1b", *UNCOMPRESSED, *cache]
    steps = [{"train": parity}, *and_resumed(runs["dac-a"], runs["dac-b"], DAC_JOB, cache_dir)]
    steps = [{**step, "nproc": 4} for step in steps]
    for mode in INTERSTAGE_COMPRESSOR:
        steps.append({"train": ["--out", str(runs[f"interstage-{mode}"]), *interstage_job(mode), *cache], "nproc": 2})
    solo = ["--out", str(runs["solo"]), *UNCOMPRESSED, *cache, "--micro-batch", "4"]
    return [*steps, {"train": solo, "nproc": 1}]


def test_pp2_dp2_matches_the_single_process_run_when_uncompressed(shared_runs):
    assert_matches_solo(shared_runs["pp"], shared_runs["solo"])


@pytest.fixture(scope="module")
def dac_runs(shared_runs):
    return shared_runs["dac-a"], shared_runs["dac-b"]


def test_pp2_dp2_stages_agree_and_stage0_rank_adapts(dac_runs):
    a, _ = dac_runs
    train = [r for r in read_metrics(a) if r["kind"] == "train"]
    assert [r["step"] for r in train] == list(range(1, 13))
    for r in train:
        assert [s["stage"] for s in r["stages"]] == [0, 1]
        assert all(s["replicas_agree"] for s in r["stages"])  # every replica of a stage used the same rank
        assert r["rank"] == r["stages"][0]["rank"]
    assert train[0]["phase"] == "profile"  # every stage measures its sync-time table first
    compressing = [r for r in train if r["phase"] == "compress"]
    assert compressing and len({r["rank"] for r in compressing}) >= 2
    assert all(r["bytes_sent"] == sum(s["bytes_sent"] for s in r["stages"]) for r in train)
    aligned = [s for r in compressing for s in r["stages"] if s["predicted_s"] is not None]
    # a later stage fits its budget, unless even its smallest rank cannot (then it syncs at r_min)
    assert aligned and all(
        s["budget_s"] >= s["predicted_s"] - 1e-9 or s["at_rank_floor"] for s in aligned if s["stage"] > 0
    )
    # checkpoints are only written after the replicas' parameter digests matched
    assert (a / "checkpoints" / "step_000008" / "model_stage1.pt").is_file()


def test_pp2_dp2_resume_is_exact(dac_runs):
    a, b = dac_runs
    losses_a, losses_b = train_losses(a), train_losses(b)
    assert [losses_b[s] for s in range(9, 13)] == [losses_a[s] for s in range(9, 13)]


def test_report_plots_the_stages(dac_runs, tmp_path):
    from edgc_train.report import build_report

    build_report([dac_runs[0]], tmp_path / "report")
    assert (tmp_path / "report" / "stages.png").stat().st_size > 20_000
    assert "stages.png" in (tmp_path / "report" / "report.md").read_text()


def test_optimus_cc_compresses_only_the_first_stages(interstage_run):
    train = [r for r in read_metrics(interstage_run("cooldown")) if r["kind"] == "train"]
    assert train[-1]["stages"][0]["rank"] == 4  # static rank on stage 0 after the warm-up
    assert all(r["stages"][1]["rank"] is None for r in train)  # stage 1 always uncompressed


def test_dac_run_sends_activation_gradients_at_a_rank_that_follows_the_entropy_rank(dac_runs):
    a, _ = dac_runs
    train = [r for r in read_metrics(a) if r["kind"] == "train"]
    leader_ranks = {max(3, min(6, r["stages"][0]["rank"])) for r in train if r["phase"] == "compress"}
    first_compressing = min(r["step"] for r in train if r["phase"] == "compress")
    for r in train:
        stage0, stage1 = r["stages"]
        assert stage0["interstage_bytes_sent"] == 0 and stage0["interstage_rank"] is None  # nothing to send back
        assert r["interstage_bytes_raw"] == stage1["interstage_bytes_raw"] > 0
        if r["step"] < first_compressing:  # raw while stage 0 does not compress (EDGC's warm-up)
            assert stage1["interstage_rank"] is None and r["interstage_bytes_sent"] > r["interstage_bytes_raw"]
        elif stage1["interstage_rank"] is not None:  # stage 0's entropy rank, clamped to [3, 6]
            assert r["phase"] == "compress" and stage1["interstage_rank"] in leader_ranks
            # stage 1 learns the rank at a window boundary, so it never runs ahead of stage 0
            assert stage1["interstage_rank"] == max(3, min(6, stage0["rank"]))
    assert any(r["stages"][1]["interstage_rank"] for r in train)
    assert any(r["interstage_bytes_sent"] < r["interstage_bytes_raw"] / 2 for r in train)


@pytest.fixture(scope="module")
def interstage_run(shared_runs):
    """``interstage_run(mode)``: the 10-step 2-process run with ``--interstage mode``."""
    return lambda mode: shared_runs[f"interstage-{mode}"]


@pytest.mark.parametrize("mode", ["all", "cooldown"])
def test_interstage_compression_two_stages_loss_falls_and_bytes_match_the_formula(interstage_run, mode):
    from edgc.parallel.interstage import wire_bytes

    run = interstage_run(mode)
    train = [r for r in read_metrics(run) if r["kind"] == "train"]
    m, n = 2 * 32, 128  # (micro-batch · tokens, SMALL_MODEL's hidden size); grad_accum 2
    ranks = [2, 2] if mode == "all" else [0, 2]  # cool-down: the last pp − 1 = 1 micro-batch
    for r in train:
        assert r["stages"][1]["interstage_rank"] == 2
        assert r["interstage_bytes_sent"] == sum(wire_bytes(m, n, k) for k in ranks)
        assert r["interstage_bytes_raw"] == 2 * 4 * m * n
        for stage in r["stages"]:  # the timed spans are disjoint parts of the stage's schedule
            assert 0 < stage["interstage_s"] and 0 < stage["forward_s"] and 0 < stage["backward_s"]
            assert stage["interstage_s"] + stage["forward_s"] + stage["backward_s"] <= stage["pipeline_s"] + 1e-6
            # its parts: payload transfers (receiver) and compress/decompress, inside the exchanges
            assert 0 <= stage["interstage_wire_s"] and 0 < stage["interstage_compress_s"]
            assert stage["interstage_wire_s"] + stage["interstage_compress_s"] <= stage["interstage_s"] + 1e-6
        assert r["stages"][0]["interstage_wire_s"] > 0 and r["stages"][1]["interstage_wire_s"] == 0  # stage 0 receives
        assert r["interstage_time_s"] == pytest.approx(sum(s["interstage_s"] for s in r["stages"]))
    losses = [r["loss"] for r in train]
    assert sum(losses[-3:]) / 3 < sum(losses[:3]) / 3 - 0.1
