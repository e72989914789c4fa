"""Our engine's compress + decompress time and its kernel launches, counted from `edgc.lowrank`.

The engine (`edgc.lowrank.LowRankCompressor.reduce_steps`, `edgc.layout`, `edgc.engine_state`,
`edgc.factors`) works per *job*: one DDP bucket on a CPU, consecutive buckets fused into jobs of at
least `edgc.state.DEFAULT_ACCELERATOR_FUSION_MB` on an accelerator (`edgc.jobs`). A job's
compressed matrices fall into *shape groups* (same m, n, rank); every product is one batched GEMM
per group; on an accelerator P and Q are orthonormalised by a shifted CholeskyQR2 in float64 (two
passes), with one factorisation per pass and rank for all *blocks* (P blocks: groups of one (rank,
m); Q blocks: one (rank, n), for matrices m × n), on a CPU by one Householder QR per block. So a job's launches are a fixed number plus a few per group and per block, and
its bytes are those of the matrices: the two product forms read M, the decompression writes Ĝ, and
the error feedback is formed and updated in elementwise passes. On an accelerator M and Ĝ are
gathered per job (one `cat`, one add, one `_foreach_copy_`: 4 more passes over the compressed
gradients than the CPU, which moves them matrix by matrix).

`job_launches` counts the kernel-launching dispatches of one steady job exactly as
`edgc_bench.dispatch_count` does (tests/sim/test_engine_model.py holds the two together); the
time model charges each of them the device's per-op cost on the host, and the bytes and FLOPs on
the device (`EngineCost`). A CPU does both in turn; on an accelerator the host issues ahead of the
device (a side stream, one host read per step), so fusing buckets into fewer jobs saves time only
while the launches, not the bytes, are the larger share.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import NamedTuple, Optional, Sequence

from edgc.factors import compressed_rank
from edgc.state import DEFAULT_ACCELERATOR_FUSION_MB

from .collectives import MIB, ddp_buckets

# Error feedback and factors are kept in float32 for fp32, bf16 and fp16 gradients (edgc.lowrank).
COMPUTE_BYTES = 4
# Elementwise accesses per compressed gradient value, besides the GEMMs' own (the product forms read
# the error-feedback arena, the decompression writes Ĝ), as (gradient-dtype accesses, arena accesses):
#   CPU:  M = G + e by _foreach_add_ (read G; read, write e), e −= Ĝ by _foreach_sub_ (read Ĝ in the
#         gradient; read, write e);
#   accelerator: cat of the gradients (read G, write the gathered copy), arena.add_ (read it; read,
#         write e), Ĝ into the gathered copy by the GEMM, _foreach_copy_ back (read, write G),
#         arena.sub_ (read Ĝ; read, write e).
PER_MATRIX_ACCESSES = (2, 4)
GATHERED_ACCESSES = (6, 4)
MEASURE_ERROR_ACCESSES = 1  # ‖M‖² when the relative error is measured: one more read of the arena
# Elementwise bytes per factor value (float32), besides the orthonormalisation's:
#   Q: restart of zero rows (vector_norm reads Q; where reads Q and the restart rows, writes),
#      the non-finite flag's sum, the kept Q's where (reads two, writes one);
#   P: the non-finite flag's sum, P + poison (read, write).
Q_FACTOR_BYTES = 4 + 12 + 4 + 12
P_FACTOR_BYTES = 4 + 8
# The orthonormalisation (edgc.factors.orthonormalize_blocks_) on an accelerator casts the whole flat
# buffer to float64 (read 4, write 8) and copies the result back (read 8, write 4); on a CPU LAPACK
# copies each block in (read 4, write 4) and the result back (read 4, write 4). Its FLOPs
# (`orth_flops`) run at the measured orthonormalisation rate.
ORTH_CAST_BYTES = 24
HOUSEHOLDER_COPY_BYTES = 16
# Half-precision gradients: the factors go out on the gradient's dtype (div, cast, copy back after
# the all-reduce: read 4 + write 4, read 4 + write 2, read 2 + write 4) and are cast for the
# decompression (read 4, write 2).
HALF_WIRE_BYTES = 8 + 6 + 6
HALF_DECOMPRESS_BYTES = 6

# Dispatches of the orthonormalisation: the float64 cast and the copy back per call; per pass and
# rank the diagonal's mean, its clamp_, the shift's add_ and one cholesky_ex (and a cat of the Gram
# matrices when the rank has several blocks); per pass and block its Gram bmm and its triangular solve.
ORTH_PASSES = 2
ORTH_OPS_PER_CALL = 2
ORTH_OPS_PER_RANK = 4
ORTH_OPS_PER_BLOCK = 2
HOUSEHOLDER_OPS_PER_BLOCK = 2  # the CPU's: linalg_qr, the copy back
RESTART_OPS_PER_Q_BLOCK = 3  # vector_norm, eq, where (edgc.factors.restart_zero_rows)
# edgc.finite.nan_unless_finite: zeros, then per non-empty tensor a float64 sum and an add, then the
# mul by 0 and the cast to float32.
FLAG_OPS = 3
FLAG_OPS_PER_TENSOR = 2
# Measured error (every round(1/alpha) steps): Q's clone, ‖M‖² (dot, cast), <Aᵀ·P, Q> and ‖Q‖² (dot,
# cast each), ‖M‖² − 2<·,·> + ‖Q‖² (mul, sub, add) and its clamp.
MEASURE_ERROR_OPS = 11
# The hook around the engine (edgc.reducer): per job the step's non-finite flag is or-ed with the
# job's; per step the flag is cast to float64 and stacked with the error sums for the step's one
# host read, sums that are filled on the device when the step did not measure them (Python zeros).
REDUCER_OPS_PER_JOB = 1
REDUCER_OPS_PER_STEP = 2
UNMEASURED_ERROR_FILLS = 2


class EngineRates(NamedTuple):
    """How a device runs our engine (edgc_sim.host measures them). A GEMM of an m x n matrix at rank r
    costs m n bytes / (read or write rate) + 2 m n r / flops: the additive bytes + FLOP form fits the
    measured CPU times from r = 2 to 16 (a max of the two does not: the kernels neither stream at
    copy bandwidth nor compute at the square rate)."""

    read_bytes_per_s: float  #: M streamed by a product form (Pᵀ = Qᵀ Aᵀ, Qᵀ = Pᵀ A) beyond its FLOPs
    write_bytes_per_s: float  #: Ĝ = P Qᵀ written by the decompression form beyond its FLOPs
    orth_flops_per_s: float = 0.0  #: the orthonormalisation's FLOPs (`orth_flops`, the device's method) per second; 0 = the matmul rate
    accelerator: bool = False  #: gathered copies and fused jobs (a GPU) rather than per-matrix copies and a job per bucket (a CPU)
    gemm_flops_per_s: float = 0.0  #: the float32 matmul rate the byte rates were separated at; 0 = the caller's rate


@dataclass(frozen=True)
class JobLayout:
    """What one job costs, from its tensors' shapes (`edgc.layout.CallLayout` without the tensors)."""

    matrices: tuple  #: (m, n, rank) of every compressed matrix
    raw_values: int  #: values of the tensors sent raw (vectors, matrices too small to gain)
    groups: int  #: shape groups: distinct (m, n, rank)
    p_blocks: dict  #: rank -> P blocks of that rank (distinct m)
    q_blocks: dict  #: rank -> Q blocks of that rank (distinct n)

    @classmethod
    def plan(cls, shapes: Sequence[tuple], rank: int, min_compression_rate: float = 2.0) -> "JobLayout":
        matrices, raw = [], 0
        for shape in shapes:
            values = math.prod(shape)
            view = (shape[0], values // shape[0]) if len(shape) >= 2 and values else None
            r = compressed_rank(view, rank, min_compression_rate)
            if r:
                matrices.append((*view, r))
            else:
                raw += values
        groups = set(matrices)
        return cls(tuple(matrices), raw, len(groups), _blocks(groups, lambda m, n: m), _blocks(groups, lambda m, n: n))


def _blocks(groups: set, side) -> dict:
    sides: dict = {}
    for m, n, r in groups:
        sides.setdefault(r, set()).add(side(m, n))
    return {r: len(s) for r, s in sides.items()}


def orth_launches(blocks: dict, *, householder: bool = False) -> int:
    """Dispatches of one `orthonormalize_blocks_` call over blocks {rank: how many} (see ORTH_OPS_*;
    ``householder``: the CPU's path)."""
    if householder:
        return HOUSEHOLDER_OPS_PER_BLOCK * sum(blocks.values())
    return ORTH_OPS_PER_CALL + ORTH_PASSES * sum(ORTH_OPS_PER_RANK + (count > 1) + ORTH_OPS_PER_BLOCK * count
                                                 for count in blocks.values())


def job_launches(job: JobLayout, *, gathered: bool, half_gradients: bool = False, world_size: int = 2,
                 measure_error: bool = False) -> int:
    """Kernel-launching dispatches of one steady `reduce_steps` job, in its order. ``gathered``: the
    accelerator's path; ``half_gradients``: bf16 gradients (fp16 adds power-of-two scalings, not
    counted); ``world_size`` > 1 divides before each all-reduce."""
    raw = job.raw_values > 0
    divides = world_size > 1
    ops = 0
    if job.matrices:  # M = G + e: gathered (cat, add_) or one _foreach_add_
        ops += 2 if gathered else 1
    elif gathered:
        ops += 1  # the add_ of an empty gather
    ops += sum(RESTART_OPS_PER_Q_BLOCK * count for count in job.q_blocks.values()) + orth_launches(job.q_blocks, householder=not gathered)
    ops += job.groups  # Pᵀ = Qᵀ·Aᵀ, one bmm per group
    ops += 2 + FLAG_OPS + FLAG_OPS_PER_TENSOR * (bool(job.matrices) + raw) + 1  # raw message + flag
    ops += divides  # the raw message's mean
    ops += raw  # _foreach_copy_ of the averaged raw tensors back
    ops += half_gradients + 1  # the flag's cast to float32, isnan
    if not job.matrices:
        return ops  # no compressed matrix: the job ends after the raw message
    wire_ops = 3 if half_gradients else int(divides)  # P's and Q's mean: div, cast, copy back; or div_
    ops += 2 * wire_ops
    ops += orth_launches(job.p_blocks, householder=not gathered) + job.groups  # orth(P), Qᵀ = Pᵀ·A per group
    ops += FLAG_OPS + FLAG_OPS_PER_TENSOR + 1 + 1 + 1  # Q's flag, poison + flag, isnan, P + poison
    ops += 2 * half_gradients  # P and Q cast to the gradient's dtype
    if gathered:  # Ĝ per group into the gathered copy, one _foreach_copy_, arena.sub_
        ops += job.groups + 1 + 1
    else:  # Ĝ matrix by matrix into the gradients, one _foreach_sub_
        ops += len(job.matrices) + 1
    ops += 1  # the kept Q's where
    return ops + (MEASURE_ERROR_OPS if measure_error else 0)


def engine_jobs(shapes: Sequence[tuple], bytes_per_value: int, accelerator: bool, *,
                bucket_cap_mib: Optional[float] = None, fusion_mb: Optional[float] = None) -> list:
    """The jobs one compressed step runs, as lists of tensor shapes: DDP's buckets of ``shapes``
    (definition order, `collectives.ddp_buckets`), each its own job on a CPU; on an accelerator
    consecutive buckets gathered until they hold ``fusion_mb`` (default the library's) or the
    step's last bucket arrives (`edgc.jobs.JobQueue.submit`)."""
    buckets = ddp_buckets(shapes, bucket_cap_mib, bytes_per_value)
    limit = (DEFAULT_ACCELERATOR_FUSION_MB if fusion_mb is None else fusion_mb) * MIB if accelerator else 0
    jobs, gathered, size = [], [], 0
    for bucket in buckets:
        gathered += bucket
        size += sum(math.prod(shape) for shape in bucket) * bytes_per_value
        if size >= limit:
            jobs.append(gathered)
            gathered, size = [], 0
    return jobs + ([gathered] if gathered else [])


def step_launches(jobs: Sequence[Sequence[tuple]], rank: int, *, gathered: bool, half_gradients: bool = False,
                  world_size: int = 2, measure_error: bool = False, min_compression_rate: float = 2.0) -> int:
    """Dispatches of one compressed step through the DDP hook: every job's, and the reducer's own."""
    return REDUCER_OPS_PER_STEP + (0 if measure_error else UNMEASURED_ERROR_FILLS) + sum(
        REDUCER_OPS_PER_JOB + job_launches(JobLayout.plan(job, rank, min_compression_rate), gathered=gathered,
                                           half_gradients=half_gradients, world_size=world_size,
                                           measure_error=measure_error)
        for job in jobs)


def orth_flops(rank: int, side: int, *, householder: bool = False) -> float:
    """FLOPs of orthonormalising one r x k factor: by the shifted CholeskyQR2, per pass the Gram matrix
    X·Xᵀ (2 r² k) and the triangular solve L⁻¹·X (r² k), the r x r Cholesky (r³/3) left out; by
    Householder (``householder``, a CPU's), geqrf and orgqr, 2 r² k each less O(r³)."""
    if householder:
        return 4 * rank * rank * side
    return ORTH_PASSES * 3 * rank * rank * side


class EngineCost(NamedTuple):
    """One step's compress + decompress, split by who is busy: the host issuing the engine's ops
    (launches × the per-op cost) and the device running them (bytes and FLOPs)."""

    host_s: float
    device_s: float

    def seconds(self, overlapped: bool) -> float:
        """The step's engine time. On a CPU the same cores issue and run every op: the sum. On an
        accelerator the jobs run on a side stream with one host read per step, so the host issues
        ahead of the device and the slower of the two sets the time: the larger."""
        return max(self.host_s, self.device_s) if overlapped else self.host_s + self.device_s


def job_cost(job: JobLayout, flops_per_s: float, mem_bytes_per_s: float, launch_s: float, bytes_per_value: int,
             rates: EngineRates, *, world_size: int = 2, measure_error: bool = False) -> EngineCost:
    """Compress + decompress of one job: on the host its launches at the per-op cost; on the device,
    per compressed matrix, two product GEMMs reading M (float32 arena, FLOPs at the float32 rate the
    skinny rates were measured against) and the decompression writing Ĝ (in the gradient's dtype:
    FLOPs at ``flops_per_s`` for half-precision gradients), the elementwise passes of the device's
    path, the factors' elementwise bytes and their orthonormalisation (FLOPs at the measured rate,
    or the float32 matmul rate where none was measured)."""
    half = bytes_per_value < COMPUTE_BYTES
    grad_accesses, arena_accesses = GATHERED_ACCESSES if rates.accelerator else PER_MATRIX_ACCESSES
    arena_accesses += MEASURE_ERROR_ACCESSES if measure_error else 0
    gemm_rate = rates.gemm_flops_per_s or flops_per_s
    decompress_rate = flops_per_s if half else gemm_rate
    orth_rate = rates.orth_flops_per_s or gemm_rate
    factor_bytes = (HALF_WIRE_BYTES + HALF_DECOMPRESS_BYTES) if half else 0
    householder = not rates.accelerator
    cast_bytes = HOUSEHOLDER_COPY_BYTES if householder else ORTH_CAST_BYTES
    seconds = 0.0
    for m, n, r in job.matrices:
        values = m * n
        seconds += (2 * (values * COMPUTE_BYTES / rates.read_bytes_per_s + 2 * values * r / gemm_rate)
                    + values * bytes_per_value / rates.write_bytes_per_s + 2 * values * r / decompress_rate)
        seconds += values * (grad_accesses * bytes_per_value + arena_accesses * COMPUTE_BYTES) / mem_bytes_per_s
        seconds += r * (m * (P_FACTOR_BYTES + cast_bytes + factor_bytes)
                        + n * (Q_FACTOR_BYTES + cast_bytes + factor_bytes)) / mem_bytes_per_s
        seconds += (orth_flops(r, m, householder=householder) + orth_flops(r, n, householder=householder)) / orth_rate
    launches = job_launches(job, gathered=rates.accelerator, half_gradients=half, world_size=world_size,
                            measure_error=measure_error)
    return EngineCost((launches + REDUCER_OPS_PER_JOB) * launch_s, seconds)


def engine_step_cost(jobs: Sequence[Sequence[tuple]], rank: int, flops_per_s: float, mem_bytes_per_s: float,
                     launch_s: float, bytes_per_value: int, rates: EngineRates, *, world_size: int = 2,
                     measure_error: bool = False, min_compression_rate: float = 2.0) -> EngineCost:
    """Host and device time of one step whose jobs hold these tensor shapes (`engine_jobs`)."""
    costs = [job_cost(JobLayout.plan(job, rank, min_compression_rate), flops_per_s, mem_bytes_per_s, launch_s,
                      bytes_per_value, rates, world_size=world_size, measure_error=measure_error) for job in jobs]
    step_ops = REDUCER_OPS_PER_STEP + (0 if measure_error else UNMEASURED_ERROR_FILLS)
    return EngineCost(step_ops * launch_s + sum(c.host_s for c in costs), sum(c.device_s for c in costs))


def engine_compute_time(jobs: Sequence[Sequence[tuple]], rank: int, flops_per_s: float, mem_bytes_per_s: float,
                        launch_s: float, bytes_per_value: int, rates: EngineRates, *, world_size: int = 2,
                        measure_error: bool = False, min_compression_rate: float = 2.0) -> float:
    """Compress + decompress seconds of one step (`engine_step_cost`, summed on a CPU, the larger of
    host and device on an accelerator: `EngineCost.seconds`)."""
    return engine_step_cost(jobs, rank, flops_per_s, mem_bytes_per_s, launch_s, bytes_per_value, rates,
                            world_size=world_size, measure_error=measure_error,
                            min_compression_rate=min_compression_rate).seconds(rates.accelerator)
