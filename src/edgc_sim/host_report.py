"""The host model (`edgc_sim.host_ops`) against the measured GPU hook, and its prediction for an engine.

One hook step at GPT-2 XL (rank 32, bf16 gradients, the GPU bench's hook alone: world size 1) costs
the host `host_ops.host_time` of the step's counted ops, and the device the engine model's bytes and
FLOPs (`engine_model.engine_step_cost` on the preset's rates). The host issues ahead of the device
(one host read per step), so the hook's wall time is the larger of the two (`EngineCost.seconds`).
The check holds the model to the hook rows the H200 measured; the prediction prices an engine's
census on the H200 and H100 presets, each host's op costs scaled from the trace's host by the
presets' per-op cost (`HostOpCosts.scaled_to`).
"""

from __future__ import annotations

from dataclasses import dataclass

from .collectives import gpt2_gradient_shapes
from .engine_model import ORTH_PASSES, WARM_START_PASSES, engine_jobs, engine_step_cost
from .hardware import DEVICES, DeviceSpec
from .host_ops import OP_CLASSES, HostOpCosts, HostTime, OpCensus, host_time
from .presets import ModelSpec

GPT2_XL = ModelSpec(48, 1600, 25)
RANK = 32
BF16_BYTES = 2
CHECK_WITHIN = 0.20  # the host model's largest error against each measured hook row
# The engine the H200 runs measured orthonormalised its warm-started Q in full, as it does P (the engine
# model's device time for the measured rows; this checkout's runs fewer passes, `WARM_START_PASSES`).
MEASURED_WARM_START_PASSES = ORTH_PASSES
PRESETS = ("h200", "h100")


@dataclass(frozen=True)
class HookStep:
    """One hook step priced: the host's time, the device's, and the wall time."""

    host: HostTime
    device_s: float
    launches: int  #: kernel-launching dispatches counted

    @property
    def wall_s(self) -> float:
        return max(self.host.seconds, self.device_s)


def device_seconds(
    device: DeviceSpec,
    bucket_cap_mib: float | None,
    model: ModelSpec = GPT2_XL,
    warm_start_passes: int = WARM_START_PASSES,
) -> float:
    """The engine model's device time for one hook step of ``model`` at DDP's ``bucket_cap_mib`` buckets."""
    shapes = gpt2_gradient_shapes(model)
    jobs = engine_jobs(shapes, BF16_BYTES, device.accelerator, bucket_cap_mib=bucket_cap_mib)
    return engine_step_cost(
        jobs,
        RANK,
        device.flops_per_s("fp16"),
        device.mem_bytes_per_s,
        device.launch_s,
        BF16_BYTES,
        device.skinny_rates(),
        world_size=1,
        warm_start_passes=warm_start_passes,
    ).device_s


def price(
    census: OpCensus,
    costs: HostOpCosts,
    device: DeviceSpec,
    bucket_cap_mib: float | None,
    warm_start_passes: int = WARM_START_PASSES,
) -> HookStep:
    """One hook step of this census on ``device`` with the host's op costs scaled to its per-op cost
    (``warm_start_passes``: the engine's, for the device's time)."""
    scaled = costs.scaled_to(device.launch_s) if costs.launch_s else costs
    return HookStep(
        host_time(census, scaled),
        device_seconds(device, bucket_cap_mib, warm_start_passes=warm_start_passes),
        sum(census.by_op.values()) + census.collectives,
    )


def _cap(label: str) -> float | None:
    """A bucket label ("25 (default)", "100") as DDP's bucket_cap_mb (None: its default)."""
    return None if "default" in label else float(label)


def costs_table(costs: HostOpCosts) -> str:
    lines = [
        "| op class | what | ops in the trace | µs per op, H200 host | µs per op, `h100` preset |",
        "| --- | --- | ---: | ---: | ---: |",
    ]
    h100 = costs.scaled_to(DEVICES["h100"].launch_s) if costs.launch_s else costs
    for name, what in OP_CLASSES.items():
        if name in costs.op_s:
            lines.append(
                f"| {name} | {what} | {costs.samples.get(name, 0):,} | {1e6 * costs.op_s[name]:.1f} "
                f"| {1e6 * h100.op_s[name]:.1f} |"
            )
    lines.append(
        f"| (hook call) | entering and leaving the hook, once per DDP bucket | – | {1e6 * costs.call_s:.1f} "
        f"| {1e6 * h100.call_s:.1f} |"
    )
    return "\n".join(lines)


