"""The simulator's DiLoCo at many replica groups (`edgc_sim.diloco`): each collective kind's wire as the
groups grow, the kinds the registry names, latency charged per collective with each method's buckets,
what a lost group costs each method, and the fit to a bench's scaling runs recovering the link it was
made with and predicting the runs with latency added."""

import math
from dataclasses import replace

import pytest
import torch

from edgc.sync.codecs import QuantCodec
from edgc.sync.sync_methods import ALL_GATHER, TWO_STAGE, sync_method
from edgc_sim import diloco
from edgc_sim.diloco import (
    MODELS,
    OUTER_SYNCS,
    Link,
    Site,
    collectives,
    configured_buckets,
    crossover,
    latencies,
    outer_step,
    sync_seconds,
    wire_bytes,
)
from edgc_sim.diloco_report import (
    GLOO_IN_FLIGHT,
    calibrate_on_bench,
    calibration_table,
    join_repeats,
    markdown,
    nonnegative_fit,
)

EIGHT_B = MODELS[1]
XL_PARAMS, XL_TENSORS = 1_557_611_200, 580  # GPT-2 XL, Hugging Face's layout


def test_two_stage_wire_stays_a_fixed_share_of_the_ring_and_the_slots_grow_with_the_groups():
    params = 1e9
    ratios = [
        wire_bytes(OUTER_SYNCS["quant3-2s"], params, n) / wire_bytes(OUTER_SYNCS["torchft"], params, n)
        for n in (3, 12, 1024)
    ]
    assert max(ratios) == pytest.approx(min(ratios)) and ratios[0] < 0.1
    slots = [
        wire_bytes(OUTER_SYNCS["quant3"], params, n) / wire_bytes(OUTER_SYNCS["torchft"], params, n) for n in (3, 12)
    ]
    assert slots[0] == pytest.approx(3 * ratios[0]) and slots[1] == pytest.approx(12 * ratios[0])  # 0.098 × N
    assert wire_bytes(OUTER_SYNCS["torchft"], params, 1) == 0


def test_the_model_prices_the_kinds_the_registry_names_at_the_codecs_bytes():
    assert sync_method("quant3").collective == ALL_GATHER and OUTER_SYNCS["quant3"].kind == diloco.SLOTS
    assert sync_method("quant3-2s").collective == TWO_STAGE and OUTER_SYNCS["quant3-2s"].kind == diloco.TWO_STAGE
    n = 2**20
    assert QuantCodec(3).message_bytes(n) / n == pytest.approx(OUTER_SYNCS["quant3-2s"].bytes_per_value, rel=1e-6)


def test_latency_is_charged_per_collective_with_each_methods_buckets():
    groups, two_stage = 12, OUTER_SYNCS["quant3-2s"]
    reducer = sync_method("quant3-2s").build()
    assert configured_buckets("quant3-2s") == (reducer.bucket_values, reducer.codec.row_multiple)
    assert two_stage.bucket_values is diloco.FROM_RUN
    # the reducer's own cut of the run: about sixteen buckets, N whole rows each
    buckets = reducer.buckets(XL_PARAMS, groups)[1]
    assert buckets == 16 and collectives(two_stage, XL_PARAMS, XL_TENSORS, groups) == 32
    assert latencies(two_stage, groups, XL_PARAMS, XL_TENSORS) == buckets * (1 + groups - 1)
    # torchft's DiLoCo all-reduces tensor by tensor, its FP8 path likewise (two-stage per tensor)
    assert latencies(OUTER_SYNCS["torchft"], groups, XL_PARAMS, XL_TENSORS) == XL_TENSORS * 2 * (groups - 1)
    assert latencies(OUTER_SYNCS["torchft-fp8"], groups, XL_PARAMS, XL_TENSORS) == XL_TENSORS * groups
    # the one-stage sync: one message a fragment, whatever its size
    assert latencies(OUTER_SYNCS["quant3"], groups, XL_PARAMS, XL_TENSORS) == 2 * (groups - 1)
    assert latencies(two_stage, 1, XL_PARAMS, XL_TENSORS) == 0
    link, far, costly = Link(1e8, 0.0, 0.5), Link(1e8, 0.0, 0.5, round_trip_s=0.03), Link(1e8, 0.004, 0.5)
    for sync in OUTER_SYNCS.values():
        base = sync_seconds(sync, XL_PARAMS, groups, link, 1e-9, XL_TENSORS)
        rounds_waited = latencies(sync, groups, XL_PARAMS, XL_TENSORS)
        # a round waits for its neighbour's message, sent when the round began: one way, half the round trip
        far_s = sync_seconds(sync, XL_PARAMS, groups, far, 1e-9, XL_TENSORS)
        assert far_s - base == pytest.approx(0.015 * rounds_waited)
        assert sync_seconds(sync, XL_PARAMS, groups, costly, 1e-9, XL_TENSORS) - base == pytest.approx(
            0.004 * rounds_waited
        )
    fixed = replace(two_stage, bucket_values=2**19)  # the bucket before it was sized from the run
    assert collectives(fixed, XL_PARAMS, XL_TENSORS, groups) == 5942


