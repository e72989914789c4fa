"""The CUDA path on a GPU; without one, a CPU smoke run of the same file (it runs in `make test`).

On a CUDA machine, ``python -m pytest -q tests/gpu`` (docs/gpu.md) checks:
- the engine on CUDA tensors in fp32 and bf16: error feedback conserved (Ĝ + e_after = G + e_before,
  checked in float64, up to Ĝ's rounding to bf16), Ĝ of rank ≤ r, raw tensors sent exactly; the same
  result as on the CPU in fp32;
- the DDP hook on NCCL with one process (NCCL's streams, events and ``Work.wait``) and on gloo with
  two processes sharing the GPU (NCCL cannot put two ranks on one GPU): replicas bit-identical, the
  rank moves, one host read per step, taken when its metrics are read after the optimizer step
  (none inside forward, backward or the optimizer step), no synchronisation from Python code;
- bit-exact parity with native DDP during the warm-up, and exact resume from ``state_dict()``.

Everything runs under ``torch.use_deterministic_algorithms(True)``, and every step after DDP's
one-time bucket rebuild (its first two iterations) under ``torch.cuda.set_sync_debug_mode("error")``:
a host synchronisation outside `edgc.device.timing.host_reads_allowed` (a step being settled, a rank change) raises.
The assertions read device values only after the mode is back to "default". gloo's worker thread
synchronises its CUDA copies by design, which "error" would turn into a failed collective, so the
gloo run uses "warn" and fails on any "called a synchronizing CUDA operation" warning (the text of
c10/cuda's ``warn_or_error_on_sync``) raised from Python code, ours included; torch's own notice that
the debug mode is a prototype is not one.

Without CUDA (or with ``EDGC_TEST_DEVICE=cpu``) the same tests run on the CPU over gloo, in the
suite's process pool, with NCCL's skipped. That keeps this file from rotting; it proves nothing
about the CUDA path. Until a GPU runs the file, these remain unproven:
- that no step synchronises the host outside the allowed points (the debug mode exists on CUDA only;
  tests/core/test_stream_races.py counts them on the CPU, and checks the stream order, on a model
  of CUDA's semantics: `edgc_probes.stream_check`);
- NCCL: ``Work.wait`` making a stream wait, CUDA Futures completing through events, no deadlock;
- bit-identical replicas and exact resume with CUDA kernels in deterministic mode (CPU kernels
  are deterministic anyway), and the library's ops all having a deterministic CUDA kernel;
- cuBLAS/cuSOLVER numerics (bf16 GEMMs, batched QR) agreeing with the CPU's;
- gloo moving CUDA tensors through the host on its own streams.
"""

import contextlib
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

import edgc.device.timing  # noqa: E402
from edgc import EDGCConfig, EDGCState, LowRankCompressor, LowRankConfig, edgc_hook  # noqa: E402
from edgc.distributed.comm import Communicator  # noqa: E402

DEVICE = os.environ.get("EDGC_TEST_DEVICE") or ("cuda" if torch.cuda.is_available() else "cpu")
CUDA = DEVICE == "cuda"
pytestmark = pytest.mark.skipif(CUDA and not torch.cuda.is_available(), reason="EDGC_TEST_DEVICE=cuda needs a GPU")
# CUDA workers need processes of their own; on the CPU the suite's gloo pool is enough (and fast).
FRESH = CUDA

SYNC_WARNING = "called a synchronizing CUDA operation"
ADAPTIVE = dict(
    r_max=8,
    r_min=2,
    rank_step=2,
    window=3,
    total_steps=24,
    warmup_fraction=0.1,
    warmup_error_test=False,
    iteration_sample_ratio=1.0,
    gradient_sample_ratio=0.5,
    rank_mapping="cqm",
    entropy_estimator="gaussian",
    cqm_mc_samples=1,
    entropy_significance=0.0,
    engine=LowRankConfig(min_compression_rate=1.0),
)
SETTLE_STEPS = 2  # DDP rebuilds its buckets after the first iteration (with host reads of its own)
STEPS = 14