def check_rows(costs: HostOpCosts, censuses: dict, measured: dict, again: dict | None = None) -> list[dict]:
    """Per bucket label: the model on the H200 preset against the measured hook (``measured``: label ->
    {"wall_s": the hook's time, "kernels_s": its kernels' summed time}; ``again``: the same hook in
    another run, shown beside it), and the one-cost-per-op model before it."""
    device = DEVICES["h200"]
    rows = []
    for label, census in censuses.items():
        step = price(census, costs, device, _cap(label), MEASURED_WARM_START_PASSES)
        flat = step.launches * device.launch_s  # every op at one tiny op's cost, as the simulator charged
        rows.append(
            {
                "bucket": label,
                "launches": step.launches,
                "views": sum(census.views_by_op.values()),
                "hook_calls": census.hook_calls,
                "host_s": step.host.seconds,
                "device_s": step.device_s,
                "wall_s": step.wall_s,
                "flat_s": max(flat, step.device_s),
                "measured_s": measured[label]["wall_s"],
                "kernels_s": measured[label].get("kernels_s"),
                "error": step.wall_s / measured[label]["wall_s"] - 1,
                "again_s": (again or {}).get(label, {}).get("wall_s"),
                "by_class": step.host.by_class,
            }
        )
    return rows


def check_table(rows: list[dict]) -> str:
    per_op = DEVICES["h200"].launch_s
    lines = [
        "| DDP bucket MB | dispatches + collectives / views / hook calls | host ms | device ms: model / kernels "
        f"measured | predicted ms | measured ms | error | the other run: ms, error "
        f"| {1e6 * per_op:.1f} µs every op (before) |",
        "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for r in rows:
        flat_error = r["flat_s"] / r["measured_s"] - 1
        kernels = "–" if r["kernels_s"] is None else f"{1e3 * r['kernels_s']:.1f}"
        again = "–" if r["again_s"] is None else f"{1e3 * r['again_s']:.1f}, {r['wall_s'] / r['again_s'] - 1:+.0%}"
        lines.append(
            f"| {r['bucket']} | {r['launches']:,} / {r['views']:,} / {r['hook_calls']} | {1e3 * r['host_s']:.1f} "
            f"| {1e3 * r['device_s']:.1f} / {kernels} | {1e3 * r['wall_s']:.1f} | {1e3 * r['measured_s']:.1f} "
            f"| {r['error']:+.1%} | {again} | {1e3 * r['flat_s']:.1f} ({flat_error:+.0%}) |"
        )
    worst = max(abs(r["error"]) for r in rows)
    verdict = "✓" if worst <= CHECK_WITHIN else "✗"
    lines += ["", f"{verdict} largest error {worst:.1%} (≤ {CHECK_WITHIN:.0%} at each row)."]
    return "\n".join(lines)


def share_line(row: dict) -> str:
    """Where one step's host time goes, largest first."""
    parts = sorted(row["by_class"].items(), key=lambda item: -item[1])
    total = sum(value for _, value in parts)
    return ", ".join(f"{name} {value / total:.0%}" for name, value in parts if value / total >= 0.01)


def prediction_table(costs: HostOpCosts, steps: dict) -> str:
    """``steps``: (mode, bucket label) -> OpCensus, or None where that mode cannot be counted here."""
    lines = [
        "| preset | mode | DDP bucket MB | dispatches + collectives / views | host ms | device ms | predicted ms |",
        "| --- | --- | --- | ---: | ---: | ---: | ---: |",
    ]
    for preset in PRESETS:
        device = DEVICES[preset]
        for (mode, label), census in steps.items():
            if census is None:
                lines.append(f"| {preset} | {mode} | {label} | not counted in this checkout | – | – | – |")
                continue
            step = price(census, costs, device, _cap(label))
            lines.append(
                f"| {preset} | {mode} | {label} | {step.launches:,} / {sum(census.views_by_op.values()):,} "
                f"| {1e3 * step.host.seconds:.1f} | {1e3 * step.device_s:.1f} | {1e3 * step.wall_s:.1f} |"
            )
    return "\n".join(lines)
