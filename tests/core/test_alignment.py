import pytest

from edgc.control.alignment import StageTiming, align_stage_ranks
from edgc.control.profiling import SyncTimeTable


def table(uncompressed, per_rank, base=0.1):
    """A linear table: time(r) = base + per_rank·r at ranks 2 … 64."""
    return SyncTimeTable(uncompressed, {r: base + per_rank * r for r in (2, 4, 8, 16, 32, 64)})


def test_monotone_tables_give_later_stages_higher_ranks():
    stages = [StageTiming(table(2.0, 0.01), 0.0, 4, 64)] + [StageTiming(table(2.0, 0.01), 0.08, 4, 64)] * 3
    plans = align_stage_ranks(8, stages)
    assert [p.rank for p in plans] == [8, 16, 24, 32]  # budget 0.18 + p·0.08 → rank 8 + 8p
    assert all(p.predicted <= p.budget + 1e-12 for p in plans)
    assert plans[1].budget == pytest.approx(plans[0].predicted + 0.08)


def test_stage_with_enough_slack_is_not_compressed():
    stages = [StageTiming(table(2.0, 0.01), 0.0, 4, 64), StageTiming(table(0.3, 0.01), 0.5, 4, 32)]
    plans = align_stage_ranks(8, stages)
    assert plans[1].rank is None and plans[1].predicted == 0.3


def test_ties_in_the_table_pick_the_largest_rank_with_that_time():
    flat = SyncTimeTable(5.0, {2: 0.2, 4: 0.2, 8: 0.2, 16: 0.6})
    stages = [StageTiming(flat, 0.0, 2, 16), StageTiming(flat, 0.0, 2, 16)]
    assert align_stage_ranks(2, stages)[1].rank == 8


def test_rank_above_r_max_is_clamped_when_uncompressed_does_not_fit():
    stages = [StageTiming(table(2.0, 0.01), 0.0, 4, 64), StageTiming(table(1.5, 0.01), 0.9, 4, 16)]
    plans = align_stage_ranks(8, stages)  # budget 1.08 < 1.5 would allow rank ~96: capped at 16
    assert plans[1].rank == 16


def test_budget_below_the_cheapest_rank_uses_r_min():
    stages = [
        StageTiming(table(2.0, 0.001, base=0.05), 0.0, 4, 64),
        StageTiming(table(3.0, 0.05, base=1.0), 0.0, 4, 32),
    ]
    plan = align_stage_ranks(8, stages)[1]
    assert plan.rank == 4 and plan.predicted > plan.budget and plan.at_floor  # over budget, and it says so
    fitting = align_stage_ranks(8, [stages[0], StageTiming(table(3.0, 0.001, base=0.05), 0.0, 4, 32)])[1]
    assert fitting.predicted <= fitting.budget and not fitting.at_floor


def test_measurement_noise_does_not_break_the_rule():
    noisy = SyncTimeTable(2.0, {2: 0.13, 4: 0.12, 8: 0.2, 16: 0.25, 32: 0.5, 64: 0.45})
    stages = [StageTiming(noisy, 0.0, 4, 64)] + [StageTiming(noisy, 0.05, 4, 64)] * 2
    plans = align_stage_ranks(8, stages)
    ranks = [p.rank for p in plans]
    assert ranks == sorted(ranks) and all(r % 4 == 0 for r in ranks)
    assert all(p.predicted <= p.budget + 1e-12 for p in plans[1:])
