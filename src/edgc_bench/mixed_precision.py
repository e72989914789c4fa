"""bf16 training against fp32 through EDGC's DDP hook: a tiny GPT-2 (2 layers, width 64, vocab 512) on
2 gloo processes, 50 steps, same seed and data, EDGC adaptive once its warm-up ends (docs/integrations.md).

    python -m edgc_bench.mixed_precision --out docs/integrations/mixed-precision.json   # CPU, minutes
    python scripts/to_docs.py mixed-precision                                          # the block

The runs, all in one pair of processes (`train_worker`):
  fp32            fp32 parameters and gradients; P and Q on the wire in fp32 (the gradient dtype);
  bf16            bf16 parameters and gradients (fp32 master weights in the optimizer, the usual bf16
                  recipe); factors and error feedback fp32, P and Q on the wire in bf16;
  fp32_bf16_wire  fp32 gradients with communication_dtype='bfloat16' (8 steps, bytes only);
  bf16_ef         as bf16, with error_feedback_dtype='gradient' (bf16 error feedback: half the memory).
What halves: with bf16 gradients every byte DDP hands to the hook (the raw tensors, the flag, P and
Q) is bf16, so bytes_sent and bytes_raw are half the fp32 run's at the same rank; with fp32 gradients
and communication_dtype='bfloat16' only the P and Q bytes halve. `figures` reads the manual's figures
from the runs; tests/bench/test_mixed_precision.py runs the same worker and asserts on the runs.
"""

from __future__ import annotations

import argparse
import json
import math
import time
from pathlib import Path

import torch
from torch.nn.parallel import DistributedDataParallel as DDP

from edgc import EDGCConfig, LowRankConfig
from edgc.integrations import register_edgc

from .gpu_support import spawn_group

STEPS, SEQ, VOCAB, WIDTH, LAYERS, WORLD = 50, 32, 512, 64, 2, 2
LAST = 5  # the final loss: the mean over the last LAST steps


def walk(seed: int, size: int = 8) -> torch.Tensor:
    """Random walks over 16 tokens (+1 or +2 per position): learnable, entropy floor ln 2."""
    generator = torch.Generator().manual_seed(seed)
    start = torch.randint(0, 16, (size, 1), generator=generator)
    steps = torch.randint(1, 3, (size, SEQ - 1), generator=generator)
    return torch.cat([start, start + steps.cumsum(dim=1)], dim=1) % 16


def _model_and_state(dtype: torch.dtype, communication_dtype, error_feedback_dtype: str):
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    # width 64: a CPU without bf16 instructions multiplies bf16 matrices ~30x slower than fp32, and the bf16 runs
    # were three quarters of the time at width 128; what is compared (bytes, dtypes, loss) needs no width
    config = GPT2Config(
        vocab_size=VOCAB, n_positions=SEQ, n_embd=WIDTH, n_layer=LAYERS, n_head=2, bos_token_id=0, eos_token_id=0
    )
    model = GPT2LMHeadModel(config).to(dtype)
    ddp = DDP(model)
    engine = LowRankConfig(communication_dtype=communication_dtype, error_feedback_dtype=error_feedback_dtype)
    state = register_edgc(
        ddp, EDGCConfig(r_max=8, window=10, total_steps=STEPS, warmup_error_test=False, engine=engine)
    )
    return model, ddp, state


def train(rank, dtype, communication_dtype, steps, error_feedback_dtype="float32") -> dict:
    """One run of ``steps`` steps on this rank: its losses, each step's metrics, the state's dtypes."""
    started = time.perf_counter()
    model, ddp, state = _model_and_state(dtype, communication_dtype, error_feedback_dtype)
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
    errors = list(state.compressor.error.values())
    return {
        "losses": losses,
        "metrics": metrics,
        "shapes": {name: tuple(p.shape) for name, p in model.named_parameters()},
        "state_dtypes": {str(t.dtype) for t in [*state.compressor.q.values(), *errors]},
        "grad_dtype": str(params[0].grad.dtype),
        "error_dtypes": {str(e.dtype) for e in errors},
        "error_bytes": sum(e.numel() * e.element_size() for e in errors),
        "seconds": time.perf_counter() - started,
    }


