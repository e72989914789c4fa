"""Stage shapes, the composed iteration, DAC and the rank schedules."""

import pytest

from edgc.policies.rank_rules import delta_target
from edgc_sim.dac import align_stage_ranks, profile_r_max
from edgc_sim.hardware import CLUSTERS, LinkSpec, cluster_with_inter_link
from edgc_sim.iteration import BREAKDOWN_KEYS, IterationModel
from edgc_sim.methods import METHODS, MethodConfig, simulate_methods
from edgc_sim.presets import PRESETS, ModelSpec, ParallelSpec
from edgc_sim.rank_schedule import (
    DeltaMapping,
    delta_rank_schedule,
    map_entropy_change_to_rank,
    schedule_from_metrics,
    synthetic_entropy,
)
from edgc_sim.shapes import stage_params


def test_stage_shapes_match_paper_worked_example():
    model = PRESETS["gpt2-2.5b"].model
    st = stage_params(model, tp=4, pp=4, stage=1)
    assert st.matrices[:4] == ((1440, 1920), (1920, 480), (1920, 1920), (1920, 1920))
    assert len(st.matrices) == 4 * 13 and st.embedding_values == 0
    # all shards of all stages hold the whole model plus the last stage's LM-head copy (the rest of
    # the gap is vocab padding and the 1-D tensors that TP replicates)
    total = sum(stage_params(model, 4, 4, p).values for p in range(4))
    assert total * 4 == pytest.approx(model.params() + model.vocab * model.hidden, rel=0.005)


def test_dataclass_validation_names_the_field():
    with pytest.raises(ValueError, match="global_batch"):
        ParallelSpec(4, 4, 2, 4, 60)
    with pytest.raises(ValueError, match="heads"):
        ModelSpec(2, 100, 3)
    with pytest.raises(ValueError, match="efficiency"):
        LinkSpec("x", 1e9, 1.5, 0.0)
    with pytest.raises(ValueError, match="window"):
        DeltaMapping(window=0)


def test_iteration_breakdown_sums_and_compression_helps_on_slow_links():
    preset = PRESETS["gpt2-2.5b"]
    model = IterationModel(preset, cluster_with_inter_link(CLUSTERS["v100x32"], "eth10g"))
    plain, comp = model.iteration((None,) * 4), model.iteration((32,) * 4)
    for it in (plain, comp):
        assert sum(it.breakdown[k] for k in BREAKDOWN_KEYS) == pytest.approx(it.iteration_s)
        assert all(v >= -1e-12 for v in it.breakdown.values())
    assert comp.iteration_s < plain.iteration_s
    assert comp.sync[0].values_sent < plain.sync[0].values_sent / 10
    # stage 0 holds the embedding and finishes its backward last: its sync is the critical one
    assert plain.flush_end_s[0] == max(plain.flush_end_s)


def test_profile_r_max_interpolates_crossing():
    # compressed time 1 ms per rank unit, uncompressed 100 ms -> crossing at rank 100
    r_max = profile_r_max(lambda r: 0.1 if r is None else 0.001 * r)
    assert r_max == 100
    assert profile_r_max(lambda r: 0.1 if r is None else 1.0) == 0  # compression never pays
    # From the top down, as the library: the largest candidate pays at once and is r_max.
    timed = []
    assert profile_r_max(lambda r: timed.append(r) or (0.1 if r is None else 0.0), max_rank=64) == 64
    assert timed == [None, 64]


def test_dac_aligns_later_stages_to_stage0_finish():
    t_b = [0.0, 0.05, 0.05, 0.05]
    full = [1.0, 1.0, 1.0, 0.12]

    def sync(p, r):
        return full[p] if r is None else 0.001 * r

    ranks = align_stage_ranks(40, sync, t_b, r_max=200)
    # budgets 0.04 + p * 0.05 -> ranks 88, 140; stage 3's uncompressed sync (0.12) fits 0.19
    assert ranks == (40, 88, 140, None)
    for p, r in enumerate(ranks[1:], 1):
        assert r is None or (r % 4 == 0 and sync(p, r) <= 0.04 + p * 0.05 + 1e-12)


def test_delta_schedule_warmup_step_limit_and_bounds():
    T, r_max = 60_000, 64
    cfg = DeltaMapping(window=1000, warmup_frac=0.1)
    windows = delta_rank_schedule(synthetic_entropy(T, tau=5000), T, r_max, cfg)
    assert sum(w.length for w in windows) == T
    ranks = [w.rank for w in windows]
    assert all(r is None for r in ranks[:6]) and ranks[6] == r_max
    after = ranks[6:]
    assert all(r_max // 4 <= r <= r_max and r % 2 == 0 for r in after)
    assert all(abs(a - b) <= 4 for a, b in zip(after, after[1:]))
    assert after[-1] == r_max // 4  # entropy has stabilised: the rank decays to r_min


def test_map_entropy_change_keeps_rank_while_entropy_moves():
    n = 10
    moving = [10.0 - 0.1 * i for i in range(5 * n)]  # constant slope: rho = 1 -> target r_max
    assert map_entropy_change_to_rank(moving, n, 64, r_prev=64) == 64
    assert map_entropy_change_to_rank(moving[:n], n, 64, r_prev=48) == 64  # too little history


def test_the_simulated_schedule_reads_the_controllers_delta_map_where_windows_have_equal_means():
    flat_then_falling = [5.0, 5.0, 5.0, 5.0, 4.0, 4.0]  # windows of 2: means 5, 5, 4 (Δ_ref = 0)
    assert delta_target(flat_then_falling, 2, 8, 32) == 32
    assert map_entropy_change_to_rank(flat_then_falling, 2, 32, r_prev=32) == 32  # moving: keeps r_max
    flat = [5.0] * 6
    assert delta_target(flat, 2, 8, 32) == 8
    assert map_entropy_change_to_rank(flat, 2, 32, r_prev=32) == 28  # stable: one step of 4 towards r_max / 4


def test_schedule_from_metrics_scales_to_simulated_r_max():
    records = [{"step": s, "rank": None if s <= 5 else (16 if s <= 50 else 8)} for s in range(1, 101)]
    windows = schedule_from_metrics(records, iterations=10_000, r_max=64, window=1000)
    assert [w.rank for w in windows] == [None, 64, 64, 64, 64, 64, 32, 32, 32, 32]


def test_methods_on_each_paper_preset():
    for name in ("gpt2-2.5b", "gpt2-12.1b"):
        preset = PRESETS[name]
        model = IterationModel(preset, CLUSTERS[preset.cluster])
        entropy = synthetic_entropy(preset.iterations)
        r_max, results = simulate_methods(
            model,
            preset.iterations,
            METHODS,
            MethodConfig(),
            lambda r: delta_rank_schedule(entropy, preset.iterations, r),
        )
        base = {r.method: r for r in results}
        assert r_max >= 4
        assert base["none"].iteration_s == pytest.approx(model.iteration((None,) * 4).iteration_s)
        # EDGC's stage 0 never syncs slower than uncompressed, so it never loses run time
        assert base["edgc"].total_s < base["none"].total_s
        assert base["edgc"].dp_sync_s < base["none"].dp_sync_s
