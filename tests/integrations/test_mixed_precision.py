"""bf16 training of a tiny GPT-2 (2 layers, width 64) with EDGC (2 gloo processes, 50 steps).

Runs, same seed and data, EDGC adaptive from step 6 on:
  fp32       fp32 parameters and gradients; P and Q on the wire in fp32 (gradient dtype);
  bf16       bf16 parameters and gradients (fp32 master weights in the optimizer, the usual bf16
             recipe); factors and error feedback fp32, P and Q on the wire in bf16;
  fp32→bf16  fp32 gradients with communication_dtype='bfloat16' (8 steps, bytes only);
  bf16-ef    as bf16, with error_feedback_dtype='gradient' (bf16 error feedback: half the memory).
What halves: with bf16 gradients every byte DDP hands to the hook (the raw tensors, the flag,
P and Q) is bf16, so bytes_sent and bytes_raw are exactly half the fp32 run's at the same rank;
with fp32 gradients and communication_dtype='bfloat16' only the P and Q bytes halve.
"""

import math
import time

import pytest
import torch
from distributed_harness import run_distributed
from torch.nn.parallel import DistributedDataParallel as DDP

from edgc import EDGCConfig, LowRankConfig
from edgc.integrations import register_edgc

STEPS, SEQ, VOCAB = 50, 32, 512


def walk(seed: int, size: int = 8) -> torch.Tensor:
    """Random walks over 16 tokens (+1 or +2 per position): learnable, entropy floor ln 2."""
    generator = torch.Generator().manual_seed(seed)
    start = torch.randint(0, 16, (size, 1), generator=generator)
    steps = torch.randint(1, 3, (size, SEQ - 1), generator=generator)
    return torch.cat([start, start + steps.cumsum(dim=1)], dim=1) % 16


def train(rank, dtype, communication_dtype, steps, error_feedback_dtype="float32"):
    from transformers import GPT2Config, GPT2LMHeadModel

    started = time.perf_counter()
    torch.manual_seed(0)
    # width 64: a CPU without bf16 instructions multiplies bf16 matrices ~30x slower than fp32, and the bf16 runs
    # were three quarters of the file's time at width 128; what is compared (bytes, dtypes, loss) needs no width
    config = GPT2Config(
        vocab_size=VOCAB, n_positions=SEQ, n_embd=64, n_layer=2, n_head=2, bos_token_id=0, eos_token_id=0
    )
    model = GPT2LMHeadModel(config).to(dtype)
    ddp = DDP(model)
    state = register_edgc(
        ddp,
        EDGCConfig(
            r_max=8,
            window=10,
            total_steps=STEPS,
            warmup_error_test=False,
            engine=LowRankConfig(communication_dtype=communication_dtype, error_feedback_dtype=error_feedback_dtype),
        ),
    )
    params = list(model.parameters())
    master = params if dtype == torch.float32 else [p.detach().float().requires_grad_() for p in params]
    optimizer = torch.optim.AdamW(master, lr=3e-3)
    schedule = torch.optim.lr_scheduler.LambdaLR(  # 5 warm-up steps, cosine to 0 at STEPS
        optimizer, lambda s: min(1.0, (s + 1) / 5) * 0.5 * (1 + math.cos(math.pi * s / STEPS))
    )
    losses, metrics = [], []
    for step in range(steps):
        tokens = walk(1000 * rank + step)
        loss = ddp(input_ids=tokens, labels=tokens).loss
        for p in params:
            p.grad = None
        loss.backward()
        if master is not params:
            for w, p in zip(master, params):
                w.grad = p.grad.float()
        optimizer.step()
        schedule.step()
        if master is not params:
            with torch.no_grad():
                for w, p in zip(master, params):
                    p.copy_(w)
        losses.append(loss.float().item())
        metrics.append({k: state.last_step_metrics[k] for k in ("phase", "rank", "ranks", "bytes_sent", "bytes_raw")})
    shapes = {name: tuple(p.shape) for name, p in model.named_parameters()}
    dtypes = {str(t.dtype) for t in [*state.compressor.q.values(), *state.compressor.error.values()]}
    error_bytes = sum(e.numel() * e.element_size() for e in state.compressor.error.values())
    grad_dtype = str(params[0].grad.dtype)
    return {
        "losses": losses,
        "metrics": metrics,
        "shapes": shapes,
        "state_dtypes": dtypes,
        "grad_dtype": grad_dtype,
        "error_dtypes": {str(e.dtype) for e in state.compressor.error.values()},
        "error_bytes": error_bytes,
        "seconds": time.perf_counter() - started,
    }


