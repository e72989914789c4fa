"""The CUDA path on a real GPU (skipped where there is none; CI has none).

Run on a CUDA machine with ``python -m pytest -q tests/gpu`` (docs/gpu.md). What they hold:
- the engine on CUDA tensors, fp32 and bf16: error feedback conserved (Ĝ + e = M in float64), the
  same result as on the CPU;
- the DDP hook on NCCL with one process (NCCL's streams, events and ``Work.wait``) and on gloo with
  two processes sharing the GPU (NCCL cannot put two ranks on one GPU): replicas bit-identical, the
  rank moves, exactly one host read per step, parity with native DDP during warm-up;
- exact resume from ``state_dict()`` on CUDA.

Every step after DDP's one-time bucket rebuild (its first two iterations) runs under
``torch.cuda.set_sync_debug_mode("error")``: any host synchronisation outside
`edgc.timing.host_reads_allowed` (a step's end, a rank change) raises. gloo's own worker thread
synchronises its CUDA copies by design, which that mode would turn into a failed collective, so
the gloo run uses mode "warn" and fails on any warning raised from Python code (ours).
"""
import io
import os
import sys
import warnings
from pathlib import Path

import pytest
import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "core"))  # distributed_harness

from distributed_harness import run_distributed  # noqa: E402

import edgc.timing  # noqa: E402
from edgc import EDGCConfig, EDGCState, LowRankCompressor, edgc_hook  # noqa: E402
from edgc.comm import Communicator  # noqa: E402

DEVICE = os.environ.get("EDGC_TEST_DEVICE", "cuda")  # "cpu" only to smoke-test this file without a GPU
pytestmark = pytest.mark.skipif(DEVICE == "cuda" and not torch.cuda.is_available(), reason="needs a CUDA GPU")

ADAPTIVE = dict(r_max=8, r_min=2, rank_step=2, window=3, total_steps=24, warmup_fraction=0.1,
                warmup_error_test=False, iteration_sample_ratio=1.0, gradient_sample_ratio=0.5,
                min_compression_rate=1.0, rank_mapping="cqm", entropy_estimator="gaussian", cqm_mc_samples=1,
                entropy_significance=0.0)
SETTLE_STEPS = 2  # DDP rebuilds its buckets after the first iteration (with host reads of its own)


def sync_debug(mode: str):
    if DEVICE == "cuda":
        torch.cuda.set_sync_debug_mode(mode)


class TinyGPT(nn.Module):
    """Embedding, 2 pre-norm blocks (plain matmul attention: deterministic backward), LM head."""

    def __init__(self, vocab: int = 256, width: int = 128, layers: int = 2, heads: int = 4, seq_len: int = 16):
        super().__init__()
        self.heads = heads
        self.embed = nn.Embedding(vocab, width)
        self.position = nn.Parameter(torch.zeros(seq_len, width))
        self.blocks = nn.ModuleList(nn.ModuleDict({
            "norm1": nn.LayerNorm(width), "qkv": nn.Linear(width, 3 * width), "proj": nn.Linear(width, width),
            "norm2": nn.LayerNorm(width), "up": nn.Linear(width, 4 * width), "down": nn.Linear(4 * width, width),
        }) for _ in range(layers))
        self.head = nn.Linear(width, vocab)
        self.register_buffer("mask", torch.ones(seq_len, seq_len).tril().bool(), persistent=False)

    def forward(self, tokens):
        x = self.embed(tokens) + self.position[: tokens.shape[1]]
        b, t, w = x.shape
        for block in self.blocks:
            q, k, v = block["qkv"](block["norm1"](x)).view(b, t, 3, self.heads, -1).permute(2, 0, 3, 1, 4)
            scores = (q @ k.transpose(-1, -2)) / (q.shape[-1] ** 0.5)
            scores = scores.masked_fill(~self.mask[:t, :t], float("-inf"))
            x = x + block["proj"]((scores.softmax(-1) @ v).transpose(1, 2).reshape(b, t, w))
            x = x + block["down"](nn.functional.gelu(block["up"](block["norm2"](x))))
        return self.head(x)


def batch(rank: int, step: int, device, vocab: int = 256, size: int = 4, seq_len: int = 16):
    generator = torch.Generator().manual_seed(1000 * step + rank)
    tokens = edgc.timing.to_device(torch.randint(0, vocab, (size, seq_len + 1), generator=generator), device)
    return tokens[:, :-1], tokens[:, 1:]


