"""The pure pieces of the cost model against closed forms and independent counts."""

import math
import time

import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode

from edgc_sim import cost_model as cm
from edgc_sim.cost_model import AlphaBeta


def test_ring_allreduce_alpha_beta():
    link = AlphaBeta(1e-5, 1e9)
    # 2(n-1) steps of alpha, and each rank sends and receives 2(n-1)/n of the buffer
    assert cm.ring_allreduce_time(4, 1e6, link) == pytest.approx(6e-5 + 1.5e-3)
    assert cm.ring_allreduce_time(2, 1e6, link) == pytest.approx(2e-5 + 1e-3)
    assert cm.ring_allreduce_time(1, 1e6, link) == 0.0
    assert cm.ring_reduce_scatter_time(4, 1e6, link) == pytest.approx(3e-5 + 0.75e-3)


def test_hierarchical_allreduce():
    intra, inter = AlphaBeta(1e-6, 1e11), AlphaBeta(1e-5, 1e9)
    n = 8e6
    assert cm.hierarchical_allreduce_time(1, 4, n, intra, inter) == cm.ring_allreduce_time(4, n, intra)
    assert cm.hierarchical_allreduce_time(4, 1, n, intra, inter) == cm.ring_allreduce_time(4, n, inter)
    expected = 2 * cm.ring_reduce_scatter_time(2, n, intra) + cm.ring_allreduce_time(4, n / 2, inter)
    assert cm.hierarchical_allreduce_time(4, 2, n, intra, inter) == pytest.approx(expected)
    # two members per node halve the inter-node payload, so it beats a flat ring over the slow link
    assert expected < cm.ring_allreduce_time(8, n, inter)


@pytest.mark.parametrize("P,m", [(4, 8), (4, 4), (2, 16), (8, 3), (1, 5)])
def test_1f1b_bubble_fraction(P, m):
    assert cm.bubble_fraction(P, m) == pytest.approx((P - 1) / (m + P - 1))
    tf, tb = 1.0, 2.0
    tl = cm.one_f_one_b_timeline([tf] * P, [tb] * P, m)
    makespan = max(tl.flush_end)
    assert makespan == pytest.approx((m + P - 1) * (tf + tb))
    idle = 1 - m * (tf + tb) / makespan
    assert idle == pytest.approx(cm.bubble_fraction(P, m))
    # stage p finishes its last backward p * t_b before stage 0: the slack DAC spends
    for p in range(P):
        assert tl.flush_end[0] - tl.flush_end[p] == pytest.approx(p * tb)


def test_1f1b_respects_dependencies_and_order():
    P, m = 3, 5
    tl = cm.one_f_one_b_timeline([1.0, 1.5, 1.2], [2.0, 3.0, 2.5], m, p2p_s=[0.1, 0.2])
    for p in range(P):
        for i in range(m):
            if p:
                assert tl.fwd_start[p][i] >= tl.fwd_end[p - 1][i] + [0.1, 0.2][p - 1] - 1e-12
            if p < P - 1:
                assert tl.bwd_start[p][i] >= tl.bwd_end[p + 1][i] + [0.1, 0.2][p] - 1e-12
    order = cm.one_f_one_b_order(0, 4, 8)
    assert order[:4] == [("F", 0), ("F", 1), ("F", 2), ("F", 3)] and order[4] == ("B", 0)
    assert len(order) == 16 and order[-3:] == [("B", 5), ("B", 6), ("B", 7)]


def test_powersgd_bytes_vs_raw():
    # the paper's worked example (§3.2): a 1920x1920 shard at r=32 sends 122,880 values instead of 3,686,400
    p, q = cm.powersgd_values([(1920, 1920)], 32)
    assert p + q == 32 * (1920 + 1920) == 122_880
    assert 1920 * 1920 / (p + q) == pytest.approx(30)
    p, q = cm.powersgd_values([(1440, 1920), (1920, 480)], 16)
    assert (p, q) == (16 * (1440 + 1920), 16 * (1920 + 480))
    # the rank is clipped to min(m, n): a thin matrix never costs more than sending it raw
    assert sum(cm.powersgd_values([(1024, 3)], 64)) == 3 * (1024 + 3)
    assert cm.powersgd_matmul_flops([(100, 50)], 8) == 6 * 100 * 50 * 8


def test_powersgd_compute_grows_with_rank():
    shapes = [(1920, 1920)] * 4
    t = [cm.powersgd_compute_time(shapes, r, 1e13, 9e11, 5e-6, 4) for r in (4, 16, 64)]
    assert t[0] < t[1] < t[2]
    # launch-bound orthogonalisation: r columns x kernels per column x launch time, at least
    assert cm.orthogonalize_time(10, 64, 1e15, 5e-6, 4) >= 64 * cm.GS_KERNELS_PER_COLUMN * 5e-6