@contextlib.contextmanager
def strict_sync(mode: str = "error"):
    """Any host synchronisation inside raises ("error") or warns ("warn"); no-op on the CPU.
    Read device values only after leaving it."""
    if CUDA:
        torch.cuda.set_sync_debug_mode(mode)
    try:
        yield
    finally:
        if CUDA:
            torch.cuda.set_sync_debug_mode("default")


@contextlib.contextmanager
def deterministic():
    """Deterministic kernels (cuBLAS needs its workspace setting); put back as found, since the
    CPU smoke run shares its processes with other tests."""
    enabled, workspace = torch.are_deterministic_algorithms_enabled(), os.environ.get("CUBLAS_WORKSPACE_CONFIG")
    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    torch.use_deterministic_algorithms(True)
    try:
        yield
    finally:
        torch.use_deterministic_algorithms(enabled)
        if workspace is None:
            os.environ.pop("CUBLAS_WORKSPACE_CONFIG", None)


class TinyGPT(nn.Module):
    """Embedding, 2 pre-norm blocks (plain matmul attention: deterministic backward), LM head."""

    def __init__(self, vocab: int = 256, width: int = 128, layers: int = 2, heads: int = 4, seq_len: int = 16):
        super().__init__()
        self.heads = heads
        self.embed = nn.Embedding(vocab, width)
        self.position = nn.Parameter(torch.zeros(seq_len, width))
        self.blocks = nn.ModuleList(
            nn.ModuleDict(
                {
                    "norm1": nn.LayerNorm(width),
                    "qkv": nn.Linear(width, 3 * width),
                    "proj": nn.Linear(width, width),
                    "norm2": nn.LayerNorm(width),
                    "up": nn.Linear(width, 4 * width),
                    "down": nn.Linear(4 * width, width),
                }
            )
            for _ in range(layers)
        )
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
    tokens = edgc.device.timing.to_device(torch.randint(0, vocab, (size, seq_len + 1), generator=generator), device)
    return tokens[:, :-1], tokens[:, 1:]


def flat_parameters(model) -> torch.Tensor:
    return torch.cat([p.detach().reshape(-1) for p in model.parameters()]).cpu()


# ---------------------------------------------------------------------------- the engine alone
def error_feedback(compressor: LowRankCompressor) -> dict[str, torch.Tensor]:
    """This rank's residuals, on the host (a synchronisation: call outside `strict_sync`)."""
    return {name: e.double() for name, e in compressor.state_dict()["error"].items()}


SHAPES = {"a": (256, 512), "b": (256, 512), "conv": (64, 3, 3, 3), "bias": (512,), "d": (1024, 96)}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_engine_conserves_error_feedback(dtype):
    torch.manual_seed(0)
    rank = 8
    compressor = LowRankCompressor(EDGCConfig(r_max=rank, engine=LowRankConfig(min_compression_rate=1.0)))
    before = {}
    for step in range(3):
        grads = [torch.randn(shape, device=DEVICE).to(dtype) for shape in SHAPES.values()]
        sent = [g.clone() for g in grads]
        with strict_sync():
            stats = compressor.reduce(list(SHAPES), grads, rank, Communicator(None))
        after = error_feedback(compressor)
        for name, g, applied in zip(SHAPES, sent, grads):
            assert applied.dtype == dtype and applied.device.type == torch.device(DEVICE).type
            matrix = g.cpu().double() + before.get(name, torch.zeros(g.shape)).view(g.shape)
            result = applied.cpu().double() + after.get(name, torch.zeros(g.shape)).view(g.shape)
            assert torch.isfinite(result).all(), (step, name)
            # Nothing is lost: what was applied plus the residual is M = G + e, to fp32 rounding and,
            # for a compressed bf16 gradient, Ĝ's own rounding to bf16 (at most half its last place,
            # 2⁻⁹ of each value): e = M − P·Qᵀ is the product's residual, as an uncompressed bf16
            # all-reduce rounds its sum.
            rounding = 2.0**-9 * applied.cpu().double().norm() if dtype == torch.bfloat16 and stats.ranks[name] else 0
            assert (result - matrix).norm() <= 1e-6 * matrix.norm() + rounding, (step, name)
            if stats.ranks[name]:
                # rtol above bf16's rounding of Ĝ, far below a random matrix's (r+1)-th singular value
                assert torch.linalg.matrix_rank(applied.cpu().double().reshape(g.shape[0], -1), rtol=1e-2) <= rank
                assert after[name].norm() > 1e-3 * matrix.norm(), (step, name)  # compressed, not sent whole
            else:
                assert torch.equal(applied.cpu().double(), matrix.to(dtype).double()), (step, name)
        assert {name for name, r in stats.ranks.items() if r} == {"a", "b", "conv", "d"}
        before = after


