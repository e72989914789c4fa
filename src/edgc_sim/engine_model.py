"""Our engine's compress + decompress time and its kernel launches, counted from `edgc.engine.lowrank`.

The engine (`edgc.engine.lowrank.LowRankCompressor.reduce_steps`, `edgc.engine.layout`, `edgc.engine.engine_memory`,
`edgc.engine.factors`) works per *job*: one DDP bucket on a CPU, consecutive buckets fused into jobs of at
least `edgc.runner.jobs.DEFAULT_ACCELERATOR_FUSION_MB` on an accelerator (`edgc.runner.jobs`). A job's
compressed matrices fall into *shape groups* (same m, n, rank); every product that reads M (P, Q
and the residual e = M − P·Qᵀ, which a CPU with float32 gradients forms instead as M − Ĝ, matrix by
matrix) is one batched GEMM per group on the error-feedback arena; on an
accelerator P and Q are orthonormalised by a shifted CholeskyQR2 in float64 (P in two passes, the
warm-started Q in its first, `edgc.engine.stretches.WARM_START_PASSES`), with one factorisation per
pass and rank for all *blocks* (P blocks: groups of one (rank, m); Q blocks: one (rank, n), for
matrices m × n), on a CPU by one Householder QR per block. What touches the
gradients goes matrix by matrix, where they lie in DDP's buckets: M = G + e (one ``_foreach_add_``,
which PyTorch runs tensor by tensor when G and e differ in dtype) and Ĝ written into each gradient
(one product per matrix). So a job's launches are a fixed number plus a few per group and per block
(and per matrix for the gradients), and its bytes are those of the matrices: M = G + e reads G and
e and writes M, the two product forms read M, the decompression writes Ĝ, the residual reads M and
writes e.

`job_launches` gives the kernel-launching dispatches of one steady job as `edgc_probes.dispatch_count`
counts them: its layout's terms (`JobLayout.terms`: per job, per matrix, per shape group, per P and Q
block, for its raw tensors) at the dispatches the engine was counted to issue per term
(`edgc_sim.engine_launches`, fitted to the engine's own counts, none typed here;
tests/bench/test_engine_launches.py holds them to fresh counts). A job's three stretches each finish where
the engine runs them (its finish at the hook call after its last collective): the count per step is
the same. The time model charges each dispatch the device's per-op cost on the host, and the bytes
and FLOPs on the device (`EngineCost`). A CPU does both in turn; on an accelerator the host issues
ahead of the device (a side stream, one host read per step), so fusing buckets into fewer jobs saves
time only while the launches, not the bytes, are the larger share. What the host spends per op class
(a Cholesky is not a view) is `edgc_sim.host_ops`'s.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import NamedTuple

from edgc.engine.engine_memory import subtracts_estimate
from edgc.engine.factors import compressed_rank
from edgc.engine.stretches import WARM_START_PASSES
from edgc.runner.jobs import DEFAULT_ACCELERATOR_FUSION_MB

from .collectives import MIB, ddp_buckets
from .engine_launches import LaunchTable, Setting, job_terms, launch_table

# Error feedback and factors are kept in float32 for fp32, bf16 and fp16 gradients (edgc.engine.lowrank).
COMPUTE_BYTES = 4
# Elementwise accesses per compressed gradient value, besides the GEMMs' own (the product forms read
# the error-feedback arena, the decompression writes Ĝ), as (gradient-dtype accesses, arena accesses):
# M = G + e by _foreach_add_ (read G; read e, write M), e = M − P·Qᵀ by baddbmm (read M, write e;
# its FLOPs are a third product's). The same on a CPU and an accelerator.
ELEMENTWISE_ACCESSES = (1, 4)
MEASURE_ERROR_ACCESSES = 1  # ‖M‖² when the relative error is measured: one more read of the arena
# Elementwise bytes per factor value (float32), besides the orthonormalisation's:
#   Q: restart of dead entries (nan_to_num reads and writes Q, eq reads it and writes a mask, where
#      reads the mask, Q and the restart rows, writes Q), the non-finite flag's sum, the kept Q's
#      where (reads two, writes one);
#   P: the non-finite flag's sum, P + poison (read, write).
Q_FACTOR_BYTES = 8 + 5 + 13 + 4 + 12
P_FACTOR_BYTES = 4 + 8
# The orthonormalisation (edgc.engine.factors.orthonormalize_blocks_) on an accelerator casts the whole flat
# buffer to float64 (read 4, write 8) and copies the result back (read 8, write 4); on a CPU LAPACK
# copies each block in (read 4, write 4) and the result back (read 4, write 4). Its FLOPs
# (`orth_flops`) run at the measured orthonormalisation rate.
ORTH_CAST_BYTES = 24
HOUSEHOLDER_COPY_BYTES = 16
# Half-precision gradients: the factors go out on the gradient's dtype (div into it, copy back after
# the all-reduce: read 4 + write 2, read 2 + write 4); for the decompression Q is cast (read 4,
# write 2) and P + poison writes 2 bytes, not 4; both are cast back for the residual (read 2, write 4).
HALF_WIRE_BYTES = 6 + 6
HALF_Q_DECOMPRESS_BYTES = 6 + 6
HALF_P_DECOMPRESS_BYTES = -2 + 6

# Dispatches of one `edgc.engine.factors.orthonormalize_blocks_` call at its default passes (cholesky2-fp64):
# the float64 cast and the copy back per call; per rank the first pass's shift (mean, clamp_, add_), the
# second's (add_), a cholesky_ex per pass, and the failure check (the passes' info added, ne,
# masked_fill_); per pass and block its Gram bmm and its triangular solve. Only `edgc_sim.host` uses
# them, to take one call's launches out of its measured time; a job's dispatches are counted
# (`edgc_sim.engine_launches`).
ORTH_PASSES = 2
ORTH_OPS_PER_CALL = 2
ORTH_OPS_PER_RANK = 3 + 1 + ORTH_PASSES + (ORTH_PASSES - 1) + 2
ORTH_OPS_PER_BLOCK = 2
HOUSEHOLDER_OPS_PER_BLOCK = 2  # the CPU's: linalg_qr, the copy back


class EngineRates(NamedTuple):
    """How a device runs our engine (edgc_sim.host measures them). A GEMM of an m x n matrix at rank r
    costs m n bytes / (read or write rate) + 2 m n r / flops: the additive bytes + FLOP form fits the
    measured CPU times from r = 2 to 16 (a max of the two does not: the kernels neither stream at
    copy bandwidth nor compute at the square rate)."""

    read_bytes_per_s: float  #: M streamed by a product form (Pᵀ = Qᵀ Aᵀ, Qᵀ = Pᵀ A) beyond its FLOPs
    write_bytes_per_s: float  #: Ĝ = P Qᵀ written by the decompression form beyond its FLOPs
    #: the orthonormalisation's FLOPs (`orth_flops`, the device's method) per second; 0 = the matmul rate
    orth_flops_per_s: float = 0.0
    #: batched CholeskyQR2 and fused jobs (a GPU) rather than Householder per block and a job per bucket (a CPU)
    accelerator: bool = False
    gemm_flops_per_s: float = 0.0  #: the float32 matmul rate the byte rates were separated at; 0 = the caller's rate


@dataclass(frozen=True)
class JobLayout:
    """What one job costs, from its tensors' shapes (`edgc.engine.layout.CallLayout` without the tensors)."""

    matrices: tuple  #: (m, n, rank) of every compressed matrix
    raw_values: int  #: values of the tensors sent raw (vectors, matrices too small to gain)
    groups: int  #: shape groups: distinct (m, n, rank)
    p_blocks: dict  #: rank -> P blocks of that rank (distinct m)
    q_blocks: dict  #: rank -> Q blocks of that rank (distinct n)
    raw_tensors: int = 0  #: non-empty tensors sent raw

    @classmethod
    def plan(cls, shapes: Sequence[tuple], rank: int, min_compression_rate: float = 2.0) -> JobLayout:
        matrices, raw, raw_tensors = [], 0, 0
        for shape in shapes:
            values = math.prod(shape)
            view = (shape[0], values // shape[0]) if len(shape) >= 2 and values else None
            r = compressed_rank(view, rank, min_compression_rate)
            if r:
                matrices.append((*view, r))
            else:
                raw, raw_tensors = raw + values, raw_tensors + bool(values)
        groups = set(matrices)
        p_blocks, q_blocks = _blocks(groups, lambda m, n: m), _blocks(groups, lambda m, n: n)
        return cls(tuple(matrices), raw, len(groups), p_blocks, q_blocks, raw_tensors)

    def terms(self) -> dict:
        """Its terms of the dispatch count (`edgc_sim.engine_launches.job_terms`)."""
        return job_terms(self.matrices, self.raw_tensors, sum(self.p_blocks.values()), sum(self.q_blocks.values()))


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
    return ORTH_OPS_PER_CALL + sum(
        ORTH_OPS_PER_RANK + ORTH_PASSES * ORTH_OPS_PER_BLOCK * count for count in blocks.values()
    )


def job_launches(
    job: JobLayout,
    *,
    accelerator: bool,
    half_gradients: bool = False,
    world_size: int = 2,
    measure_error: bool = False,
    tracked: bool = False,
    table: LaunchTable | None = None,
) -> int:
    """Kernel-launching dispatches of one steady `reduce_steps` job: its terms (`JobLayout.terms`) at the
    dispatches the engine was counted to issue per term (``table``, default the committed
    `edgc_sim.engine_launches.launch_table`). ``accelerator``: the accelerator's kernels;
    ``half_gradients``: bf16 gradients with float32 error feedback (fp16 adds power-of-two
    scalings, not counted); ``world_size`` > 1 divides before each all-reduce; ``tracked``: within
    a hook's step, whose end puts the stored Q back after a non-finite step (no select on the device)."""
    setting = Setting(accelerator, half_gradients, world_size > 1, measure_error, tracked)
    return (table or launch_table()).job(setting, job.terms())


def engine_jobs(
    shapes: Sequence[tuple],
    bytes_per_value: int,
    accelerator: bool,
    *,
    bucket_cap_mib: float | None = None,
    fusion_mb: float | None = None,
) -> list:
    """The jobs one compressed step runs, as lists of tensor shapes: DDP's buckets of ``shapes``
    (definition order, `collectives.ddp_buckets`), each its own job on a CPU; on an accelerator
    consecutive buckets gathered until they hold ``fusion_mb`` (default the library's) or the
    step's last bucket arrives (`edgc.runner.jobs.JobQueue.submit`)."""
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


def step_launches(
    jobs: Sequence[Sequence[tuple]],
    rank: int,
    *,
    accelerator: bool,
    half_gradients: bool = False,
    world_size: int = 2,
    measure_error: bool = False,
    min_compression_rate: float = 2.0,
    table: LaunchTable | None = None,
) -> int:
    """Dispatches of one compressed step through the DDP hook: every job's, and the hook's own per job
    and per step (counted on static steps: `LaunchTable.hook`)."""
    table = table or launch_table()
    return table.hook["per_step"] + sum(
        table.hook["per_job"]
        + job_launches(
            JobLayout.plan(job, rank, min_compression_rate),
            accelerator=accelerator,
            half_gradients=half_gradients,
            world_size=world_size,
            measure_error=measure_error,
            tracked=True,
            table=table,
        )
        for job in jobs
    )


def orth_flops(rank: int, side: int, *, householder: bool = False, passes: int = ORTH_PASSES) -> float:
    """FLOPs of orthonormalising one r x k factor: by the shifted CholeskyQR2, per pass (``passes``: the
    warm start runs fewer) the Gram matrix X·Xᵀ (2 r² k) and the triangular solve L⁻¹·X (r² k), the
    r x r Cholesky (r³/3) left out; by Householder (``householder``, a CPU's: always whole), geqrf and
    orgqr, 2 r² k each less O(r³)."""
    if householder:
        return 4 * rank * rank * side
    return passes * 3 * rank * rank * side


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


def job_cost(
    job: JobLayout,
    flops_per_s: float,
    mem_bytes_per_s: float,
    launch_s: float,
    bytes_per_value: int,
    rates: EngineRates,
    *,
    world_size: int = 2,
    measure_error: bool = False,
    warm_start_passes: int = WARM_START_PASSES,
) -> EngineCost:
    """Compress + decompress of one job: on the host its launches at the per-op cost; on the device,
    per compressed matrix, two product GEMMs reading M (float32 arena, FLOPs at the float32 rate the
    skinny rates were measured against), the decompression writing Ĝ (in the gradient's dtype:
    FLOPs at ``flops_per_s`` for half-precision gradients), the residual's product (its arena
    accesses among the elementwise ones, its FLOPs at the float32 rate; on a CPU with float32
    gradients a read of Ĝ instead), the elementwise passes,
    the factors' elementwise bytes and their orthonormalisation (FLOPs at the measured rate, or the
    float32 matmul rate where none was measured; ``warm_start_passes``: Q's, an engine's before its
    warm start ran fewer than P's)."""
    half = bytes_per_value < COMPUTE_BYTES
    grad_accesses, arena_accesses = ELEMENTWISE_ACCESSES
    arena_accesses += MEASURE_ERROR_ACCESSES if measure_error else 0
    gemm_rate = rates.gemm_flops_per_s or flops_per_s
    decompress_rate = flops_per_s if half else gemm_rate
    orth_rate = rates.orth_flops_per_s or gemm_rate
    p_half = (HALF_WIRE_BYTES + HALF_P_DECOMPRESS_BYTES) if half else 0
    q_half = (HALF_WIRE_BYTES + HALF_Q_DECOMPRESS_BYTES) if half else 0
    householder = not rates.accelerator
    cast_bytes = HOUSEHOLDER_COPY_BYTES if householder else ORTH_CAST_BYTES
    subtracts = subtracts_estimate(not rates.accelerator, not half)
    seconds = 0.0
    for m, n, r in job.matrices:
        values = m * n
        # the residual: Ĝ read back (its M and e accesses are among the elementwise ones), or its product
        residual = values * bytes_per_value / mem_bytes_per_s if subtracts else 2 * values * r / gemm_rate
        seconds += (
            2 * (values * COMPUTE_BYTES / rates.read_bytes_per_s + 2 * values * r / gemm_rate)
            + values * bytes_per_value / rates.write_bytes_per_s
            + 2 * values * r / decompress_rate
            + residual
        )
        seconds += values * (grad_accesses * bytes_per_value + arena_accesses * COMPUTE_BYTES) / mem_bytes_per_s
        seconds += (
            r
            * (m * (P_FACTOR_BYTES + cast_bytes + p_half) + n * (Q_FACTOR_BYTES + cast_bytes + q_half))
            / mem_bytes_per_s
        )
        warm_start = orth_flops(r, n, householder=householder, passes=warm_start_passes)
        seconds += (orth_flops(r, m, householder=householder) + warm_start) / orth_rate
    launches = job_launches(
        job,
        accelerator=rates.accelerator,
        half_gradients=half,
        world_size=world_size,
        measure_error=measure_error,
        tracked=True,
    )
    return EngineCost((launches + launch_table().hook["per_job"]) * launch_s, seconds)


def engine_step_cost(
    jobs: Sequence[Sequence[tuple]],
    rank: int,
    flops_per_s: float,
    mem_bytes_per_s: float,
    launch_s: float,
    bytes_per_value: int,
    rates: EngineRates,
    *,
    world_size: int = 2,
    measure_error: bool = False,
    min_compression_rate: float = 2.0,
    warm_start_passes: int = WARM_START_PASSES,
) -> EngineCost:
    """Host and device time of one step whose jobs hold these tensor shapes (`engine_jobs`)."""
    costs = [
        job_cost(
            JobLayout.plan(job, rank, min_compression_rate),
            flops_per_s,
            mem_bytes_per_s,
            launch_s,
            bytes_per_value,
            rates,
            world_size=world_size,
            measure_error=measure_error,
            warm_start_passes=warm_start_passes,
        )
        for job in jobs
    ]
    return EngineCost(
        launch_table().hook["per_step"] * launch_s + sum(c.host_s for c in costs), sum(c.device_s for c in costs)
    )


def engine_compute_time(
    jobs: Sequence[Sequence[tuple]],
    rank: int,
    flops_per_s: float,
    mem_bytes_per_s: float,
    launch_s: float,
    bytes_per_value: int,
    rates: EngineRates,
    *,
    world_size: int = 2,
    measure_error: bool = False,
    min_compression_rate: float = 2.0,
) -> float:
    """Compress + decompress seconds of one step (`engine_step_cost`, summed on a CPU, the larger of
    host and device on an accelerator: `EngineCost.seconds`)."""
    return engine_step_cost(
        jobs,
        rank,
        flops_per_s,
        mem_bytes_per_s,
        launch_s,
        bytes_per_value,
        rates,
        world_size=world_size,
        measure_error=measure_error,
        min_compression_rate=min_compression_rate,
    ).seconds(rates.accelerator)
