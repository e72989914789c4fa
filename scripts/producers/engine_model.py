"""Our engine's modelled cost of a compressed GPT-2 XL step on the simulator's `h100` preset, into docs/simulate.md.

    PYTHONPATH=src .venv/bin/python scripts/to_docs.py engine-model

Writes the ``engine-model`` block: per DDP bucket size, with the library's fusion and without it, the
jobs of one step, the launches `edgc_sim.engine_model` counts beside the dispatches counted for
docs/gpu/count/count.json, the host's time issuing them, the device's time and the engine's time
per step; and the preset's rates it used. tests/sim/test_engine_h100.py fails when the block is not
this model's output. Nothing is typed: every figure comes from the model and the two files.
"""

from __future__ import annotations

import json

from doc_blocks import ROOT, write

from edgc.runner.jobs import DEFAULT_ACCELERATOR_FUSION_MB
from edgc_probes.gpt2_layout import GPT2_SIZES
from edgc_sim import engine_model as em
from edgc_sim.collectives import gpt2_gradient_shapes
from edgc_sim.hardware import DEVICES
from edgc_sim.presets import ModelSpec

COUNT = ROOT / "docs" / "gpu" / "count" / "count.json"
BLOCK = "engine-model"
# (DDP bucket MB, fusion MB): DDP's default buckets apart and fused, then the larger buckets fused
CASES = ((25, 0), (25, None), (100, None), (200, None))


def step(model: str, bucket_cap_mb: float, fusion_mb: float | None, count: dict, device=DEVICES["h100"]):
    """(jobs, launches, EngineCost) of one compressed step as the GPU bench runs it (bf16 gradients,
    the count's rank and world size)."""
    layers, width, heads, vocab, context = GPT2_SIZES[model]
    shapes = gpt2_gradient_shapes(ModelSpec(layers, width, heads, context, vocab, vocab_pad=1, positions=context))
    jobs = em.engine_jobs(shapes, 2, accelerator=True, bucket_cap_mib=bucket_cap_mb, fusion_mb=fusion_mb)
    launches = em.step_launches(
        jobs, count["rank"], accelerator=True, half_gradients=True, world_size=count["world_size"]
    )
    cost = em.engine_step_cost(
        jobs,
        count["rank"],
        device.flops_per_s("fp16"),
        device.mem_bytes_per_s,
        device.launch_s,
        2,
        device.skinny_rates(),
        world_size=count["world_size"],
    )
    return jobs, launches, cost


def block(count: dict, device=DEVICES["h100"]) -> str:
    counted = {float(row["bucket_cap_mb"]): row["dispatches"] for row in count["hook"] if row["model"] == "xl"}
    lines = [
        "| DDP bucket MB | fusion MB | jobs | launches (model) | dispatches (counted) | host ms | device ms | "
        "engine ms |",
        "| ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for cap, fusion in CASES:
        jobs, launches, cost = step("xl", cap, fusion, count, device)
        fused = fusion is None
        shown = counted.get(float(cap), "–") if fused else "not counted"
        lines.append(
            f"| {cap} | {DEFAULT_ACCELERATOR_FUSION_MB if fused else 'off'} | {len(jobs)} | {launches} | "
            f"{shown} | {cost.host_s * 1e3:.1f} | {cost.device_s * 1e3:.1f} | "
            f"{cost.seconds(True) * 1e3:.1f} |"
        )
    rates = device.skinny_rates()
    lines += [
        "",
        f"GPT-2 XL, rank {count['rank']}, bf16 gradients, world size {count['world_size']} (the dispatch "
        f"count's setting); preset `{device.name}`: per-op cost {device.launch_s * 1e6:.3g} µs, memory "
        f"{device.mem_bytes_per_s / 1e12:.3g} TB/s, skinny GEMM read / write {rates.read_bytes_per_s / 1e12:.3g} / "
        f"{rates.write_bytes_per_s / 1e12:.3g} TB/s beyond their FLOPs at {rates.gemm_flops_per_s / 1e12:.3g} "
        "TFLOP/s (fp32), orthonormalisation "
        + (
            f"at {rates.orth_flops_per_s / 1e9:.3g} GFLOP/s"
            if rates.orth_flops_per_s
            else "at the same rate (not measured)"
        )
        + ".",
    ]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:  # no arguments: every input is committed
    page = write(BLOCK, block(json.loads(COUNT.read_text())))
    print(f"wrote block {BLOCK!r} in {page.relative_to(ROOT)}")
    return 0