def test_engine_matches_the_cpu_in_fp32():
    torch.manual_seed(1)
    grads = [torch.randn(384, 640), torch.randn(640, 384), torch.randn(128)]
    names = ["w1", "w2", "b"]
    results = []
    for device in ("cpu", DEVICE):
        compressor = LowRankCompressor(EDGCConfig(r_max=16, engine=LowRankConfig(min_compression_rate=1.0)))
        moved = [g.clone().to(device) for g in grads]
        with strict_sync() if device == DEVICE else contextlib.nullcontext():
            for _ in range(2):  # a second step exercises the warm start and the error feedback
                compressor.reduce(names, moved, 16, Communicator(None))
        results.append([g.cpu() for g in moved])
    for cpu, device in zip(*results):
        assert (cpu - device).norm() <= 1e-4 * cpu.norm()
    assert not torch.equal(results[0][0], grads[0])  # compressed: the check compares Ĝ, not G


# ---------------------------------------------------------------------------- the DDP hook
def _device() -> torch.device:
    if not CUDA:
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


@contextlib.contextmanager
def counted_host_reads():
    """Counts calls of `edgc.device.timing.to_host` (the library's device→host reads) into ``counter[0]``."""
    real, counter = edgc.device.timing.to_host, [0]

    def counting(tensor):
        counter[0] += 1
        return real(tensor)

    edgc.device.timing.to_host = counting
    try:
        yield counter
    finally:
        edgc.device.timing.to_host = real


def _train(rank, device, ddp, state, optimizer, start, stop, debug_mode):
    """Steps ``start``..``stop``, after DDP's first SETTLE_STEPS under the sync-debug mode. Returns the
    (step, phase, rank) log, host reads per step as (during the step, including its metrics read
    after the optimizer step), and the synchronisation warnings raised from Python."""
    log, reads = [], []
    with counted_host_reads() as counter, warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for step in range(start, stop):
            counter[0] = 0
            tokens, targets = batch(rank, step, device)
            with strict_sync(debug_mode) if step - start >= SETTLE_STEPS else contextlib.nullcontext():
                logits = ddp(tokens)
                loss = nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))
                optimizer.zero_grad(set_to_none=False)
                loss.backward()
                optimizer.step()
            during = counter[0]
            if state is not None:
                metrics = state.last_step_metrics  # settles the step: its one read, after the optimizer step
                log.append((metrics["step"], metrics["phase"], metrics["rank"]))
            reads.append((during, counter[0]))
    synced = [str(w.message) for w in caught if SYNC_WARNING in str(w.message)]
    return log, reads, synced


def ddp_worker(rank, world_size, backend, config_kwargs, steps):
    with deterministic():
        device = _device()
        model, ddp, state, optimizer = _build(device, config_kwargs)
        log, reads, synced = _train(
            rank, device, ddp, state, optimizer, 0, steps, "error" if backend == "nccl" else "warn"
        )
        return {
            "params": flat_parameters(model),
            "log": log,
            "reads": reads,
            "synced": synced,
            "sent": state.totals["bytes_sent"],
            "raw": state.totals["bytes_raw"],
        }


