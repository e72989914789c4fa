import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from edgc import EDGCConfig, WindowController, delta_target, limit_rank
from edgc.control.profiling import SyncTimeTable, profile_candidates
from edgc.policies.plans import COMPRESS, OFF, PROFILE, WARMUP, Agreed, Decision, DecisionInputs, StepPlan
from edgc.policies.rank_rules import delta_ratio


def next_rank(controller, entropies, shapes):
    """The paper rule's rank for the next window from the entropy series alone (no agreed error)."""
    plan = StepPlan(len(entropies), COMPRESS, controller.rank, decision=True)
    return controller.rule.propose(controller, DecisionInputs(plan, entropies=entropies, shapes=shapes))[0]


@settings(max_examples=200, deadline=None)
@given(
    entropies=st.lists(st.floats(-50, 50), min_size=0, max_size=60),
    per_window=st.integers(1, 10),
    r_min=st.integers(1, 16),
    span=st.integers(0, 48),
    step_limit=st.integers(1, 8),
    previous_offset=st.integers(0, 48),
)
def test_delta_mapping_respects_bounds_and_step_limit(entropies, per_window, r_min, span, step_limit, previous_offset):
    r_max = r_min + span
    previous = r_min + previous_offset % (span + 1)
    target = delta_target(entropies, per_window, r_min, r_max)
    rank = limit_rank(target, previous, r_min, r_max, step_limit, granularity=2)
    assert r_min <= rank <= r_max
    assert abs(rank - previous) <= step_limit


@settings(max_examples=100, deadline=None)
@given(drop=st.floats(-0.5, 0.5), previous=st.integers(4, 16), step_limit=st.integers(1, 6))
def test_cqm_mapping_respects_bounds_and_step_limit(drop, previous, step_limit):
    config = EDGCConfig(
        r_max=16,
        r_min=4,
        rank_mapping="cqm",
        rank_step=step_limit,
        window=4,
        iteration_sample_ratio=1.0,
        cqm_mc_samples=1,
    )
    controller = WindowController(config)
    controller.rank = previous
    entropies = [1.0] * 8 + [1.0 - drop] * 8  # a level, then two windows that confirm the shift
    rank = next_rank(controller, entropies, [(32, 64), (32, 64)])
    assert 4 <= rank <= 16 and abs(rank - previous) <= step_limit
    # A drop of 0.0625 nats can leave g⁻¹ inside the current rank's step (hypothesis found one);
    # from 0.1 nats on, g(r₀)·e^{2·ΔH} always passes the next lower rank of a 32 × 64 matrix.
    if drop >= 0.1 and previous - step_limit >= 4:
        assert rank < previous  # falling entropy lowers the rank


def test_delta_mapping_follows_the_authors_formula():
    # first two windows change by 1.0; the latest two by 0.25 → ρ = 0.25
    entropies = [3.0, 3.0, 2.0, 2.0, 1.75, 1.75, 1.5, 1.5]
    assert delta_target(entropies, 2, r_min=8, r_max=32) == round(8 + 24 * 0.25)
    assert delta_target(entropies[:3], 2, 8, 32) == 32  # < 2 windows: stay at r_max
    stable = [3.0, 3.0, 2.0, 2.0, 1.5, 1.5, 1.5, 1.5]
    assert delta_target(stable, 2, 8, 32) == 8


def test_the_delta_map_takes_the_limit_of_its_ratio_where_two_windows_have_equal_means():
    assert delta_ratio(0.5, 2.0) == 0.25 and delta_ratio(3.0, 2.0) == 1.0  # Δ_now / Δ_ref, clipped to 1
    assert delta_ratio(1.0, 0.0) == 1.0  # moving now, flat at first: faster than the reference
    assert delta_ratio(0.0, 0.0) == 0.0  # flat then and now: stable
    assert delta_ratio(0.0, 2.0) == 0.0  # the latest two windows have equal means: stable
    flat_then_falling = [5.0, 5.0, 5.0, 5.0, 4.0, 4.0]  # windows of 2: means 5, 5, 4
    flat = [5.0] * 6
    assert delta_target(flat_then_falling, 2, r_min=8, r_max=32) == 32
    assert delta_target(flat, 2, r_min=8, r_max=32) == 8


