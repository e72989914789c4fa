"""The noise gate of the window controller on synthetic gradient streams.

Each stream draws a fresh Gaussian "gradient" every sampled step; its scale sets the entropy level
(½·ln(2πeσ²)), the draw supplies the sample-to-sample noise. The controller runs exactly as in
`EDGCState` (plan → propose → apply), fed the Gaussian entropy of each sampled gradient.
"""

import math

import pytest
import torch
from distributed_harness import run_distributed

from edgc import EDGCConfig, LowRankConfig
from edgc.control.entropy import gaussian_entropy
from edgc.control.rank_control import WindowController
from edgc.policies.plans import COMPRESS, Agreed, DecisionInputs
from edgc.policies.rank_rules import entropy_shift

SHAPES = [(256, 256), (256, 1024), (1024, 256)]


def drive(config, scale_at, steps, seed=0, elements=2048, errors=None):
    """Run the controller for ``steps``; ``scale_at(step)`` is the gradient scale. Returns (controller, ranks per "
    "window)."""
    generator = torch.Generator().manual_seed(seed)
    controller = WindowController(config)
    values, sample_steps, ranks = [], [], []
    for step in range(steps):
        plan = controller.plan(step)
        if step % config.sample_every == 0:
            values.append(gaussian_entropy(scale_at(step) * torch.randn(elements, generator=generator)))
            sample_steps.append(step)
        if plan.decision:
            agreed = Agreed(relative_error=errors(step) if errors else math.nan)
            inputs = DecisionInputs(plan, agreed, entropies=values, sample_steps=sample_steps, shapes=SHAPES)
            controller.apply(inputs, controller.propose(inputs))
            ranks.append(controller.rank)
    return controller, ranks


def config(**overrides):
    values = dict(
        r_max=32,
        r_min=8,
        window=20,
        iteration_sample_ratio=0.5,
        rank_mapping="cqm",
        warmup_error_test=False,
        min_warmup_steps=0,
        cqm_mc_samples=1,
    )
    return EDGCConfig(**{**values, **overrides})


def test_entropy_shift_needs_more_than_k_standard_errors():
    steady = [1.0, 1.1, 0.9, 1.0, 1.05, 0.95]
    assert entropy_shift(steady, [1.02, 0.98, 1.1, 0.9], k=3) is None
    assert entropy_shift(steady, [0.5, 0.52, 0.48, 0.5], k=3) == pytest.approx(0.5 - 1.0)
    assert entropy_shift([1.0], [0.0, 0.0], k=3) is None  # too few samples to know the noise
    assert entropy_shift([1.0, 1.0], [1.0, 1.0], k=0) is None  # no shift at all


@pytest.mark.parametrize("mapping", ["cqm", "delta"])
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_stationary_stream_keeps_its_rank_for_50_windows(mapping, seed):
    controller, ranks = drive(config(rank_mapping=mapping), lambda step: 1.0, steps=51 * 20, seed=seed)
    assert len(ranks) >= 50
    assert set(ranks) == {32} and controller.schedule == [(0, 32)]