def train_worker(rank, world_size):
    """All three runs in one pair of processes (one start-up instead of three)."""
    return {
        "fp32": train(rank, torch.float32, None, STEPS),
        "bf16": train(rank, torch.bfloat16, None, STEPS),
        "fp32_bf16_wire": train(rank, torch.float32, "bfloat16", 8),
        "bf16_ef": train(rank, torch.bfloat16, None, STEPS, error_feedback_dtype="gradient"),
    }


def pq_elements(metrics: dict, shapes: dict) -> int:
    """Elements of P and Q in one step: (m + n)·r for every compressed matrix."""
    total = 0
    for name, r in metrics["ranks"].items():
        m = shapes[name][0]
        n = math.prod(shapes[name]) // m
        total += (m + n) * r
    return total


@pytest.fixture(scope="module")
def runs():
    results = run_distributed(train_worker, 2)
    print({name: round(run["seconds"], 1) for name, run in results[0].items()})
    return {name: [r[name] for r in results] for name in results[0]}


def final_loss(results) -> float:
    """Mean training loss of the last 5 steps, over both ranks."""
    return sum(sum(r["losses"][-5:]) / 5 for r in results) / len(results)


def test_bf16_training_tracks_fp32_within_2_percent(runs):
    fp32, bf16 = final_loss(runs["fp32"]), final_loss(runs["bf16"])
    print(f"final loss (mean of steps 46-50): fp32 {fp32:.4f}  bf16 {bf16:.4f}  ({bf16 / fp32 - 1:+.2%})")
    assert runs["fp32"][0]["losses"][0] - fp32 > 3, "the run should learn"
    assert abs(bf16 / fp32 - 1) < 0.02
    bf16_rank0 = runs["bf16"][0]
    assert bf16_rank0["grad_dtype"] == "torch.bfloat16"
    assert bf16_rank0["state_dtypes"] == {"torch.float32"}  # factors and error feedback stay fp32
    assert sum(m["phase"] == "compress" for m in bf16_rank0["metrics"]) >= 40


def test_bf16_gradients_halve_every_byte_on_the_wire(runs):
    compared = 0
    for a, b in zip(runs["fp32"][0]["metrics"], runs["bf16"][0]["metrics"]):
        if a["phase"] == b["phase"] == "compress" and a["ranks"] == b["ranks"]:
            assert 2 * b["bytes_raw"] == a["bytes_raw"]
            # Same elements at half the size, except the one-element non-finite flag per DDP
            # bucket: the bf16 model's 2x smaller gradients fill fewer buckets.
            assert abs(b["bytes_sent"] / a["bytes_sent"] - 0.5) < 1e-4
            assert b["bytes_sent"] < b["bytes_raw"] / 2
            compared += 1
            ratio = b["bytes_sent"] / a["bytes_sent"]
    print(f"bytes_sent bf16 / fp32 = {ratio:.6f} on {compared} compressed steps at equal ranks")
    assert compared >= 10


def test_bfloat16_communication_halves_the_p_and_q_bytes(runs):
    fp32, wire = runs["fp32"][0], runs["fp32_bf16_wire"][0]
    compared = 0
    for a, b in zip(fp32["metrics"], wire["metrics"]):
        if a["phase"] != "compress":
            assert a["bytes_sent"] == b["bytes_sent"]  # uncompressed steps: the gradient dtype
            continue
        assert a["ranks"] == b["ranks"]
        pq = pq_elements(a, fp32["shapes"])
        raw_part = a["bytes_sent"] - 4 * pq
        assert b["bytes_sent"] == raw_part + 2 * pq  # P and Q: 4 → 2 bytes; raw tensors unchanged
        compared += 1
        ratio = (b["bytes_sent"] - raw_part) / (a["bytes_sent"] - raw_part)
    print(f"P/Q bytes bfloat16 / float32 = {ratio}; total bytes_sent ratio {b['bytes_sent'] / a['bytes_sent']:.3f}")
    assert compared >= 2


def test_bf16_error_feedback_halves_its_memory_and_tracks_fp32_error_feedback(runs):
    fp32_ef, bf16_ef = runs["bf16"], runs["bf16_ef"]
    assert bf16_ef[0]["error_dtypes"] == {"torch.bfloat16"} and fp32_ef[0]["error_dtypes"] == {"torch.float32"}
    assert bf16_ef[0]["error_bytes"] * 2 == fp32_ef[0]["error_bytes"]
    # What it does to the loss (printed for docs/integrations.md): within 2 % of fp32 error feedback.
    print(
        f"final loss, bf16 gradients: fp32 EF {final_loss(fp32_ef):.4f}, bf16 EF {final_loss(bf16_ef):.4f}, "
        f"fp32 training {final_loss(runs['fp32']):.4f}"
    )
    assert abs(final_loss(bf16_ef) / final_loss(fp32_ef) - 1) < 0.02
