"""The simulator's DiLoCo at many replica groups (`edgc_sim.diloco`): each collective kind's wire as the
groups grow, the kinds the registry names, what a lost group costs each method, and the fit to a
bench's scaling runs recovering the link it was made with."""

import math

import pytest

from edgc.sync.codecs import QuantCodec
from edgc.sync.sync_methods import ALL_GATHER, TWO_STAGE, sync_method
from edgc_sim import diloco
from edgc_sim.diloco import OUTER_SYNCS, Link, Site, crossover, outer_step, sync_seconds, wire_bytes
from edgc_sim.diloco_report import calibrate_on_bench, markdown


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


def test_the_one_stage_sync_crosses_torchfts_near_ten_groups_and_the_two_stage_never():
    site = Site(link_bits_per_s=1e9)
    assert 9 <= crossover("quant3", 8e9, site) <= 12
    assert crossover("quant3-2s", 8e9, site) is None and crossover("torchft-fp8", 8e9, site) is None


def test_a_lost_group_costs_torchft_its_outer_step_and_edgc_only_the_sync():
    site = Site(link_bits_per_s=1e9)
    theirs, mine = (
        outer_step(OUTER_SYNCS["torchft"], 1e9, 64, site),
        outer_step(OUTER_SYNCS["quant3-2s"], 1e9, 64, site),
    )
    heal = site.detect_s + site.heal_bytes_per_param * 1e9 / (1e9 / 8)
    assert theirs.loss_cost_s == pytest.approx(heal + theirs.outer_s)
    assert mine.loss_cost_s == pytest.approx(heal + mine.sync_s)
    never = outer_step(OUTER_SYNCS["torchft"], 70e9, 1024, Site(link_bits_per_s=1e8))
    assert never.goodput <= 0 and math.isinf(never.days_to(1e12, site, 1024))
    with pytest.raises(ValueError, match="link_bits_per_s"):
        Site(link_bits_per_s=0)


def synthetic_bench(link: Link, codec: float, floor: float = 0.3, h: int = 10, params: float = 4e6) -> dict:
    """Scaling rows whose outer steps are the model's own at ``link``: the fit must give it back."""
    rows = []
    for hosts in (3, 6, 12):
        for name, sync in (("diloco", "torchft"), ("quant3", "quant3"), ("quant3-2s", "quant3-2s")):
            seconds = h * floor + sync_seconds(OUTER_SYNCS[sync], params, hosts, link, codec)
            rows.append(
                {
                    "hosts": hosts,
                    "sync": name,
                    "payload_bytes": 4 * params,
                    "floor_s": floor,
                    "outer_step_s": seconds,
                    "wire_bytes": wire_bytes(OUTER_SYNCS[sync], params, hosts),
                }
            )
    return {
        "rows": rows,
        "options": {"sync_every": h},
        "command": "edgc bench --diloco --scaling 3,6,12",
        "rate_mbit": 20,
    }


def test_the_fit_on_three_and_six_hosts_gives_back_the_link_and_predicts_twelve():
    link = Link(2.3e6, 0.0, 0.4)
    result = calibrate_on_bench(synthetic_bench(link, 2e-8))
    assert result["link"].bytes_per_s == pytest.approx(2.3e6, rel=1e-6)
    assert result["link"].overhead_s == pytest.approx(0.4, rel=1e-6) and result["codec_s_per_value"] == pytest.approx(
        2e-8
    )
    assert all(abs(r["error"]) < 1e-6 for r in result["rows"])
    assert {r["hosts"] for r in result["rows"] if not r["fitted"]} == {12}
    text = markdown(Site(), synthetic_bench(link, 2e-8))
    assert "(extrapolation)" in text and "sim-diloco-calibration:start" in text and "none up to 1,024" in text