def test_a_process_group_that_runs_two_collectives_at_once_waits_for_fewer_rounds():
    """gloo runs two at once (its worker threads): collectives issued together wait half as long, and
    the two-stage sync's next all-to-all goes while this bucket's all-gather runs."""
    import torch.distributed as dist

    assert GLOO_IN_FLIGHT == dist.ProcessGroupGloo._Options()._threads
    groups, tensors = 6, 52
    ring = OUTER_SYNCS["torchft"]
    assert latencies(ring, groups, 4e6, tensors, in_flight=2) == tensors // 2 * 2 * (groups - 1)
    assert latencies(ring, groups, 4e6, tensors + 1, in_flight=2) == (tensors // 2 + 1) * 2 * (groups - 1)
    assert diloco.pipelined_rounds(9, 1, groups - 1, in_flight=1) == 9 * groups  # in turn: every round adds up
    assert diloco.pipelined_rounds(1, 1, groups - 1, in_flight=2) == groups  # one bucket: nothing to overlap
    overlapped = [diloco.pipelined_rounds(count, 1, 2, in_flight=2) for count in (9, 30)]
    assert overlapped == [14, 45]  # 3 groups: about half of 27 and 90


def test_without_latency_the_one_stage_sync_crosses_torchfts_near_ten_groups_and_the_two_stage_never():
    site = Site(link_bits_per_s=1e9, round_trip_s=0.0)
    assert 9 <= crossover("quant3", EIGHT_B, site) <= 12
    assert crossover("quant3-2s", EIGHT_B, site) is None and crossover("torchft-fp8", EIGHT_B, site) is None


def test_over_a_wan_the_two_stage_sync_stays_ahead_with_its_buckets_sized_from_the_run_and_not_at_a_fixed_bucket():
    site = Site(link_bits_per_s=1e9, round_trip_s=0.03)
    assert crossover("quant3-2s", EIGHT_B, site) is None
    for groups in (8, 1024):
        assert (
            outer_step(OUTER_SYNCS["quant3-2s"], EIGHT_B, groups, site).outer_s
            < outer_step(OUTER_SYNCS["torchft"], EIGHT_B, groups, site).outer_s
        )
    fixed = replace(OUTER_SYNCS["quant3-2s"], bucket_values=2**19)  # thousands of buckets, N round trips each
    assert outer_step(fixed, EIGHT_B, 2, site).outer_s > outer_step(OUTER_SYNCS["torchft"], EIGHT_B, 2, site).outer_s


def test_a_lost_group_costs_torchft_its_outer_step_and_edgc_only_the_sync():
    site = Site(link_bits_per_s=1e9)
    one_b = MODELS[0]
    theirs, mine = (
        outer_step(OUTER_SYNCS["torchft"], one_b, 64, site),
        outer_step(OUTER_SYNCS["quant3-2s"], one_b, 64, site),
    )
    heal = site.detect_s + site.heal_bytes_per_param * one_b.params / (1e9 / 8)
    assert theirs.loss_cost_s == pytest.approx(heal + theirs.outer_s)
    assert mine.loss_cost_s == pytest.approx(heal + mine.sync_s)
    never = outer_step(OUTER_SYNCS["torchft"], MODELS[2], 1024, Site(link_bits_per_s=1e8))
    assert never.goodput <= 0 and math.isinf(never.days_to(1e12, site, 1024))
    with pytest.raises(ValueError, match="link_bits_per_s"):
        Site(link_bits_per_s=0)


def synthetic_bench(
    link: Link, codec: float, floor: float = 0.3, h: int = 10, params: float = 4e6, delay_ms: float = 0.0
) -> dict:
    """Scaling rows whose outer steps are the model's own at ``link`` (and, with ``delay_ms``, the same
    runs with that one-way delay added to each host's link: each round of each collective waits one way of it):
    the fit must give it back."""
    rows, tensors = [], 52
    for delay in (0.0, delay_ms) if delay_ms else (0.0,):
        delayed = replace(link, round_trip_s=2 * delay / 1e3)
        for hosts in (3, 6, 12):
            for name, sync in (("diloco", "torchft"), ("quant3", "quant3"), ("quant3-2s", "quant3-2s")):
                seconds = h * floor + sync_seconds(OUTER_SYNCS[sync], params, hosts, delayed, codec, tensors)
                rows.append(
                    {
                        "hosts": hosts,
                        "sync": name,
                        "payload_bytes": 4 * params,
                        "floor_s": floor,
                        "outer_step_s": seconds,
                        "wire_bytes": wire_bytes(OUTER_SYNCS[sync], params, hosts),
                        "delay_ms": delay,
                        "tensors": tensors,
                    }
                )
    return {
        "rows": rows,
        "options": {"sync_every": h},
        "command": "edgc bench --diloco --scaling 3,6,12",
        "rate_mbit": 20,
    }


def test_the_fit_on_three_and_six_hosts_gives_back_the_link_and_predicts_twelve_and_the_added_latency():
    link = Link(2.3e6, 0.002, 0.4, GLOO_IN_FLIGHT)
    result = calibrate_on_bench(synthetic_bench(link, 2e-8, params=3e6, delay_ms=15))
    assert result["link"].bytes_per_s == pytest.approx(2.3e6, rel=1e-6)
    assert result["link"].round_s == pytest.approx(0.002, rel=1e-6)
    assert result["link"].overhead_s == pytest.approx(0.4, rel=1e-6) and result["codec_s_per_value"] == pytest.approx(
        2e-8
    )
    assert all(abs(r["error"]) < 1e-6 for r in result["rows"])
    assert {r["hosts"] for r in result["rows"] if r["extrapolated"]} == {12}
    assert not any(r["fitted"] for r in result["rows"] if r["round_trip_s"])  # checked, not fitted
    assert {r["round_trip_s"] for r in result["rows"]} == {0.0, 0.03}
    assert "✓ with latency added" in calibration_table(result, 20)
    text = markdown(Site(), synthetic_bench(link, 2e-8, params=3e6))
    assert "(extrapolation)" in text and "sim-diloco-calibration:start" in text and "none up to 1,024" in text
    untold = synthetic_bench(link, 2e-8)
    for row in untold["rows"]:
        del row["tensors"]
    with pytest.raises(ValueError, match="names no parameter tensors"):
        calibrate_on_bench(untold)


def test_the_link_fit_keeps_every_cost_non_negative_and_optimal_among_those():
    """Runs whose best unconstrained fit has a negative fixed cost (a noisy bench): the fit is the
    non-negative optimum (its KKT conditions hold), not the unconstrained one clamped, which fits worse."""
    generator = torch.Generator().manual_seed(0)
    design = torch.rand(6, 4, generator=generator, dtype=torch.float64) * torch.tensor([1e7, 1.0, 3e7, 300.0])
    design[:, 1] = 1.0
    target = (
        design @ torch.tensor([4e-7, 0.0, 4e-8, 0.0], dtype=torch.float64)
        - 0.8
        + 0.3 * torch.rand(6, generator=generator, dtype=torch.float64)
    )
    weights = 1 / target.abs()
    unconstrained = torch.linalg.lstsq(design * weights[:, None], (target * weights)[:, None]).solution.squeeze(1)
    assert (unconstrained < 0).any()  # the case the fit is for
    fitted = torch.tensor(nonnegative_fit(design, target, weights), dtype=torch.float64)
    assert (fitted >= 0).all() and fitted[0] > 0

    def loss(x):
        return float((((design @ x - target) * weights) ** 2).sum())

    gradient = (design * weights[:, None]).T @ ((design @ fitted - target) * weights)
    scale = gradient.abs().max()
    for coefficient, slope in zip(fitted.tolist(), gradient.tolist()):
        assert slope >= -1e-9 * scale  # raising a cost held at 0 cannot lower the loss
        if coefficient > 0:
            assert abs(slope) <= 1e-6 * scale  # a free cost sits at its optimum
    assert loss(fitted) <= loss(unconstrained.clamp(min=0))


def _repeat(bench: dict, delayed_factor: float) -> dict:
    """A repeat of ``bench`` whose runs with a delay took ``delayed_factor`` times as long."""
    rows = [
        {**r, "outer_step_s": r["outer_step_s"] * (delayed_factor if r["delay_ms"] else 1.0)} for r in bench["rows"]
    ]
    return {**bench, "rows": rows}


def test_repeats_of_the_bench_are_fitted_by_their_medians_and_a_miss_inside_their_range_is_called_noise():
    link = Link(2.3e6, 0.002, 0.4, GLOO_IN_FLIGHT)
    bench = synthetic_bench(link, 2e-8, params=3e6, delay_ms=15)
    joined = join_repeats([_repeat(bench, 1.3), _repeat(bench, 0.9), _repeat(bench, 1.0)])
    result = calibrate_on_bench(joined)
    assert all(abs(r["error"]) < 1e-6 for r in result["rows"])  # the medians are the model's own
    delayed = [r for r in result["rows"] if r["round_trip_s"]]
    assert all(len(r["repeats_s"]) == 3 for r in delayed)
    assert "✓ with latency added" in calibration_table(result, 20) and "× 3 repeats" in joined["command"]
    outs = [{**bench, "command": f"{bench['command']} --out runs/r{k}"} for k in range(3)]
    remade = f"{bench['command']} --out {{runs/r0,runs/r1,runs/r2}} (× 3 repeats, medians)"
    assert join_repeats(outs)["command"] == remade
    slow = calibrate_on_bench(join_repeats([_repeat(bench, 1.25), _repeat(bench, 1.2), _repeat(bench, 0.9)]))
    assert "≈ (noise) with latency added" in calibration_table(slow, 20)  # 1/1.2 − 1 = −16.7 %, inside 0.9–1.25
    far = calibrate_on_bench(join_repeats([_repeat(bench, 1.25), _repeat(bench, 1.2), _repeat(bench, 1.3)]))
    assert "✗ with latency added" in calibration_table(far, 20)
    other = {**bench, "options": {**bench["options"], "sync_every": 5}}
    with pytest.raises(ValueError, match="not repeats"):
        join_repeats([bench, other])
