"""EDGC on FSDP2 as HSDP: 4 gloo processes, 2 replicas × 2 shards (`edgc.parallel.fsdp`).

One 4-process run per scenario family keeps the file fast on 2 cores: the worker trains a tiny
model several ways and returns what the tests compare.
"""

import io

import pytest
import torch
import torch.distributed as dist
from distributed_harness import run_distributed
from torch import nn
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

from edgc import AllReduceState, EDGCConfig, EDGCState, LowRankConfig
from edgc.parallel.fsdp import hsdp_mesh, register_fsdp_comm_hook

VOCAB, WIDTH, SEQ = 64, 32, 8
WARMUP_ONLY = dict(r_max=4, total_steps=1000, warmup_fraction=0.5, warmup_error_test=False, adaptive=False)
COMPRESS = dict(
    r_max=4,
    r_min=2,
    rank_step=2,
    window=3,
    total_steps=20,
    warmup_fraction=0.1,
    warmup_error_test=False,
    iteration_sample_ratio=1.0,
    gradient_sample_ratio=0.5,
    rank_mapping="cqm",
    entropy_estimator="gaussian",
    cqm_mc_samples=1,
    engine=LowRankConfig(min_compression_rate=1.0),
)


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.up = nn.Linear(WIDTH, 2 * WIDTH)
        self.down = nn.Linear(2 * WIDTH, WIDTH)

    def forward(self, x):
        return x + self.down(torch.relu(self.up(x)))


