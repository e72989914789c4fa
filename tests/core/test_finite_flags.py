"""Non-finite flags: a NaN/Inf anywhere makes the step non-finite on every rank, and nothing else does.

fp16 gradients under a GradScaler are scaled by 2¹⁶, so a bucket's values add up past fp16's largest
number (65,504) although every one of them is finite: a finiteness test by a sum in fp16 would flag
(and NaN) such a step, and clear its error feedback."""

import math

import pytest
import torch
from distributed_harness import run_distributed
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

from edgc import EDGCConfig, EDGCState, LowRankConfig, edgc_hook
from edgc.device.finite import all_finite

LOSS_SCALE = 2.0**16  # GradScaler's initial scale
WIDTH = 64


def scaled_fp16_step_worker(rank, world_size, min_compression_rate, poison):
    """One compressing step of an fp16 Linear(64, 64) through DDP and the EDGC hook, its loss scaled
    as a GradScaler scales it: every bias gradient is 2¹⁰, every weight gradient 2¹⁰·(1 + rank),
    so each bucket's fp16 sum overflows while each element is finite. ``poison``: rank 1 feeds an Inf."""
    torch.manual_seed(0)
    model = nn.Linear(WIDTH, WIDTH).half()
    ddp = DDP(model)
    config = EDGCConfig(
        r_max=4,
        adaptive=False,
        min_warmup_steps=0,
        warmup_error_test=False,
        engine=LowRankConfig(min_compression_rate=min_compression_rate),
    )
    state = EDGCState(None, config, model=ddp)
    ddp.register_comm_hook(state, edgc_hook)
    inputs = torch.full((1, WIDTH), 1.0 + rank, dtype=torch.float16)
    if poison and rank == 1:
        inputs[0, 0] = math.inf
    loss = ddp(inputs).float().sum() * (LOSS_SCALE / WIDTH)
    loss.backward()
    metrics = state.last_step_metrics
    return {
        "nonfinite": metrics["nonfinite"],
        "phase": metrics["phase"],
        "ranks": metrics["ranks"],
        "weight": model.weight.grad.clone(),
        "bias": model.bias.grad.clone(),
    }


@pytest.mark.parametrize("path,min_compression_rate", [("raw", 1000.0), ("compressed", 1.0)])
def test_fp16_gradients_at_gradscaler_scale_raise_no_false_flag(path, min_compression_rate):
    results = run_distributed(scaled_fp16_step_worker, 2, min_compression_rate, False)
    for result in results:
        assert result["phase"] == "compress"
        assert result["ranks"]["weight"] == (0 if path == "raw" else 4), result["ranks"]
        assert result["bias"].sum(dtype=torch.float16).isinf()  # the sum a flag must not trust
        assert not result["nonfinite"]
        assert torch.equal(result["bias"], torch.full((WIDTH,), 1024.0, dtype=torch.float16))
        # The average of 1024·1 and 1024·2; rank 4 recovers this rank-1 matrix up to fp16 rounding.
        expected = torch.full((WIDTH, WIDTH), 1536.0)
        torch.testing.assert_close(result["weight"].float(), expected, rtol=0 if path == "raw" else 2e-3, atol=0)
    assert torch.equal(results[0]["weight"], results[1]["weight"])


@pytest.mark.parametrize("path,min_compression_rate", [("raw", 1000.0), ("compressed", 1.0)])
def test_a_genuine_inf_at_gradscaler_scale_is_still_flagged_on_every_rank(path, min_compression_rate):
    for result in run_distributed(scaled_fp16_step_worker, 2, min_compression_rate, True):
        assert result["nonfinite"]
        assert not torch.isfinite(result["weight"]).all()


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32, torch.float64])
def test_all_finite_flags_nan_and_inf_and_nothing_else(dtype):
    largest = torch.full((1000,), torch.finfo(dtype).max, dtype=dtype)  # their sum overflows their dtype
    for values in (largest, -largest, torch.zeros(0, dtype=dtype)):
        flag = all_finite(values)
        assert flag.dtype == torch.bool and flag.dim() == 0 and bool(flag)
    for bad in (math.inf, -math.inf, math.nan):
        values = largest.clone()
        values[500] = bad
        assert not all_finite(values)
    assert not all_finite(torch.tensor([math.inf, -math.inf], dtype=dtype))  # a sum of them is NaN