def test_the_gated_controller_reads_the_same_delta_map_when_the_first_windows_are_equal():
    # Windows of 5 samples: two equal windows (Δ_ref = 0), then two falls the noise gate confirms.
    config = EDGCConfig(r_max=32, r_min=8, rank_step=32, window=10, iteration_sample_ratio=0.5)
    controller = WindowController(config)
    controller.rank = 16
    entropies = [5.0] * 10 + [4.0] * 5 + [3.0] * 5
    assert next_rank(controller, entropies, []) == 32  # ρ = 1: as if by delta_target's limit


def test_limit_rank_rounds_to_granularity_and_clamps():
    assert limit_rank(13, 16, 4, 32, 4, 2) == 12
    assert limit_rank(3, 16, 4, 32, 4, 2) == 12  # step limit
    assert limit_rank(100, 30, 4, 32, 4, 2) == 32
    assert limit_rank(1, 5, 4, 32, 4, 2) == 4


def test_sync_time_table_interpolates_both_ways_and_finds_r_max():
    table = SyncTimeTable(uncompressed=1.0, by_rank={2: 0.2, 4: 0.3, 8: 0.5, 16: 0.9, 32: 1.7})
    assert table.rank_to_time(12) == pytest.approx(0.7)
    assert table.time_to_rank(0.7) == pytest.approx(12)
    assert table.rank_to_time(64) == pytest.approx(3.3)  # linear extrapolation
    assert table.rank_ceiling() == 16  # L⁻¹(1.0) = 18 → multiple of 4
    assert SyncTimeTable(uncompressed=0.1, by_rank={2: 0.2, 4: 0.3}).rank_ceiling() is None
    noisy = SyncTimeTable(uncompressed=1.0, by_rank={2: 0.3, 4: 0.25, 8: 0.6})
    assert noisy.time_to_rank(0.3) == pytest.approx(4)  # noise flattened by the running max
    assert profile_candidates(16) == [2, 4, 8, 16]


def run_controller(config, steps, agreed_for, **controller_kwargs):
    """Drive the controller like a single-rank EDGCState would."""
    controller = WindowController(config, **controller_kwargs)
    plans = []
    for step in range(steps):
        plan = controller.plan(step)
        plans.append(plan)
        if plan.decision:
            inputs = DecisionInputs(plan, agreed_for(plan))
            controller.apply(inputs, controller.propose(inputs))
    return controller, plans


SYNC_TIMES = {2: 0.2, 4: 0.3, 8: 0.5, 16: 0.9, 32: 1.7, 64: 3.3}  # s; the plain sync takes 1.0 s


def measured(plan, exposed=0.6):
    """What a group measures: the candidate's time; the plain sync's where the plan times it
    (blocking), and in the quick test the host's wait for it after backward (``exposed`` s)."""
    return Agreed(
        SYNC_TIMES.get(plan.profile_rank, math.nan),
        1.0 if plan.profile_raw else math.nan,
        uncompressed_bound=exposed if plan.profile_bound else math.nan,
    )


def test_profiling_goes_down_from_the_top_to_the_first_rank_that_pays_then_warms_up():
    config = EDGCConfig(
        profile_max_rank=64,
        profile_steps_per_rank=2,
        window=5,
        total_steps=100,
        warmup_error_test=False,
        warmup_fraction=0.2,
    )
    controller, plans = run_controller(config, 40, measured)
    assert plans[1].profile_bound and plans[1].profile_rank == 64 and plans[1].decision  # the quick test
    assert not any(p.profile_bound for p in plans[2:])  # 3.3 s > the 0.6 s wait proves nothing: full timing
    assert [p.profile_rank for p in plans[2:8:2]] == [64, 32, 16]  # 16 is the first rank faster than 1.0 s
    assert controller.r_max == 16 and controller.r_min == 4  # interpolated 18 between 16 and 32 → multiple of 4
    table = controller.profiling.table
    assert table.uncompressed == 1.0 and set(table.by_rank) == {64, 32, 16} and not table.uncompressed_is_bound
    assert [p.profile_warm for p in plans[1:6]] == [False] * 5  # the quick test took the cold costs
    assert [p.profile_raw for p in plans[1:6]] == [False, True, True, False, False]  # the first candidate's block
    assert [p.step for p in plans if p.decision and p.phase == PROFILE] == [1, 3, 5, 7]
    assert plans[8].phase == WARMUP and plans[19].phase == WARMUP
    assert plans[20].phase == COMPRESS and plans[20].rank == 16  # floor ⌊0.2·100⌋ = 20
    assert controller.schedule == [(20, 16)]