def _run(worker, world_size, backend, *args):
    if backend == "nccl" and not CUDA:
        pytest.skip("NCCL needs CUDA")
    return run_distributed(worker, world_size, backend, *args, backend=backend, timeout=300, fresh=FRESH)


@pytest.mark.parametrize("backend,world_size", [("nccl", 1), ("gloo", 2)])
def test_ddp_hook(backend, world_size):
    results = _run(ddp_worker, world_size, backend, ADAPTIVE, STEPS)
    reference = results[0]
    compressed = [r for _, phase, r in reference["log"] if phase == "compress"]
    assert len(set(compressed)) >= 2, reference["log"]  # compressed, and the rank moved
    assert reference["sent"] < reference["raw"]
    for result in results:
        assert result["synced"] == [], result["synced"][:3]  # no synchronisation from Python code
        # One host read per step, every step sampled here: its totals, the entropy sampler's estimate and
        # finite count among them, taken when its metrics are read after the optimizer step: none
        # inside forward, backward or the optimizer step, so none waits for the step's own work.
        assert result["reads"][SETTLE_STEPS:] == [(0, 1)] * (STEPS - SETTLE_STEPS), result["reads"]
    for other in results[1:]:
        assert torch.equal(other["params"], reference["params"])  # identical replicas
        assert other["log"] == reference["log"]


def parity_worker(rank, world_size, backend, steps):
    """The same steps with EDGC in its warm-up and with DDP's own all-reduce."""
    warmup_only = dict(r_max=4, total_steps=10, warmup_fraction=1.0, warmup_error_test=True)
    with deterministic():
        device = _device()
        runs = {}
        for name, config in (("edgc", warmup_only), ("native", None)):
            model, ddp, state, optimizer = _build(device, config)
            log, _, _ = _train(rank, device, ddp, state, optimizer, 0, steps, "error" if backend == "nccl" else "warn")
            runs[name] = (flat_parameters(model), log)
        return runs


@pytest.mark.parametrize("backend,world_size", [("nccl", 1), ("gloo", 2)])
def test_warmup_equals_native_ddp(backend, world_size):
    for runs in _run(parity_worker, world_size, backend, 5):
        assert [phase for _, phase, _ in runs["edgc"][1]] == ["warmup"] * 5
        assert torch.equal(runs["edgc"][0], runs["native"][0])  # bit-exact


def resume_worker(rank, world_size, backend, split, total):
    debug_mode = "error" if backend == "nccl" else "warn"
    with deterministic():
        device = _device()
        model, ddp, state, optimizer = _build(device, ADAPTIVE)
        _train(rank, device, ddp, state, optimizer, 0, total, debug_mode)
        uninterrupted = flat_parameters(model)

        model, ddp, state, optimizer = _build(device, ADAPTIVE)
        _train(rank, device, ddp, state, optimizer, 0, split, debug_mode)
        buffer = io.BytesIO()
        torch.save(
            {"model": model.state_dict(), "optimizer": optimizer.state_dict(), "edgc": state.state_dict()}, buffer
        )
        buffer.seek(0)
        checkpoint = torch.load(buffer, weights_only=True)
        model, ddp, state, optimizer = _build(device, ADAPTIVE, seed=123)
        model.load_state_dict(checkpoint["model"])
        optimizer.load_state_dict(checkpoint["optimizer"])
        state.load_state_dict(checkpoint["edgc"])
        log, _, synced = _train(rank, device, ddp, state, optimizer, split, total, debug_mode)
        return uninterrupted, flat_parameters(model), log, synced


def test_resume_is_exact():
    backend = "nccl" if CUDA else "gloo"
    ((uninterrupted, resumed, log, synced),) = _run(resume_worker, 1, backend, 7, 13)
    assert len({r for _, phase, r in log if phase == "compress"}) >= 2  # resumed across a rank change
    assert torch.equal(uninterrupted, resumed)
    assert synced == []