def flat_parameters(model) -> torch.Tensor:
    return torch.cat([p.detach().reshape(-1) for p in model.parameters()]).cpu()


def deterministic() -> None:
    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    torch.use_deterministic_algorithms(True)


# ---------------------------------------------------------------------------- the engine alone
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_engine_conserves_error_feedback_on_cuda(dtype):
    torch.manual_seed(0)
    shapes = {"a": (256, 512), "b": (256, 512), "c": (64, 3, 3, 3), "bias": (512,), "d": (1024, 96)}
    compressor = LowRankCompressor(EDGCConfig(r_max=8, min_compression_rate=1.0))
    comm = Communicator(None)
    sync_debug("error")
    try:
        for step in range(3):
            grads = [torch.randn(shape, device=DEVICE).to(dtype) for shape in shapes.values()]
            before = {name: compressor.error.get(name) for name in shapes}
            m = [g.double() + (before[name].double().view_as(g) if before[name] is not None else 0)
                 for name, g in zip(shapes, grads)]
            compressor.reduce(list(shapes), grads, 8, comm)
            for name, g, matrix in zip(shapes, grads, m):
                error = compressor.error.get(name)
                sent = g.double() + (error.double().view_as(g) if error is not None else 0)
                # The residual is M minus exactly what was applied (Ĝ in the gradient's dtype).
                assert (sent - matrix).norm() <= 1e-6 * matrix.norm(), (step, name)
                assert g.dtype == dtype and g.device.type == torch.device(DEVICE).type
    finally:
        sync_debug("default")


def test_engine_matches_the_cpu_in_fp32():
    torch.manual_seed(1)
    grads = [torch.randn(384, 640), torch.randn(640, 384), torch.randn(128)]
    names = ["w1", "w2", "b"]
    results = []
    for device in ("cpu", DEVICE):
        compressor = LowRankCompressor(EDGCConfig(r_max=16, min_compression_rate=1.0))
        moved = [g.clone().to(device) for g in grads]
        for _ in range(2):  # a second step exercises the warm start and the error feedback
            compressor.reduce(names, moved, 16, Communicator(None))
        results.append([g.cpu() for g in moved])
    for cpu, device in zip(*results):
        assert (cpu - device).norm() <= 1e-4 * cpu.norm()


# ---------------------------------------------------------------------------- the DDP hook
def _device(rank: int, backend: str) -> torch.device:
    if DEVICE != "cuda":
        return torch.device("cpu")
    torch.cuda.set_device(0)  # one GPU: every rank uses it (gloo moves CUDA tensors through the host)
    return torch.device("cuda", 0)


def _build(device, config_kwargs, seed=0):
    torch.manual_seed(seed)
    model = TinyGPT().to(device)
    ddp = DDP(model, device_ids=[device.index] if device.type == "cuda" else None, bucket_cap_mb=0.25)
    state = None
    if config_kwargs is not None:
        state = EDGCState(None, EDGCConfig(**config_kwargs), model=ddp)
        ddp.register_comm_hook(state, edgc_hook)
    optimizer = torch.optim.SGD(ddp.parameters(), lr=0.05, momentum=0.9)
    return model, ddp, state, optimizer


def _train(rank, device, model, ddp, state, optimizer, start, stop, debug_mode):
    """Steps ``start``..``stop``; after this DDP's first SETTLE_STEPS under the sync-debug mode. Returns the log,
    host reads per step and the messages of synchronisations raised from Python (mode "warn")."""
    log, reads, synced = [], [], []
    real_to_host = edgc.timing.to_host
    counter = [0]

    def counting_to_host(tensor):
        counter[0] += 1
        return real_to_host(tensor)

    edgc.timing.to_host = counting_to_host
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            for step in range(start, stop):
                if step - start >= SETTLE_STEPS:
                    sync_debug(debug_mode)
                counter[0] = 0
                tokens, targets = batch(rank, step, device)
                logits = ddp(tokens)
                loss = nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))
                optimizer.zero_grad(set_to_none=False)
                loss.backward()
                optimizer.step()
                sync_debug("default")
                reads.append(counter[0])
                if state is not None:
                    metrics = state.last_step_metrics
                    log.append((metrics["step"], metrics["phase"], metrics["rank"]))
        synced = [str(w.message) for w in caught if "synchroniz" in str(w.message).lower()]
    finally:
        edgc.timing.to_host = real_to_host
        sync_debug("default")
    return log, reads, synced


