"""StageAligner protocol on 2 processes = 2 pipeline stages (DP 1), no real pipeline compute."""

import contextlib
import math

import pytest
import torch
import torch.distributed as dist
from distributed_harness import run_distributed

from edgc import EDGCConfig, EDGCState, LowRankConfig
from edgc.parallel.pipeline import StageAligner
from edgc_probes.stream_check import StreamChecker

CONFIG = dict(
    r_max=8,
    r_min=2,
    window=4,
    total_steps=40,
    warmup_fraction=0.1,
    warmup_error_test=False,
    profile_max_rank=8,
    profile_steps_per_rank=1,
    iteration_sample_ratio=1.0,
    rank_mapping="cqm",
    entropy_estimator="gaussian",
    cqm_mc_samples=1,
    engine=LowRankConfig(min_compression_rate=0.5),
)


def aligner_worker(rank, world_size, steps, follower_backward_time, checked=False):
    """``checked``: the steps run under the CPU stream checker, which returns what it found instead."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.Linear(64, 64))
    pipeline = dist.new_group([0, 1])
    dp_group = [dist.new_group([r]) for r in range(world_size)][rank]
    state = EDGCState(dp_group, EDGCConfig(**CONFIG), model=model, follower=rank > 0, always_profile=True)
    aligner = StageAligner(state, rank, world_size, pipeline)
    log = []
    with StreamChecker() if checked else contextlib.nullcontext() as checker:
        if checked:
            checker.adopt(model)  # made before the checker, on the device
        for step in range(steps):
            for p in model.parameters():
                p.grad = torch.randn_like(p) * math.exp(-0.05 * step)  # shrinking gradients: falling entropy
            state.synchronize(model.named_parameters())
            aligner.record_backward_time(follower_backward_time if rank else 0.001)
            aligner.after_sync()
            log.append((state.last_step_metrics["phase"], state.last_step_metrics["rank"]))
    if checked:
        return checker.races, [str(sync) for sync in checker.host_syncs]
    return log, state.controller.schedule, aligner.last_plan


def test_follower_adopts_the_aligned_rank_from_the_leaders_window_boundary():
    (leader, leader_schedule, plan0), (follower, follower_schedule, plan1) = run_distributed(
        aligner_worker, 2, 20, 10.0
    )
    assert plan0 == plan1  # both stages computed the same alignment from the same shared numbers
    assert leader_schedule[0][1] == 8 and len({r for _, r in leader_schedule}) >= 2  # stage 0 adapts
    # A huge slack (t_b = 10 s) lets stage 1 sync uncompressed once stage 0 compresses.
    assert any(phase == "compress" and rank is None for phase, rank in follower)
    assert follower_schedule and all(rank == 0 for _, rank in follower_schedule)
    first_follow = follower_schedule[0][0]
    assert first_follow % CONFIG["window"] == 0 and first_follow >= leader_schedule[0][0]


def test_without_slack_the_follower_gets_the_leaders_time_as_budget():
    (_, _, plan), (follower, _, plan1) = run_distributed(aligner_worker, 2, 20, 0.0)
    assert plan == plan1 and plan is not None
    assert plan[1].budget == pytest.approx(plan[0].predicted)  # T_0 + 1·t_b with t_b = 0
    if plan[1].rank is not None:
        assert plan[1].predicted <= plan[1].budget + 1e-12 or plan[1].rank == 2  # r_min when nothing fits
    assert follower[-1] == ("compress", plan[1].rank)  # the follower runs the aligned rank


def test_window_boundaries_read_the_host_only_where_allowed():
    """The stages' exchange at a window boundary is a decision point: its reads of the agreed values
    are the allowed kind (`edgc.device.timing.host_reads_allowed`), and its vectors reach the device
    without a blocking copy."""
    for races, syncs in run_distributed(aligner_worker, 2, 9, 0.0, True):
        assert races == [] and syncs == [], (races[:3], syncs[:5])