class Tiny(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(VOCAB, WIDTH)
        self.blocks = nn.ModuleList([Block(), Block()])
        self.norm = nn.LayerNorm(WIDTH)
        self.head = nn.Linear(WIDTH, VOCAB)
        self.head.weight.data.mul_(0.1)

    def forward(self, tokens):
        x = self.embed(tokens)
        for block in self.blocks:
            x = block(x)
        return self.head(self.norm(x))


def batch(rank, step):
    """A learnable task (target = 3·token + 1 mod VOCAB), different data on every rank and step."""
    generator = torch.Generator().manual_seed(1000 * step + rank)
    tokens = torch.randint(0, VOCAB, (4, SEQ), generator=generator)
    return tokens, (3 * tokens + 1) % VOCAB


def build(mesh, native, config, dtype=torch.float32, mp_policy=None):
    torch.manual_seed(0)
    model = Tiny().to(dtype)
    shard_mesh = mesh if native else mesh["dp_shard"]
    kwargs = {"mesh": shard_mesh, **({"mp_policy": mp_policy} if mp_policy else {})}
    for block in model.blocks:
        fully_shard(block, **kwargs)
    fully_shard(model, **kwargs)
    state = None
    if not native:
        group = mesh.get_group("dp_replicate")
        state = EDGCState(group, EDGCConfig(**config)) if config is not None else AllReduceState(group)
        register_fsdp_comm_hook(model, state)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    return model, state, optimizer


def train(model, state, optimizer, start, stop, log):
    rank = dist.get_rank()
    for step in range(start, stop):
        tokens, targets = batch(rank, step)
        loss = nn.functional.cross_entropy(model(tokens).reshape(-1, VOCAB).float(), targets.reshape(-1))
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        metrics = state.last_step_metrics if state is not None else {}
        log.append((loss.item(), metrics.get("step"), metrics.get("phase"), metrics.get("rank")))


def local_shards(model):
    return torch.cat([p.to_local().detach().reshape(-1).double() for p in model.parameters()])


def replicas_identical(model, mesh):
    """Every rank's shards equal its replica's (gathered over the replicate group), bit for bit."""
    mine = local_shards(model)
    gathered = [torch.empty_like(mine) for _ in range(mesh["dp_replicate"].size())]
    dist.all_gather(gathered, mine, group=mesh.get_group("dp_replicate"))
    return all(torch.equal(g, mine) for g in gathered)


def checkpoint(model, state, optimizer):
    buffer = io.BytesIO()
    torch.save({"model": model.state_dict(), "optim": optimizer.state_dict(), "edgc": state.state_dict()}, buffer)
    return buffer.getvalue()


def restore(blob, model, state, optimizer):
    saved = torch.load(io.BytesIO(blob), weights_only=False)
    model.load_state_dict(saved["model"])
    optimizer.load_state_dict(saved["optim"])
    state.load_state_dict(saved["edgc"])


def training_worker(rank, world_size):
    mesh = hsdp_mesh(2)
    out = {}
    # 1. warm-up: EDGC sends everything raw, which must be native HSDP bit for bit
    native, _, opt = build(mesh, True, None)
    log = []
    train(native, None, opt, 0, 4, log)
    edgc, state, opt = build(mesh, False, WARMUP_ONLY)
    log_edgc = []
    train(edgc, state, opt, 0, 4, log_edgc)
    out["native_warmup"] = local_shards(native)
    out["edgc_warmup"] = local_shards(edgc)
    out["warmup_phases"] = [phase for *_, phase, _ in log_edgc]
    out["warmup_losses"] = ([loss for loss, *_ in log], [loss for loss, *_ in log_edgc])
    # 2. compression, uninterrupted, with a checkpoint after step 7
    model, state, opt = build(mesh, False, COMPRESS)
    log = []
    train(model, state, opt, 0, 8, log)
    blob = checkpoint(model, state, opt)
    train(model, state, opt, 8, 16, log)
    out["log"] = log
    out["final"] = local_shards(model)
    out["replicas_identical"] = replicas_identical(model, mesh)
    out["ef_numel"] = sum(e.numel() for e in state.compressor.error.values())
    out["ef_dtypes"] = {str(e.dtype) for e in state.compressor.error.values()}
    out["shard_numel"] = sum(p.to_local().numel() for p in model.parameters())
    out["sent"], out["raw"] = state.totals["elements_sent"], state.totals["elements_raw"]
    out["state_shapes"] = {k: tuple(v.shape) for k, v in state.compressor.error.items()}
    out["param_shapes"] = {n: tuple(p.to_local().shape) for n, p in model.named_parameters()}
    # 3. resume from the checkpoint in a fresh model, state and optimizer
    model, state, opt = build(mesh, False, COMPRESS)
    restore(blob, model, state, opt)
    log_resumed = []
    train(model, state, opt, 8, 16, log_resumed)
    out["resumed_log"] = log_resumed
    out["resumed"] = local_shards(model)
    return out


def conservation_worker(rank, world_size):
    """float64: Ĝ + mean(e_new) = mean(G + e_old) per shard, over the replicate group."""
    mesh = hsdp_mesh(2)
    group = mesh.get_group("dp_replicate")
    model, state, opt = build(mesh, False, {**COMPRESS, "adaptive": False}, dtype=torch.float64)
    worst = []
    original = state.reduce_tensors

    def checked(names, tensors, *, last, blocking=True):
        if not tensors or state.controller.plan(state.step).rank is None:
            return original(names, tensors, last=last, blocking=blocking)
        before = {
            n: t.detach().clone() + state.compressor.error.get(n, torch.zeros_like(t)).view_as(t)
            for n, t in zip(names, tensors)
        }
        original(names, tensors, last=last)  # blocking: the average is checked right here
        for name, tensor in zip(names, tensors):
            expected = before[name].clone()
            dist.all_reduce(expected, group=group)
            expected /= group.size()
            error = state.compressor.error.get(name, torch.zeros_like(tensor)).view_as(tensor).clone()
            dist.all_reduce(error, group=group)
            error /= group.size()
            worst.append(float((tensor + error - expected).abs().max() / expected.abs().max().clamp_min(1e-30)))

    state.reduce_tensors = checked
    log = []
    train(model, state, opt, 0, 6, log)
    return {
        "worst": max(worst) if worst else None,
        "checked": len(worst),
        "ef": {n: str(e.dtype) for n, e in state.compressor.error.items()},
    }


def bf16_worker(rank, world_size):
    mesh = hsdp_mesh(2)
    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.bfloat16)
    model, state, opt = build(mesh, False, COMPRESS, mp_policy=policy)
    log = []
    train(model, state, opt, 0, 10, log)
    return {
        "log": log,
        "replicas_identical": replicas_identical(model, mesh),
        "ef_dtypes": {str(e.dtype) for e in state.compressor.error.values()},
        "q_dtypes": {str(q.dtype) for q in state.compressor.q.values()},
        "ranks": state.last_step_metrics["ranks"],
    }