def ddp_worker(rank, world_size, backend, config_kwargs, steps):
    deterministic()
    device = _device(rank, backend)
    mode = "error" if backend == "nccl" else "warn"
    model, ddp, state, optimizer = _build(device, config_kwargs)
    log, reads, synced = _train(rank, device, model, ddp, state, optimizer, 0, steps, mode)
    return {"params": flat_parameters(model), "log": log, "reads": reads, "synced": synced,
            "sent": state.totals["bytes_sent"] if state else None, "raw": state.totals["bytes_raw"] if state else None}


@pytest.mark.parametrize("backend,world_size", [("nccl", 1), ("gloo", 2)])
def test_ddp_hook_on_cuda(backend, world_size):
    if DEVICE != "cuda" and backend == "nccl":
        pytest.skip("NCCL needs CUDA")
    results = run_distributed(ddp_worker, world_size, backend, ADAPTIVE, 14, backend=backend, timeout=300, fresh=True)
    reference = results[0]
    assert any(phase == "compress" for _, phase, _ in reference["log"])
    assert len({r for _, phase, r in reference["log"] if phase == "compress"}) >= 2, "the rank should move"
    assert reference["sent"] < reference["raw"]
    for result in results:
        assert result["synced"] == [], result["synced"][:3]  # no synchronisation from our Python code
        assert result["reads"][SETTLE_STEPS:] == [1] * (14 - SETTLE_STEPS), result["reads"]  # one host read per step
    for other in results[1:]:
        assert torch.equal(other["params"], reference["params"])
        assert other["log"] == reference["log"]


@pytest.mark.parametrize("backend,world_size", [("nccl", 1), ("gloo", 2)])
def test_warmup_equals_native_ddp_on_cuda(backend, world_size):
    if DEVICE != "cuda" and backend == "nccl":
        pytest.skip("NCCL needs CUDA")
    warmup_only = dict(r_max=4, total_steps=10, warmup_fraction=1.0, warmup_error_test=True)
    hooked = run_distributed(ddp_worker, world_size, backend, warmup_only, 5, backend=backend, timeout=300, fresh=True)
    native = run_distributed(ddp_worker, world_size, backend, None, 5, backend=backend, timeout=300, fresh=True)
    assert all(phase == "warmup" for _, phase, _ in hooked[0]["log"])
    for ours, theirs in zip(hooked, native):
        assert torch.equal(ours["params"], theirs["params"])


def resume_worker(rank, world_size, backend, split, total):
    deterministic()
    device = _device(rank, backend)
    model, ddp, state, optimizer = _build(device, ADAPTIVE)
    _train(rank, device, model, ddp, state, optimizer, 0, total, "error")
    uninterrupted = flat_parameters(model)

    model, ddp, state, optimizer = _build(device, ADAPTIVE)
    _train(rank, device, model, ddp, state, optimizer, 0, split, "error")
    buffer = io.BytesIO()
    torch.save({"model": model.state_dict(), "optimizer": optimizer.state_dict(), "edgc": state.state_dict()}, buffer)
    buffer.seek(0)
    checkpoint = torch.load(buffer, weights_only=True)
    model, ddp, state, optimizer = _build(device, ADAPTIVE, seed=123)
    model.load_state_dict(checkpoint["model"])
    optimizer.load_state_dict(checkpoint["optimizer"])
    state.load_state_dict(checkpoint["edgc"])
    log, _, _ = _train(rank, device, model, ddp, state, optimizer, split, total, "error")
    return uninterrupted, flat_parameters(model), log


def test_resume_is_exact_on_cuda():
    backend = "nccl" if DEVICE == "cuda" else "gloo"
    (uninterrupted, resumed, log), = run_distributed(resume_worker, 1, backend, 7, 13, backend=backend, timeout=300, fresh=True)
    assert len({r for _, phase, r in log if phase == "compress"}) >= 2  # resumed across a rank change
    assert torch.equal(uninterrupted, resumed)