def train_worker(rank, world_size) -> dict:
    """All four runs in one pair of processes (one start-up instead of four)."""
    return {
        "fp32": train(rank, torch.float32, None, STEPS),
        "bf16": train(rank, torch.bfloat16, None, STEPS),
        "fp32_bf16_wire": train(rank, torch.float32, "bfloat16", 8),
        "bf16_ef": train(rank, torch.bfloat16, None, STEPS, error_feedback_dtype="gradient"),
    }


def measure(runner=spawn_group, timeout: float = 600) -> dict:
    """The runs by name, each a list of its ranks' results. ``runner``: `spawn_group`'s signature (the
    suite passes one that uses its process pool)."""
    results = runner(train_worker, WORLD, "gloo", timeout=timeout)
    return {name: [r[name] for r in results] for name in results[0]}


def final_loss(results: list[dict]) -> float:
    """Mean training loss of the last LAST steps, over the ranks."""
    return sum(sum(r["losses"][-LAST:]) / LAST for r in results) / len(results)


def pq_elements(metrics: dict, shapes: dict) -> int:
    """Elements of P and Q in one step: (m + n)·r for every compressed matrix."""
    total = 0
    for name, r in metrics["ranks"].items():
        m = shapes[name][0]
        total += (m + math.prod(shapes[name]) // m) * r
    return total


def bf16_byte_ratios(runs: dict) -> list[float]:
    """bytes_sent bf16 / fp32 on every step both compressed at equal ranks (rank 0)."""
    pairs = zip(runs["fp32"][0]["metrics"], runs["bf16"][0]["metrics"])
    return [
        b["bytes_sent"] / a["bytes_sent"]
        for a, b in pairs
        if a["phase"] == b["phase"] == "compress" and a["ranks"] == b["ranks"]
    ]


def wire_ratios(runs: dict) -> tuple[float, float]:
    """fp32 gradients, communication_dtype='bfloat16' against fp32 on the last compressed step both
    ran: P and Q's bytes, and the step's."""
    fp32, wire = runs["fp32"][0], runs["fp32_bf16_wire"][0]
    a, b = [(a, b) for a, b in zip(fp32["metrics"], wire["metrics"]) if a["phase"] == "compress"][-1]
    raw_part = a["bytes_sent"] - 4 * pq_elements(a, fp32["shapes"])
    return (b["bytes_sent"] - raw_part) / (a["bytes_sent"] - raw_part), b["bytes_sent"] / a["bytes_sent"]


def figures(runs: dict) -> dict:
    """What docs/integrations.md shows, from the runs (scripts/producers/mixed_precision.py renders it)."""
    phases = [m["phase"] for m in runs["fp32"][0]["metrics"]]
    ratios = bf16_byte_ratios(runs)
    pq_ratio, step_ratio = wire_ratios(runs)
    return {
        "model": {"layers": LAYERS, "width": WIDTH, "vocab": VOCAB, "seq_len": SEQ},
        "processes": WORLD,
        "steps": STEPS,
        "first_compressed_step": phases.index("compress") + 1,  # counted from 1
        "final_loss_steps": [STEPS - LAST + 1, STEPS],
        "final_loss": {name: final_loss(runs[name]) for name in ("fp32", "bf16", "bf16_ef")},
        "bf16_over_fp32_bytes_sent": {"min": min(ratios), "max": max(ratios), "steps": len(ratios)},
        "bfloat16_wire": {"pq_bytes_ratio": pq_ratio, "step_bytes_ratio": step_ratio},
        "seconds": {name: max(r["seconds"] for r in results) for name, results in runs.items()},
        "torch": torch.__version__,
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m edgc_bench.mixed_precision", description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, help="write the figures as JSON here")
    args = parser.parse_args(argv)
    measured = figures(measure())
    text = json.dumps(measured, indent=1)
    print(text)
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(text + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
