"""Pure cost functions: FLOPs, alpha-beta collectives, the 1F1B timeline, PowerSGD cost.

Units: seconds, bytes, FLOPs, bytes/s. Nothing here knows about presets or clusters; the composition
lives in edgc_sim.iteration.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import NamedTuple

from .engine_model import EngineRates, engine_compute_time, engine_jobs


class AlphaBeta(NamedTuple):
    """One ring step: latency alpha (s) plus bytes / bytes_per_s."""

    alpha_s: float
    bytes_per_s: float


# ---------------------------------------------------------------------------------------- collectives
def ring_allreduce_time(n: int, nbytes: float, link: AlphaBeta) -> float:
    """Ring all-reduce of `nbytes` over n ranks: 2(n-1) steps, each moving nbytes/n per rank."""
    if n <= 1 or nbytes <= 0:
        return 0.0
    return 2 * (n - 1) * link.alpha_s + 2 * (n - 1) / n * nbytes / link.bytes_per_s


def ring_reduce_scatter_time(n: int, nbytes: float, link: AlphaBeta) -> float:
    """Ring reduce-scatter (or all-gather, same cost) of an `nbytes` buffer: n-1 steps of nbytes/n."""
    if n <= 1 or nbytes <= 0:
        return 0.0
    return (n - 1) * link.alpha_s + (n - 1) / n * nbytes / link.bytes_per_s


def hierarchical_allreduce_time(nodes: int, per_node: int, nbytes: float, intra: AlphaBeta, inter: AlphaBeta) -> float:
    """All-reduce over `nodes` x `per_node` ranks: intra reduce-scatter, inter all-reduce of the
    1/per_node shard, intra all-gather (NCCL's tree/ring split for groups that cross nodes)."""
    if nodes <= 1:
        return ring_allreduce_time(per_node, nbytes, intra)
    if per_node <= 1:
        return ring_allreduce_time(nodes, nbytes, inter)
    return 2 * ring_reduce_scatter_time(per_node, nbytes, intra) + ring_allreduce_time(nodes, nbytes / per_node, inter)


# ---------------------------------------------------------------------------------------------- FLOPs
def layer_forward_flops(batch: int, seq: int, hidden: int) -> float:
    """Matmul FLOPs of one GPT-2 block forward (Narayanan et al. SC'21): QKV 6bsh^2, scores 2bs^2h,
    attention x V 2bs^2h, output projection 2bsh^2, MLP 16bsh^2."""
    b, s, h = batch, seq, hidden
    return 24 * b * s * h * h + 4 * b * s * s * h


def logits_forward_flops(batch: int, seq: int, hidden: int, vocab: int) -> float:
    """The LM head: (b s x h) @ (h x V)."""
    return 2 * batch * seq * hidden * vocab


def layer_forward_elementwise_bytes(batch: int, seq: int, hidden: int, heads: int, bytes_per_value: int) -> float:
    """Memory traffic of one block's non-matmul ops in the forward pass (unfused eager kernels):
    2 LayerNorms and 2 residual adds (3 accesses of b s h each), GELU on b s 4h (2 accesses),
    scale + mask + softmax on the b a s^2 scores (4 accesses)."""
    bsh = batch * seq * hidden
    return bytes_per_value * (4 * 3 * bsh + 2 * 4 * bsh + 4 * batch * heads * seq * seq)


def logits_elementwise_bytes(batch: int, seq: int, vocab: int, bytes_per_value: int) -> float:
    """Softmax + cross-entropy over the b s V logits (4 accesses) in the forward pass."""
    return 4 * bytes_per_value * batch * seq * vocab


def bubble_fraction(stages: int, micro_batches: int) -> float:
    """Idle fraction of a balanced 1F1B (or GPipe) pipeline: (P-1)/(m+P-1)."""
    return (stages - 1) / (micro_batches + stages - 1)


# ------------------------------------------------------------------------------------------ 1F1B
@dataclass(frozen=True)
class Timeline:
    """Start/end times of every forward and backward, indexed [stage][micro-batch]."""

    fwd_start: tuple  #: seconds from iteration start
    fwd_end: tuple  #: seconds
    bwd_start: tuple  #: seconds
    bwd_end: tuple  #: seconds

    @property
    def flush_end(self) -> tuple:
        """Per stage: when its last backward ends (its DP sync can start)."""
        return tuple(max(row) for row in self.bwd_end)


def one_f_one_b_order(stage: int, stages: int, micro_batches: int) -> list:
    """Megatron's non-interleaved 1F1B op order of one stage: ('F'|'B', micro-batch index)."""
    warmup = min(stages - stage - 1, micro_batches)
    order = [("F", i) for i in range(warmup)]
    for j in range(micro_batches - warmup):
        order += [("F", warmup + j), ("B", j)]
    order += [("B", i) for i in range(micro_batches - warmup, micro_batches)]
    return order


def one_f_one_b_timeline(
    t_fwd: Sequence[float],
    t_bwd: Sequence,
    micro_batches: int,
    p2p_s: Sequence[float] = (),
    p2p_bwd_s: Sequence | None = None,
) -> Timeline:
    """Event simulation of one 1F1B iteration. t_fwd[p]: stage p's time of one micro-batch forward;
    t_bwd[p]: of one backward, or a sequence of one per micro-batch (a compressed gradient's compress
    time lengthens its sender's backward). p2p_s[p]: transfer time of an activation from stage p to
    p+1; p2p_bwd_s[p]: of an activation gradient from p+1 back to p, a number or one per micro-batch
    (compressed transfers are shorter); None: the same as p2p_s."""
    P, m = len(t_fwd), micro_batches
    if len(t_bwd) != P:
        raise ValueError("t_fwd and t_bwd must have one entry per stage")
    p2p = list(p2p_s) if p2p_s else [0.0] * (P - 1)
    if len(p2p) != P - 1:
        raise ValueError("p2p_s must have one entry per stage boundary (P-1)")
    back = p2p if p2p_bwd_s is None else list(p2p_bwd_s)
    if len(back) != P - 1:
        raise ValueError("p2p_bwd_s must have one entry per stage boundary (P-1)")
    bwd = [_per_micro_batch(t, m, "t_bwd") for t in t_bwd]
    back = [_per_micro_batch(t, m, "p2p_bwd_s") for t in back]
    ends = {"F": [[None] * m for _ in range(P)], "B": [[None] * m for _ in range(P)]}
    starts = {"F": [[None] * m for _ in range(P)], "B": [[None] * m for _ in range(P)]}
    orders = [one_f_one_b_order(p, P, m) for p in range(P)]
    cursor, free_at = [0] * P, [0.0] * P

    def ready_time(kind: str, p: int, i: int):
        # forward waits for the previous stage's forward, backward for the next stage's backward
        if kind == "F":
            return 0.0 if p == 0 else _plus(ends["F"][p - 1][i], p2p[p - 1])
        return ends["F"][p][i] if p == P - 1 else _plus(ends["B"][p + 1][i], back[p][i])

    remaining = 2 * P * m
    while remaining:
        progressed = False
        for p in range(P):
            while cursor[p] < len(orders[p]):
                kind, i = orders[p][cursor[p]]
                ready = ready_time(kind, p, i)
                if ready is None:
                    break
                start = max(free_at[p], ready)
                starts[kind][p][i] = start
                ends[kind][p][i] = free_at[p] = start + (t_fwd[p] if kind == "F" else bwd[p][i])
                cursor[p] += 1
                remaining -= 1
                progressed = True
        if not progressed:  # cannot happen for a valid 1F1B order; guards against a bad edit
            raise RuntimeError("1F1B schedule deadlocked")
    freeze = lambda grid: tuple(tuple(row) for row in grid)  # noqa: E731
    return Timeline(freeze(starts["F"]), freeze(ends["F"]), freeze(starts["B"]), freeze(ends["B"]))


def _per_micro_batch(value, m: int, name: str) -> list:
    if isinstance(value, (int, float)):
        return [float(value)] * m
    values = list(value)
    if len(values) != m:
        raise ValueError(f"{name}: a per-micro-batch entry needs {m} values, got {len(values)}")
    return values


def backward_waits(timeline: Timeline, stages: int, micro_batches: int) -> list:
    """Per stage: seconds it sat idle before its backwards (waiting for the next stage's activation
    gradient), summed over the micro-batches; the last stage never waits for one (0)."""
    out = []
    for p in range(stages):
        if p == stages - 1:
            out.append(0.0)
            continue
        previous_end, idle = 0.0, 0.0
        for kind, i in one_f_one_b_order(p, stages, micro_batches):
            start = (timeline.fwd_start if kind == "F" else timeline.bwd_start)[p][i]
            if kind == "B":
                idle += max(0.0, start - previous_end)
            previous_end = (timeline.fwd_end if kind == "F" else timeline.bwd_end)[p][i]
        out.append(idle)
    return out


def _plus(t, dt):
    return None if t is None else t + dt


# ------------------------------------------------------------------------------------- PowerSGD
# Kernels per column of the Gram-Schmidt in Optimus-CC's TorchScript `orthogonalize` (megatron/mpu/
# reducers.py, reused by EDGC): square, sum, sqrt, add eps, divide; multiply, sum, multiply, subtract.
GS_KERNELS_PER_COLUMN = 9


def effective_rank(m: int, n: int, rank: int) -> int:
    """PowerSGD clips the rank per matrix: r_i = min(m, n, r)."""
    return min(m, n, rank)


def powersgd_values(shapes: Sequence[tuple], rank: int) -> tuple:
    """Values sent per matrix set: (sum m r_i for the P all-reduce, sum n r_i for Q); raw is sum m n."""
    p = sum(m * effective_rank(m, n, rank) for m, n in shapes)
    q = sum(n * effective_rank(m, n, rank) for m, n in shapes)
    return p, q


def powersgd_matmul_flops(shapes: Sequence[tuple], rank: int) -> float:
    """P = M Q, Q = M^T P and the decompression P Q^T: 3 x 2 m n r_i."""
    return sum(6 * m * n * effective_rank(m, n, rank) for m, n in shapes)


def orthogonalize_time(rows: int, cols: int, mem_bytes_per_s: float, launch_s: float, bytes_per_value: int) -> float:
    """Column-by-column Gram-Schmidt of a rows x cols matrix: launch-bound for small matrices, else
    memory-bound (column i reads the remaining cols-i-1 columns twice and writes them once)."""
    touched = rows * (cols * (cols - 1) / 2 + cols)
    return cols * GS_KERNELS_PER_COLUMN * launch_s + 3 * touched * bytes_per_value / mem_bytes_per_s


def optimus_powersgd_time(
    shapes: Sequence[tuple],
    rank: int,
    flops_per_s: float,
    mem_bytes_per_s: float,
    launch_s: float,
    bytes_per_value: int,
) -> float:
    """Compress + decompress of the paper's reducer (Optimus-CC's megatron/mpu/reducers.py, which
    EDGC reuses; the paper, §2.3), what the paper-scale projections model: the three matmuls at the
    matmul rate, orthogonalising P only (with a warm-started Q that reducer skips Q) by its
    TorchScript Gram-Schmidt, and the elementwise error-feedback passes (M = G + e: 3 accesses,
    e = M - G_hat: 3, write-back of G_hat: 1)."""
    matmul = powersgd_matmul_flops(shapes, rank) / flops_per_s
    orth = sum(
        orthogonalize_time(m, effective_rank(m, n, rank), mem_bytes_per_s, launch_s, bytes_per_value) for m, n in shapes
    )
    elementwise = 7 * bytes_per_value * sum(m * n for m, n in shapes) / mem_bytes_per_s
    return matmul + orth + elementwise


def powersgd_compute_time(
    shapes: Sequence[tuple],
    rank: int,
    flops_per_s: float,
    mem_bytes_per_s: float,
    launch_s: float,
    bytes_per_value: int,
    engine: EngineRates | None = None,
    measure_error: bool = False,
) -> float:
    """Compress + decompress time of one step over the gradient tensors `shapes` (definition order).

    With `engine` (how the device runs our engine: `DeviceSpec.skinny_rates`), our engine
    (`edgc_sim.engine_model`): the tensors in DDP's buckets, fused into jobs on an accelerator; per
    job its launches, per compressed matrix its GEMMs, passes and orthonormalisation. Without: the
    paper's reducer, `optimus_powersgd_time`."""
    if engine is None:
        return optimus_powersgd_time(shapes, rank, flops_per_s, mem_bytes_per_s, launch_s, bytes_per_value)
    jobs = engine_jobs(shapes, bytes_per_value, engine.accelerator)
    return engine_compute_time(
        jobs, rank, flops_per_s, mem_bytes_per_s, launch_s, bytes_per_value, engine, measure_error=measure_error
    )


def torch_powersgd_hook_time(
    shapes: Sequence[tuple],
    bucket_values: int,
    rank: int,
    flops_per_s: float,
    mem_bytes_per_s: float,
    launch_s: float,
    alloc_s_per_byte: float,
    bytes_per_value: int,
    hook_gemm_flops_per_s: float | None = None,
) -> float:
    """Compress + decompress of PyTorch's powerSGD_hook over one bucket of `bucket_values` values
    (counted from torch 2.13's source): the same three matmuls; both Q (warm start) and P
    orthogonalised; error feedback over the whole bucket, 1-D tensors included (add_ the error: 3
    accesses, clone the input: 2, decompress writes: 1, error = copy - input: 3), and the clone and
    the new error are fresh allocations of the bucket, first touched every step.

    `hook_gemm_flops_per_s`: the measured rate of the hook's own GEMM forms (bmm(M, Q),
    bmm(M^T, P), bmm(P, Q^T); edgc_sim.host). Same shapes as our engine's but not the same forms:
    the hook multiplies M from the left by a column-accessed n x r factor, which on this CPU runs
    2-6x slower than the engine's transposed products, so it does not get the engine's skinny
    rates. None: the square-matmul `flops_per_s` (the GPU presets)."""
    matmul = powersgd_matmul_flops(shapes, rank) / (hook_gemm_flops_per_s or flops_per_s)
    orth = sum(
        orthogonalize_time(rows, effective_rank(m, n, rank), mem_bytes_per_s, launch_s, bytes_per_value)
        for m, n in shapes
        for rows in (m, n)
    )
    bucket_bytes = bucket_values * bytes_per_value
    return matmul + orth + 9 * bucket_bytes / mem_bytes_per_s + 2 * bucket_bytes * alloc_s_per_byte
