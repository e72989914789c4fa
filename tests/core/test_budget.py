"""The byte budget (edgc.control.budget + the controller's budget mode) and warm-start-preserving rank changes."""

import math

import pytest
import torch
from distributed_harness import run_distributed
from hypothesis import given, settings
from hypothesis import strategies as st
from test_ddp import resume_worker, training_worker

from edgc import EDGCConfig, LowRankCompressor, LowRankConfig
from edgc.control.budget import budget_target, nearest_rank, rank_grid, spent_rank_steps
from edgc.control.rank_control import WindowController
from edgc.distributed.comm import Communicator
from edgc.policies.plans import DecisionInputs
from edgc.policies.signals import trend_need, window_stats

# ---------------------------------------------------------------------------- pure planning


def run_controller(config: EDGCConfig, needs=None, steps=None):
    """Drive a budget-mode controller through a whole run without a process group; ``needs`` (one per
    decision, cycled) replaces the signal's verdict. Returns the schedule."""
    controller = WindowController(config)
    decision_index = 0
    for step in range(steps or config.total_steps):
        plan = controller.plan(step)
        if plan.decision:
            if needs is not None:
                controller.rule.need = lambda signals, progress, k=decision_index: needs[k % len(needs)]
                decision_index += 1
            inputs = DecisionInputs(plan)
            controller.apply(inputs, controller.propose(inputs))
    return controller.schedule


def test_schedule_signal_spends_the_budget_early_and_exactly():
    for budget in (2, 4, 8):
        config = EDGCConfig(
            r_max=2 * budget, rank_budget=float(budget), total_steps=400, window=20, warmup_error_test=False
        )
        schedule = run_controller(config)
        spent, steps = spent_rank_steps(schedule, 400)
        assert steps == 360 and spent / steps == pytest.approx(budget, rel=0.02)
        ranks = [r for _, r in schedule]
        assert ranks[0] == 2 * budget and ranks == sorted(ranks, reverse=True)  # front-loaded, never back up
        assert ranks[-1] <= budget // 2 and min(ranks) >= 1
        assert schedule[0][0] == 40  # the shared 10 % warm-up


@settings(max_examples=40, deadline=None)
@given(
    budget=st.integers(2, 12),
    headroom=st.integers(1, 3),
    window=st.integers(5, 40),
    needs=st.lists(st.floats(0, 1), min_size=1, max_size=12),
    front_load=st.floats(1, 4),
)
def test_any_signal_keeps_the_budget_within_two_percent_and_never_exceeds_r_max(
    budget, headroom, window, needs, front_load
):
    r_max = budget * headroom
    config = EDGCConfig(
        r_max=r_max,
        rank_budget=float(budget),
        total_steps=1000,
        window=window,
        warmup_error_test=False,
        front_load=front_load,
        budget_signal="gradnorm",
        rank_granularity=1,
    )
    schedule = run_controller(config, needs)
    spent, steps = spent_rank_steps(schedule, 1000)
    assert all(1 <= r <= r_max for _, r in schedule)
    # Rounding to whole ranks costs at most half a rank for one window at the end.
    assert abs(spent / steps - budget) <= max(0.02 * budget, 0.5 * window / steps)


def test_budget_target_pays_back_an_early_surge_and_respects_feasibility():
    # Spent 8 per step for 100 of 400 steps at budget 4: the rest must average 8/3.
    target = budget_target(
        budget=4, total=400, done=100, spent=800, window=20, need=0.0, front_load=2, r_min=1, r_max=8
    )
    assert target == pytest.approx(800 / 300)
    # Overspent so far that only r_min is left: the target is r_min, whatever the signal says.
    assert (
        budget_target(budget=4, total=400, done=200, spent=1590, window=20, need=1.0, front_load=2, r_min=1, r_max=8)
        == 1
    )
    assert nearest_rank(5.0, rank_grid(1, 8, 2)) == 4  # a tie spends less
    assert rank_grid(1, 8, 2) == [1, 2, 4, 6, 8] and rank_grid(3, 7, 2) == [3, 4, 6, 7]


def test_trend_need_is_zero_on_noise_and_one_on_a_moving_series():
    generator = torch.Generator().manual_seed(0)
    noise = [(s, float(v)) for s, v in enumerate(torch.randn(200, generator=generator) * 0.1)]
    assert trend_need(window_stats(noise, 20), k=3.0) <= 0.05  # a stationary series: no early regime
    falling = [(s, 10.0 - 0.05 * s + 0.01 * math.sin(s)) for s in range(200)]
    assert trend_need(window_stats(falling, 20), k=3.0) == pytest.approx(1.0, abs=0.05)  # still moving as at first
    slowing = [(s, 10.0 * math.exp(-s / 30)) for s in range(200)]
    assert trend_need(window_stats(slowing, 20), k=0.0) < 0.02  # a settled series: need fades
    assert trend_need(window_stats(slowing[:40], 20), k=0.0) == 0.0  # two windows: no reference change yet


def test_budget_config_is_validated():
    with pytest.raises(ValueError, match="rank_budget.*total_steps"):
        EDGCConfig(r_max=8, rank_budget=4)
    with pytest.raises(ValueError, match="rank_budget"):
        EDGCConfig(r_max=8, rank_budget=9, total_steps=100)
    with pytest.raises(ValueError, match="budget_signal"):
        EDGCConfig(budget_signal="vibes")
    with pytest.raises(ValueError, match="rank_schedule"):
        EDGCConfig(r_max=8, rank_schedule=((10, 4), (5, 2)))
    config = EDGCConfig(r_max=8, rank_schedule=[[10, 4], [20, 2]])
    assert config.rank_schedule == ((10, 4), (20, 2))
    assert EDGCConfig.from_dict(config.to_dict()) == config