def test_a_quick_test_that_proves_the_top_candidate_pays_ends_profiling_without_blocking():
    config = EDGCConfig(profile_max_rank=64, profile_steps_per_rank=2, warmup_error_test=False, total_steps=100)
    controller, plans = run_controller(config, 6, lambda plan: measured(plan, exposed=4.0))
    assert plans[1].profile_bound and plans[2].phase == WARMUP  # one profiling step, nothing blocking
    assert not any(p.profile_raw or p.profile_warm for p in plans)
    table = controller.profiling.table
    assert controller.r_max == 64 and table.by_rank == {64: 3.3}
    assert table.uncompressed == 4.0 and table.uncompressed_is_bound
    restored = WindowController(config)
    restored.load_state_dict(controller.state_dict())
    assert restored.profiling.table.uncompressed_is_bound and restored.profiling.table.by_rank == {64: 3.3}


def test_a_quick_test_that_proves_nothing_records_nothing():
    # Its shadow sync ran cold (an upper bound) and the plain sync's wait is a lower bound: neither
    # is a measurement the table may keep.
    config = EDGCConfig(profile_max_rank=8, profile_steps_per_rank=1, warmup_error_test=False, total_steps=100)
    controller = WindowController(config)
    plan = controller.plan(1)
    inputs = DecisionInputs(plan, Agreed(0.9, uncompressed_bound=0.2))
    controller.apply(inputs, controller.propose(inputs))
    table = controller.profiling.table
    assert controller.phase == PROFILE and table.by_rank == {} and table.uncompressed is None
    assert controller.plan(2).profile_raw and controller.plan(2).profile_rank == 8


def test_on_a_slow_link_one_candidate_suffices():
    config = EDGCConfig(profile_max_rank=8, profile_steps_per_rank=1, warmup_error_test=False, total_steps=100)
    controller, plans = run_controller(config, 5, measured)  # the quick test proves it: 0.5 s ≤ the 0.6 s wait
    assert plans[1].profile_rank == 8 and plans[1].profile_bound and plans[2].phase == WARMUP
    table = controller.profiling.table
    assert controller.r_max == 8 and table.by_rank == {8: 0.5} and table.uncompressed_is_bound
    controller, plans = run_controller(config, 5, lambda plan: measured(plan, exposed=0.3))
    assert plans[2].profile_rank == 8 and plans[2].profile_raw and plans[2].decision and plans[3].phase == WARMUP
    table = controller.profiling.table
    assert controller.r_max == 8 and table.by_rank == {8: 0.5} and table.uncompressed == 1.0


def test_pipeline_stages_profile_every_rank_going_up():
    # Stage alignment needs each rank's time: from 2 up, until a rank is slower than the plain sync.
    config = EDGCConfig(profile_max_rank=64, profile_steps_per_rank=1, warmup_error_test=False, total_steps=100)
    controller, plans = run_controller(config, 12, measured, always_profile=True)
    assert not any(p.profile_bound for p in plans)  # no quick test: bounds give no stage its times
    assert [p.profile_rank for p in plans[1:6]] == [2, 4, 8, 16, 32]  # stopped after 32 was slower
    assert controller.r_max == 16 and set(controller.profiling.table.by_rank) == {2, 4, 8, 16, 32}