def test_entropy_falling_in_steps_moves_the_rank_down_monotonically_within_limits():
    cfg = config(rank_step=4)
    stair = 200  # ten windows per level, each level ½ nat lower (scale × e^-½)
    controller, ranks = drive(cfg, lambda step: math.exp(-0.5 * (step // stair)), steps=5 * stair)
    assert all(later <= earlier for earlier, later in zip(ranks, ranks[1:]))
    assert all(abs(later - earlier) <= cfg.rank_step for earlier, later in zip([32, *ranks], ranks))
    assert all(8 <= r <= 32 for r in ranks) and ranks[-1] < 32
    changes = [step for step, _ in controller.schedule[1:]]
    assert changes and all(step % stair <= 2 * cfg.window for step in changes)  # right after a stair, not in between


def decision_step(index, window=20):
    return (index + 1) * window - 1


def test_a_lasting_fall_gives_one_lasting_rank_change_not_a_blip():
    cfg = config(r_max=32, r_min=4, rank_step=8)
    controller, ranks = drive(cfg, lambda step: math.exp(-0.5) if step >= 400 else 1.0, steps=1200)
    assert len(controller.schedule) == 2  # compression start, then one change
    changed_at, rank = controller.schedule[1]
    assert 400 < changed_at <= 400 + 3 * cfg.window and rank < 32
    assert all(r == rank for i, r in enumerate(ranks) if decision_step(i) >= changed_at)


def test_a_lasting_rise_after_a_fall_raises_the_rank_and_keeps_it():
    cfg = config(r_max=32, r_min=4, rank_step=8)
    levels = {0: 1.0, 1: math.exp(-0.75), 2: 1.0}  # fall at step 400, rise back for good at 800
    controller, ranks = drive(cfg, lambda step: levels[min(step // 400, 2)], steps=1200)
    low = [r for i, r in enumerate(ranks) if 460 <= decision_step(i) < 800]
    high = [r for i, r in enumerate(ranks) if decision_step(i) >= 860]
    assert set(low) == {24} and set(high) == {32}
    assert [step for step, _ in controller.schedule] == [0, 440, 840]


def test_error_band_mapping_moves_one_step_towards_the_band_and_rests_inside_it():
    cfg = config(rank_mapping="error-band", error_band=(0.1, 0.2), rank_step=4)
    _, ranks = drive(cfg, lambda step: 1.0, steps=200, errors=lambda step: 0.05)  # too precise: cheaper
    assert ranks[:3] == [28, 24, 20] and ranks[-1] == 8
    _, ranks = drive(cfg, lambda step: 1.0, steps=200, errors=lambda step: 0.15)  # inside: keep
    assert set(ranks) == {32}
    controller = WindowController(cfg)
    controller.phase, controller.rank, controller.r_min = COMPRESS, 8, 8
    band, rules = controller.rule.mapping, controller.rule
    assert band.rank_for_error(rules, controller, 0.5) == 12 and band.rank_for_error(rules, controller, math.nan) == 8


def test_warmup_ends_at_its_ceiling_when_the_error_test_never_passes():
    cfg = EDGCConfig(r_max=8, window=4, total_steps=100, warmup_fraction=0.1, max_warmup_fraction=0.3)
    controller = WindowController(cfg)
    phases = []
    for step in range(40):
        plan = controller.plan(step)
        phases.append(plan.phase)
        if plan.decision:
            inputs = DecisionInputs(plan, Agreed(probe_error=1.0 if step == 0 else 2.0))  # never below the start error
            controller.apply(inputs, controller.propose(inputs))
    assert phases[29] == "warmup" and phases[30] == COMPRESS


def cqm_worker(rank, world_size, steps):
    from edgc import EDGCState

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 64, bias=False), torch.nn.Linear(64, 64, bias=False))
    cfg = EDGCConfig(
        r_max=16,
        r_min=4,
        rank_step=4,
        window=10,
        iteration_sample_ratio=1.0,
        rank_mapping="cqm",
        warmup_error_test=False,
        min_warmup_steps=0,
        cqm_mc_samples=1,
        engine=LowRankConfig(min_compression_rate=1.0),
    )
    state = EDGCState(None, cfg, model=model)
    generator = torch.Generator().manual_seed(100 + rank)  # each rank sees its own noise
    for step in range(steps):
        scale = 1.0 if step < steps // 2 else math.exp(-1.0)
        for p in model.parameters():
            p.grad = scale * torch.randn(p.shape, generator=generator)
        state.synchronize(model.named_parameters())
    return state.controller.schedule


def test_all_ranks_agree_on_the_gated_decisions():
    schedules = run_distributed(cqm_worker, 2, 120)
    assert schedules[0] == schedules[1]
    assert schedules[0][0] == (0, 16) and len(schedules[0]) >= 2  # the fall at step 60 moved the rank
    assert all(step >= 60 for step, _ in schedules[0][1:])  # and nothing before it did