# ---------------------------------------------------------------------------- warm rank changes


def low_rank_matrix(m, n, spectrum, seed):
    generator = torch.Generator().manual_seed(seed)
    u = torch.linalg.qr(torch.randn(m, len(spectrum), generator=generator, dtype=torch.float64)).Q
    v = torch.linalg.qr(torch.randn(n, len(spectrum), generator=generator, dtype=torch.float64)).Q
    return u @ torch.diag(torch.tensor(spectrum, dtype=torch.float64)) @ v.T


def test_a_falling_rank_keeps_the_highest_energy_directions():
    compressor = LowRankCompressor(EDGCConfig(r_max=6, engine=LowRankConfig(min_compression_rate=0.0)))
    comm = Communicator()
    grad = low_rank_matrix(40, 30, [1.0, 2.0, 0.5, 8.0, 4.0, 0.1], seed=1)  # energy not in column order
    for _ in range(3):  # warm the power iteration up at rank 6
        compressor.reduce(["w"], [grad.clone()], 6, comm)
    q = compressor.q["w"].clone()
    truncated, warm = q[:, :2], None
    compressor.change_rank(2, comm)
    warm = compressor.q["w"]
    assert warm.shape == (30, 2)

    def kept_energy(columns):  # how much of ‖Q‖² the kept subspace holds
        basis = torch.linalg.qr(columns).Q
        return float((basis.T @ q).square().sum())

    assert kept_energy(warm) == pytest.approx(8.0**2 + 4.0**2, rel=1e-6)  # the two largest directions
    assert kept_energy(warm) > kept_energy(truncated)
    # One step at the new rank already approximates the gradient as well as rank 2 can.
    out = grad.clone()
    compressor.reduce(["w"], [out], 2, comm)
    best = float(torch.linalg.svdvals(grad)[2:].square().sum())
    assert float((grad - out).square().sum()) == pytest.approx(best, rel=1e-6)


def growing_worker(rank, world_size, mode):
    """Rank 2 for three steps, then 4: per process, the residual directions and EF conservation.
    On a wide matrix (the falling-rank test has a tall one): Q sits on its longer side."""
    compressor = LowRankCompressor(
        EDGCConfig(r_max=4, engine=LowRankConfig(min_compression_rate=0.0, rank_change=mode))
    )
    comm = Communicator()
    records = []
    residual = torch.zeros(30, 40, dtype=torch.float64)
    for step in range(5):
        rank = 2 if step < 3 else 4
        if step == 3:
            compressor.change_rank(rank, comm)
        # Gradients with a fixed rank-4 structure plus per-process noise.
        grad = low_rank_matrix(30, 40, [5.0, 4.0, 3.0, 2.0], seed=7) + 0.01 * low_rank_matrix(
            30, 40, [1.0] * 8, seed=rank + 10 * step
        )
        before = grad + residual
        compressor.reduce(["w"], [grad], rank, comm)
        residual = compressor.error["w"].clone()
        records.append((before, grad.clone(), residual))
    return {"q": compressor.q["w"], "records": records}


@pytest.mark.parametrize("mode", ["warm", "truncate"])
def test_a_rising_rank_is_identical_on_every_process_and_conserves_error_feedback(mode):
    results = run_distributed(growing_worker, 2, mode)
    assert torch.equal(results[0]["q"], results[1]["q"])
    for step in range(5):
        mean_input = sum(r["records"][step][0] for r in results) / 2
        decompressed = results[0]["records"][step][1]
        assert torch.equal(decompressed, results[1]["records"][step][1])
        mean_residual = sum(r["records"][step][2] for r in results) / 2
        torch.testing.assert_close(decompressed + mean_residual, mean_input, rtol=0, atol=1e-12)
    if mode == "warm":  # the first step at rank 4 already captures the 4-dimensional structure
        before, after, _ = results[0]["records"][3]
        mean_input = sum(r["records"][3][0] for r in results) / 2
        assert float((mean_input - after).square().sum()) < 0.05 * float(mean_input.square().sum())


# ---------------------------------------------------------------------------- in a DDP group

BUDGET = dict(
    r_max=8,
    rank_budget=4.0,
    budget_signal="gradnorm",
    window=3,
    total_steps=24,
    warmup_fraction=0.1,
    warmup_error_test=False,
    iteration_sample_ratio=1.0,
    gradient_sample_ratio=0.5,
    entropy_significance=0.0,
    engine=LowRankConfig(min_compression_rate=1.0),
)


@pytest.mark.parametrize("world_size", [2, 4])
def test_budget_decisions_are_identical_on_every_rank_with_many_buckets(world_size):
    results = run_distributed(training_worker, world_size, BUDGET, 14, 0.02)
    reference = results[0]
    ranks = [rank for _, phase, rank in reference["log"] if phase == "compress"]
    assert ranks[0] == 8 and len(set(ranks)) >= 2, "the budget should move the rank"
    assert min(reference["calls"][1:]) >= 4, "the model should span many buckets"
    for other in results[1:]:
        assert other["log"] == reference["log"] and other["schedule"] == reference["schedule"]
        assert torch.equal(other["params"], reference["params"])


def test_resume_is_bit_identical_through_budget_rank_changes():
    results = run_distributed(resume_worker, 2, BUDGET, 6, 13, (None, 0.25))
    for uninterrupted, resumed, log in results:
        assert len({rank for _, phase, rank in log if phase == "compress"}) >= 2  # resumed across a rank change
        assert torch.equal(uninterrupted, resumed)