def test_torch_hook_cost_counted_from_its_source():
    shapes, vectors, r = [(512, 2048), (2048, 512)], 10_000, 8
    flops, mem, launch, alloc, bpv = 5e10, 1e10, 5e-6, 1 / 3e9, 4
    values = sum(m * n for m, n in shapes) + vectors
    torch_hook = cm.torch_powersgd_hook_time(shapes, values, r, flops, mem, launch, alloc, bpv)
    matmuls = sum(3 * 2 * m * n * r for m, n in shapes) / flops
    orth = sum(cm.orthogonalize_time(k, r, mem, launch, bpv) for m, n in shapes for k in (m, n))  # P and Q
    passes = 9 * values * bpv / mem  # over the whole bucket, vectors included
    assert torch_hook == pytest.approx(matmuls + orth + passes + 2 * values * bpv * alloc)
    # first touch not measured: free
    assert cm.torch_powersgd_hook_time(shapes, values, r, flops, mem, launch, 0.0, bpv) < torch_hook
    # its own measured GEMM rate (bmm(M, Q) etc.) replaces the square-matmul rate for the matmuls only
    slow = cm.torch_powersgd_hook_time(shapes, values, r, flops, mem, launch, alloc, bpv, flops / 4)
    assert slow == pytest.approx(torch_hook + 3 * matmuls)


def test_paper_reducer_closed_form():
    """Without our engine's rates (the paper's presets): the paper's reducer, FLOP-bound matmuls,
    Gram-Schmidt of P only, 7 passes."""
    flops, mem, launch, bpv = 4e10, 2e10, 1e-5, 4
    m, n = 512, 2048
    for r in (2, 8):
        plain = cm.powersgd_compute_time([(m, n)], r, flops, mem, launch, bpv)
        assert plain == pytest.approx(
            6 * m * n * r / flops + cm.orthogonalize_time(m, r, mem, launch, bpv) + 7 * m * n * bpv / mem
        )


def test_gpt2_layer_flops_explicit_count():
    b, s, h = 2, 16, 32
    explicit = (
        2 * b * s * h * 3 * h  # QKV projection
        + 2 * b * s * s * h  # Q K^T over all heads
        + 2 * b * s * s * h  # attention x V
        + 2 * b * s * h * h  # output projection
        + 2 * b * s * h * 4 * h * 2
    )  # MLP up and down
    assert cm.layer_forward_flops(b, s, h) == explicit


def test_gpt2_layer_flops_match_torch_counter():
    b, s, h, heads = 2, 16, 32, 4

    class Block(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.ln1, self.ln2 = torch.nn.LayerNorm(h), torch.nn.LayerNorm(h)
            self.qkv, self.proj = torch.nn.Linear(h, 3 * h), torch.nn.Linear(h, h)
            self.fc1, self.fc2 = torch.nn.Linear(h, 4 * h), torch.nn.Linear(4 * h, h)

        def forward(self, x):
            q, k, v = self.qkv(self.ln1(x)).view(b, s, 3, heads, h // heads).permute(2, 0, 3, 1, 4)
            att = torch.softmax(q @ k.transpose(-1, -2) / math.sqrt(h // heads), dim=-1)
            x = x + self.proj((att @ v).transpose(1, 2).reshape(b, s, h))
            return x + self.fc2(torch.nn.functional.gelu(self.fc1(self.ln2(x))))

    with FlopCounterMode(display=False) as counter:
        Block()(torch.randn(b, s, h))
    assert counter.get_total_flops() == cm.layer_forward_flops(b, s, h)


def test_engine_compress_model_matches_a_measured_single_process_reduce():
    """The model against LowRankCompressor.reduce itself (one process, no collectives: one job of
    eight matrices), with this host's measured rates, within 3x at ranks 2, 8 and 32.

    Both sides are timed on 2 shared cores: an attempt measures the host and right after it the
    engine (best of 5 each, so a disturbed call does not count), and an attempt that other users
    disturbed anyway is repeated. The model must hold at every rank in one of three attempts; a model
    off by more than 3x fails all three."""
    from edgc.config import EDGCConfig
    from edgc.distributed.comm import Communicator
    from edgc.engine.lowrank import LowRankCompressor
    from edgc_sim.engine_model import engine_compute_time
    from edgc_sim.host import measure_host

    torch.set_num_threads(1)
    shapes = [(512, 2048), (2048, 512), (512, 1536), (512, 512)] * 2
    grads0 = [torch.randn(*s) for s in shapes]
    names = [f"w{i}" for i in range(len(shapes))]

    def attempt() -> dict:
        device = measure_host()
        ratios = {}
        for rank in (2, 8, 32):
            compressor = LowRankCompressor(EDGCConfig())
            best = float("inf")
            for _ in range(5):
                grads = [g.clone() for g in grads0]
                t = time.perf_counter()
                compressor.reduce(names, grads, rank, Communicator(), measure_error=False)
                best = min(best, time.perf_counter() - t)
            model = engine_compute_time(
                [shapes],
                rank,
                device.flops_per_s("fp32"),
                device.mem_bytes_per_s,
                device.launch_s,
                4,
                device.skinny_rates(),
                world_size=1,
            )
            print(f"rank {rank}: model {model * 1e3:.1f} ms, measured {best * 1e3:.1f} ms")
            ratios[rank] = model / best
        return ratios

    attempts = []
    for _ in range(3):
        attempts.append(attempt())
        if all(1 / 3 < ratio < 3 for ratio in attempts[-1].values()):
            return
    pytest.fail(f"model / measured outside (1/3, 3) in every attempt: {attempts}")
