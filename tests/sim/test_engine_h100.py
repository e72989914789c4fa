"""Our engine's model on the h100 preset: the preset against the H100 measurement it comes from."""
import json
from pathlib import Path

import pytest

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
