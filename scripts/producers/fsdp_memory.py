"""Memory per rank of HSDP + EDGC vs native HSDP (FSDP2 on a 2-D mesh), 4 gloo processes, CPU.

    PYTHONPATH=src OMP_NUM_THREADS=1 python scripts/to_docs.py fsdp-memory [--preset tiny] [--steps 8]

Each variant runs in fresh processes (2 replicas × 2 shards) on the GPT-2 harness model with random
tokens. Per rank it reports: the peak resident set size (``ru_maxrss``: the whole process, torch
included, so only the difference between the variants means something), the gradient shard
(this rank's ``p.grad`` local tensors), the optimizer state and EDGC's error feedback and Q factors.
Prints a Markdown table; with ``--doc docs/guides/fsdp.md`` also writes it between
``<!-- fsdp-memory:start -->`` and ``<!-- fsdp-memory:end -->`` there.
"""

from __future__ import annotations

import argparse
import os
import resource
import sys
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F
from doc_blocks import ROOT, write

sys.path.insert(0, str(ROOT / "tests" / "core"))  # the suite's process launcher, timeouts and all
from distributed_harness import run_distributed  # noqa: E402


def nbytes(tensors) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


def local(t):
    return t.to_local() if hasattr(t, "to_local") else t


def worker(rank, world, variant, preset, steps, vocab, seq_len, batch):
    from torch.distributed.fsdp import fully_shard

    from edgc import EDGCConfig, EDGCState
    from edgc.parallel.fsdp import hsdp_mesh, register_fsdp_comm_hook
    from edgc_train.model import build_model, model_shape

    mesh = hsdp_mesh(2)
    torch.manual_seed(0)
    model = build_model(model_shape(preset, vocab, seq_len))
    shard_mesh = mesh if variant == "native" else mesh["dp_shard"]
    for block in model.transformer.h:
        fully_shard(block, mesh=shard_mesh)
    fully_shard(model, mesh=shard_mesh)
    state = None
    if variant == "edgc":
        state = EDGCState(
            mesh["dp_replicate"],
            EDGCConfig(r_max=8, total_steps=steps, warmup_fraction=0.1, warmup_error_test=False, window=4),
        )
        register_fsdp_comm_hook(model, state)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    generator = torch.Generator().manual_seed(rank)
    for _ in range(steps):
        tokens = torch.randint(0, vocab, (batch, seq_len + 1), generator=generator)
        logits = model(input_ids=tokens[:, :-1]).logits
        F.cross_entropy(logits.flatten(0, 1), tokens[:, 1:].flatten()).backward()
        grads = [local(p.grad) for p in model.parameters()]
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    optimizer_state = [local(v) for s in optimizer.state.values() for v in s.values() if torch.is_tensor(v)]
    out = {
        "peak_rss": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
        "grad_shard": nbytes(grads),
        "params_local": nbytes(local(p) for p in model.parameters()),
        "optimizer": nbytes(optimizer_state),
        "ef": nbytes(state.compressor.error.values()) if state else 0,
        "q": nbytes(state.compressor.q.values()) if state else 0,
        "phase": state.last_step_metrics["phase"] if state else "native",
    }
    dist.barrier()
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="to_docs.py fsdp-memory", description=__doc__.splitlines()[0])
    parser.add_argument("--preset", default="tiny")
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--vocab", type=int, default=4096)
    parser.add_argument("--seq-len", type=int, default=128)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument(
        "--doc", type=Path, help="also write the table into this page's fsdp-memory block (docs/guides/fsdp.md)"
    )
    args = parser.parse_args(argv)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    results = {
        v: run_distributed(worker, 4, v, args.preset, args.steps, args.vocab, args.seq_len, args.batch, timeout=600)
        for v in ("native", "edgc")
    }
    text = render(results, args)
    print(text)
    if args.doc:
        write("fsdp-memory", text, args.doc)
    assert all(e["phase"] == "compress" for e in results["edgc"])


def render(results: dict, args) -> str:
    """The table and the sentence under it, from the measurements alone."""
    mib = 2**20
    lines = [
        f"`PYTHONPATH=src OMP_NUM_THREADS=1 python scripts/to_docs.py fsdp-memory --preset {args.preset} --steps "
        f"{args.steps}`: "
        f"GPT-2 {args.preset}, vocab {args.vocab}, 2 replicas × 2 shards, {args.steps} steps, "
        f"batch {args.batch}×{args.seq_len} per rank (CPU, gloo)",
        "",
        "| rank | peak RSS native HSDP (MiB) | peak RSS HSDP + EDGC (MiB) | difference (MiB) | "
        "gradient shard (MiB) | EF (MiB) | EF / gradient shard | Q (MiB) | optimizer state (MiB) |",
        "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for rank, (n, e) in enumerate(zip(results["native"], results["edgc"])):
        lines.append(
            f"| {rank} | {n['peak_rss'] / mib:.1f} | {e['peak_rss'] / mib:.1f} | "
            f"{(e['peak_rss'] - n['peak_rss']) / mib:+.1f} | {e['grad_shard'] / mib:.2f} | {e['ef'] / mib:.2f} | "
            f"{e['ef'] / e['grad_shard']:.3f} | {e['q'] / mib:.3f} | {e['optimizer'] / mib:.2f} |"
        )
    ratios = [e["ef"] / e["grad_shard"] for e in results["edgc"]]
    extra = [(e["peak_rss"] - n["peak_rss"]) / mib for n, e in zip(results["native"], results["edgc"])]
    lines += [
        "",
        f"EF per rank is {min(ratios):.3f}–{max(ratios):.3f}× this rank's gradient shard; the extra peak "
        f"is {min(extra):+.1f} to {max(extra):+.1f} MiB.",
    ]
    return "\n".join(lines)