@pytest.fixture(scope="module")
def results():
    return run_distributed(training_worker, 4)


def test_warmup_is_native_hsdp_bit_exact(results):
    for r in results:
        assert set(r["warmup_phases"]) == {"warmup"}
        assert torch.equal(r["native_warmup"], r["edgc_warmup"])
        assert r["warmup_losses"][0] == r["warmup_losses"][1]


def test_compressed_training_learns_and_keeps_replicas_identical(results):
    for r in results:
        phases = [phase for _, _, phase, _ in r["log"]]
        assert phases.count("compress") >= 8
        assert [step for _, step, _, _ in r["log"]] == list(range(16))  # one step per backward
        losses = [loss for loss, *_ in r["log"]]
        assert sum(losses[-3:]) / 3 < 0.7 * sum(losses[:3]) / 3
        assert r["replicas_identical"]
        assert r["sent"] < r["raw"]
    # replicas of a shard agree; the two shards differ (different rows)
    assert torch.equal(results[0]["final"], results[2]["final"])
    assert torch.equal(results[1]["final"], results[3]["final"])


def test_error_feedback_is_per_shard_and_small(results):
    for r in results:
        assert r["ef_dtypes"] == {"torch.float32"}
        for name, shape in r["state_shapes"].items():
            local = r["param_shapes"][name]
            assert shape == (local[0], int(torch.tensor(local[1:]).prod())), name
        assert 0 < r["ef_numel"] <= 1.1 * r["shard_numel"]


def test_resume_reproduces_the_uninterrupted_run(results):
    for r in results:
        assert r["resumed_log"] == r["log"][8:]
        assert torch.equal(r["resumed"], r["final"])


def test_error_feedback_conservation_per_shard_float64():
    for r in run_distributed(conservation_worker, 4):
        assert r["checked"] >= 4
        assert r["worst"] < 1e-12


def test_bf16_reduce_dtype_with_fp32_factors():
    for r in run_distributed(bf16_worker, 4):
        assert r["ef_dtypes"] == {"torch.float32"} and r["q_dtypes"] == {"torch.float32"}
        assert any(phase == "compress" for *_, phase, _ in r["log"])
        assert max(r["ranks"].values()) > 0
        assert r["replicas_identical"]


def profiling_worker(rank, world_size):
    """r_max not given: EDGC profiles it on the replicate group and decides; replicas agree."""
    mesh = hsdp_mesh(2)
    config = {
        **COMPRESS,
        "r_max": None,
        "r_min": None,
        "profile_max_rank": 4,
        "profile_steps_per_rank": 1,
        "total_steps": 30,
    }
    model, state, opt = build(mesh, False, config)
    log = []
    train(model, state, opt, 0, 10, log)
    return {
        "phases": [phase for *_, phase, _ in log],
        "r_max": state.controller.r_max,
        "replicas_identical": replicas_identical(model, mesh),
    }


def test_r_max_profiling_on_the_replicate_group():
    results = run_distributed(profiling_worker, 4)
    for r in results:
        # on loopback the profile may find that compression never pays (r_max None, phase off)
        assert "profile" in r["phases"] and r["replicas_identical"]
    assert results[0]["phases"] == results[2]["phases"] and results[0]["r_max"] == results[2]["r_max"]
