"""Our engine's model on the h100 preset: the preset against the H100 measurement it comes from, and
what fusing DDP's buckets into jobs does to a GPT-2 XL step."""

import json
from pathlib import Path

import pytest
from test_engine_model import COUNT, gpt2_model

from edgc_sim import engine_model as em
from edgc_sim.collectives import gpt2_gradient_shapes
from edgc_sim.hardware import DEVICES

DOCS = Path(__file__).resolve().parents[2] / "docs" / "gpu"
H100 = DEVICES["h100"]


def test_h100_preset_holds_the_measured_h100_profile():
    """Per-op cost, copy bandwidth and the engine's skinny GEMM rates are those an H100 measured
    (docs/gpu/before/device.json), to the three digits the preset keeps; the matmul peaks stay the
    datasheet's, above what the measured square GEMMs reached."""
    measured = json.loads((DOCS / "before" / "device.json").read_text())["measured"]
    for field in ("mem_bytes_per_s", "launch_s", "skinny_read_bytes_per_s", "skinny_write_bytes_per_s"):
        assert getattr(H100, field) == pytest.approx(measured[field], rel=5e-3), field
    assert H100.skinny_flops_per_s == pytest.approx(measured["matmul_flops"]["fp32"], rel=5e-3)
    for ours, theirs in (("fp16", "bf16"), ("tf32", "tf32"), ("fp32", "fp32")):
        assert measured["matmul_flops"][theirs] < H100.matmul_flops[ours]
    rates = H100.skinny_rates()
    assert rates.accelerator and rates.gemm_flops_per_s == H100.skinny_flops_per_s
    assert rates.orth_flops_per_s == 0  # not measured yet: that run timed torch.linalg.qr


def xl_step(bucket_cap_mib, fusion_mb=None) -> em.EngineCost:
    """One compressed GPT-2 XL step on one H100 as the GPU bench runs it: bf16 gradients, rank 32."""
    jobs = em.engine_jobs(
        gpt2_gradient_shapes(gpt2_model("xl")), 2, accelerator=True, bucket_cap_mib=bucket_cap_mib, fusion_mb=fusion_mb
    )
    return em.engine_step_cost(
        jobs,
        COUNT["rank"],
        H100.flops_per_s("fp16"),
        H100.mem_bytes_per_s,
        H100.launch_s,
        2,
        H100.skinny_rates(),
        world_size=COUNT["world_size"],
    )


def test_fusing_buckets_cuts_the_launches_not_the_bytes():
    """Every bucket its own job (fusion off) against DDP's 25 MB buckets fused into 256 MB jobs: the
    same bytes, over 3× fewer launches (the per-job launches of 62 of the 73 jobs go; the two per matrix
    that touch the gradients where they lie stay), and the step's engine time falls from launch-bound to
    the device's time."""
    apart, fused = xl_step(25, fusion_mb=0), xl_step(25)
    assert fused.device_s == pytest.approx(apart.device_s)
    assert fused.host_s < apart.host_s / 3
    assert apart.host_s > apart.device_s  # 73 jobs: the host issuing them is the bottleneck
    assert fused.seconds(True) < 0.7 * apart.seconds(True)


@pytest.mark.parametrize(
    "row", [r for r in COUNT["hook"] if r["model"] == "xl"], ids=lambda r: f"{r['bucket_cap_mb']}MB"
)
def test_host_time_is_the_counted_dispatches_at_the_measured_per_op_cost(row):
    cost = xl_step(None if row["ddp_default"] else row["bucket_cap_mb"])
    assert cost.host_s == pytest.approx(row["dispatches"] * H100.launch_s)


def test_larger_buckets_issue_less_on_the_same_device_work():
    costs = [xl_step(cap) for cap in (25, 100, 200)]
    assert costs[0].host_s > costs[1].host_s > costs[2].host_s
    assert costs[0].device_s == pytest.approx(costs[2].device_s)
    # at 256 MB jobs the device's bytes outweigh the launches: the bucket size no longer shows
    assert all(cost.device_s > cost.host_s for cost in costs)


def test_the_docs_block_is_this_models_output(load_producer):
    """docs/simulate.md's engine-model block is what scripts/to_docs.py engine-model writes now
    (regenerate with it after changing the model, the h100 preset or the committed count)."""
    script = load_producer("engine-model")
    page = (DOCS.parent / "simulate.md").read_text()
    start, end = (f"<!-- {script.BLOCK}:{edge} -->" for edge in ("start", "end"))
    assert page.split(start, 1)[1].split(end, 1)[0].strip() == script.block(COUNT).strip()