def test_profiling_turns_compression_off_when_it_never_pays():
    config = EDGCConfig(profile_max_rank=8, profile_steps_per_rank=1)
    controller, plans = run_controller(config, 10, lambda plan: Agreed(2.0, 1.0))
    assert controller.phase == OFF and plans[-1].rank is None and plans[-1].profile_rank is None


def test_warmup_error_test_sets_t_e_at_first_passing_window_boundary():
    config = EDGCConfig(r_max=8, window=4, min_warmup_steps=0)
    errors = iter([1.0, 3.0, 0.9])  # E_max = 1.0 at step 0; boundary at step 3 fails; step 7 passes

    def agreed(plan):
        return Agreed(probe_error=next(errors)) if plan.phase == WARMUP else Agreed()

    controller, plans = run_controller(config, 12, agreed)
    assert [p.step for p in plans if p.probe_rank is not None] == [0, 3, 7]
    assert plans[0].probe_rank == 8 and plans[3].probe_rank == 2
    assert controller.warmup.error_test_step == 8 and plans[8].phase == COMPRESS and plans[7].phase == WARMUP


def test_decision_round_trips_through_its_wire_encoding():
    decision = Decision(COMPRESS, 32, 8, 12, 40, 0.125)
    assert Decision.decode(decision.encode()) == decision
    assert Decision.decode(Decision(PROFILE, None, None, None, None, None).encode()).r_max is None


def test_controller_state_round_trip():
    config = EDGCConfig(r_max=8, window=3, warmup_error_test=False)
    controller, _ = run_controller(config, 10, lambda plan: Agreed())
    restored = WindowController(config)
    restored.load_state_dict(controller.state_dict())
    assert restored.state_dict() == controller.state_dict()
    assert restored.plan(10) == controller.plan(10)


def test_profiling_verdict_says_why_compression_is_off_with_the_measured_times():
    from edgc.control.profiling import describe_profiling_verdict

    config = EDGCConfig(profile_max_rank=8, profile_steps_per_rank=1)
    controller, _ = run_controller(config, 10, lambda plan: Agreed(2.0, 1.0))
    verdict = controller.profiling_verdict()
    # from the top down, no rank pays: every candidate was tried
    assert verdict == {
        "status": "off",
        "r_max": None,
        "uncompressed_s": 1.0,
        "uncompressed_is_bound": False,
        "compressed_s": {2: 2.0, 4: 2.0, 8: 2.0},
    }
    line = describe_profiling_verdict(verdict)
    assert "OFF" in line and "all-reduce 1000.00 ms" in line and "r_max=16 in EDGCConfig" in line and "\n" not in line
    # A single candidate proved by the quick test sits at the floor; the plain time shown is a bound.
    floor, _ = run_controller(
        EDGCConfig(profile_max_rank=2, warmup_error_test=False, total_steps=100),
        4,
        lambda plan: Agreed(0.2, uncompressed_bound=0.5 if plan.profile_bound else math.nan),
    )
    assert floor.profiling_verdict()["status"] == "floor"
    assert "uncompressed all-reduce ≥ 500.00 ms/step" in describe_profiling_verdict(floor.profiling_verdict())
    on, _ = run_controller(EDGCConfig(r_max=8, warmup_error_test=False), 10, lambda plan: Agreed())
    assert on.profiling_verdict() is None  # r_max given: nothing was profiled
    found, _ = run_controller(EDGCConfig(profile_max_rank=64, warmup_error_test=False, total_steps=100), 12, measured)
    assert found.profiling_verdict()["status"] == "found" and found.profiling_verdict()["r_max"] == 16
    line = describe_profiling_verdict(found.profiling_verdict())
    assert line.startswith("EDGC profiled r_max=16 on this link (uncompressed all-reduce 1000.00 ms/step")
    assert "with the plain sync timed blocking" in line and "r_max=16 to compress anyway" not in line
    quick, _ = run_controller(EDGCConfig(profile_max_rank=8, warmup_error_test=False, total_steps=100), 4, measured)
    assert "≥ 600.00 ms/step" in describe_profiling_verdict(quick.profiling_verdict())
    assert "by the quick test" in describe_profiling_verdict(quick.profiling_verdict())
