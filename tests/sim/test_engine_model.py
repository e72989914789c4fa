"""The model of our engine (edgc_sim.engine_model) against the engine's own dispatches and closed forms."""

import json
import math
from pathlib import Path

import pytest

from edgc_probes.gpt2_layout import GPT2_SIZES, gpt2_parameters
from edgc_probes.op_traffic import CAT_BATCH
from edgc_sim import cost_model as cm
from edgc_sim import engine_launches as el
from edgc_sim import engine_model as em
from edgc_sim.collectives import gpt2_gradient_shapes
from edgc_sim.presets import ModelSpec

COUNT = json.loads((Path(__file__).resolve().parents[2] / "docs" / "gpu" / "count" / "count.json").read_text())


def test_the_fit_reads_each_terms_dispatches_and_refuses_what_is_not_linear():
    """A counter made of known numbers per term gives them back; one that is not linear in the terms
    (a dispatch per pair of matrices) is refused, not fitted."""
    known = dict(zip(el.TERMS, (30, 4, 1, 2, 3, 4, 2, 6)))
    terms = lambda shapes: em.JobLayout.plan(shapes, el.PROBE_RANK).terms()  # noqa: E731
    linear = lambda shapes: sum(known[name] * value for name, value in terms(shapes).items())  # noqa: E731
    assert el.fit_job_launches(linear, terms) == known
    quadratic = lambda shapes: linear(shapes) + terms(shapes)["matrix"] ** 2  # noqa: E731
    with pytest.raises(ValueError, match="not linear"):
        el.fit_job_launches(quadratic, terms)
    assert el.fit_hook_launches([(10 + 3 * jobs + 100 * jobs, 100 * jobs, jobs) for jobs in (1, 4, 9)]) == {
        "per_step": 10,
        "per_job": 3,
    }
    with pytest.raises(ValueError, match="per-job"):
        el.fit_hook_launches([(100, 90, 1), (120, 100, 2), (150, 110, 3)])
    assert el.RAW_GATHER_BATCH == CAT_BATCH  # the counter's rule the raw gather's term follows


def gpt2_model(size: str) -> ModelSpec:
    layers, width, heads, vocab, context = GPT2_SIZES[size]
    return ModelSpec(layers, width, heads, context, vocab, vocab_pad=1, positions=context)


@pytest.mark.parametrize("row", COUNT["hook"], ids=lambda row: f"{row['model']}-{row['bucket_cap_mb']}MB")
def test_step_launches_are_the_committed_gpt2_dispatch_counts(row):
    """The model's launches of a compressed GPT-2 step on the GPU's path (DDP's buckets fused into jobs
    of the library's fusion size, M and Ĝ gathered) equal the dispatches `edgc_probes.dispatch_count`
    counted for docs/gpu/count/count.json (kept current by tests/bench/test_dispatch_count.py):
    every job's, and the hook's own per job and per step (fitted to these rows: two numbers for nine rows)."""
    model = gpt2_model(row["model"])
    shapes = gpt2_gradient_shapes(model)
    assert shapes == [tuple(shape) for _, shape in gpt2_parameters(row["model"])]
    jobs = em.engine_jobs(
        shapes, 2, accelerator=True, bucket_cap_mib=None if row["ddp_default"] else row["bucket_cap_mb"]
    )
    assert len(jobs) == row["collectives"] // 3  # every job compresses: raw, P and Q
    launches = em.step_launches(
        jobs, COUNT["rank"], accelerator=True, half_gradients=True, world_size=COUNT["world_size"]
    )
    assert launches == row["dispatches"]


def test_engine_call_launches_are_the_committed_counts():
    for row in COUNT["engine_same_shape"]:
        job = em.JobLayout.plan([tuple(row["shape"])] * row["matrices"], COUNT["rank"])
        assert em.job_launches(job, accelerator=True, half_gradients=True, world_size=1) == row["dispatches"]


def test_jobs_are_ddps_buckets_on_a_cpu_and_fused_on_an_accelerator():
    shapes = gpt2_gradient_shapes(gpt2_model("medium"))
    buckets = em.engine_jobs(shapes, 4, accelerator=False)
    fused = em.engine_jobs(shapes, 4, accelerator=True)
    assert len(buckets) > 10 and 1 < len(fused) < len(buckets)
    assert sorted(map(tuple, sum(fused, []))) == sorted(map(tuple, sum(buckets, []))) == sorted(shapes)
    for job in fused[:-1]:  # every job but the step's last holds the fusion size
        assert sum(math.prod(shape) for shape in job) * 4 >= 256 * 2**20
    assert em.engine_jobs(shapes, 4, accelerator=True, fusion_mb=0) == buckets


RATES = em.EngineRates(8e9, 4e9, 2e9)
FLOPS, MEM, LAUNCH = 4e10, 2e10, 1e-5


def job_cost(shapes, rank, rates=RATES, bytes_per_value=4, **kwargs) -> em.EngineCost:
    return em.engine_step_cost([shapes], rank, FLOPS, MEM, LAUNCH, bytes_per_value, rates, **kwargs)


def job_seconds(shapes, rank, rates=RATES, bytes_per_value=4, **kwargs) -> float:
    return em.engine_compute_time([shapes], rank, FLOPS, MEM, LAUNCH, bytes_per_value, rates, **kwargs)


def test_job_time_counts_gemms_passes_factors_orthonormalisation_and_launches():
    """One m x n fp32 matrix on a CPU: two product GEMMs reading M and the decompression writing Ĝ
    (bytes at the skinny rates + FLOPs), 6 elementwise passes (G read, e read and M written, M and Ĝ
    read and e written: a CPU subtracts the written Ĝ rather than form a second product), the
    factors' elementwise bytes, the Householder QR of P (r x m) and Q (r x n), and every launch at
    the per-op cost, one after another."""
    m, n, r = 2048, 512, 8
    values = m * n
    gemms = 2 * (values * 4 / 8e9 + 2 * values * r / FLOPS) + values * 4 / 4e9 + 2 * values * r / FLOPS
    passes = 6 * values * 4 / MEM
    factors = (
        r
        * (m * (em.P_FACTOR_BYTES + em.HOUSEHOLDER_COPY_BYTES) + n * (em.Q_FACTOR_BYTES + em.HOUSEHOLDER_COPY_BYTES))
        / MEM
    )
    orth = 4 * r * r * (m + n) / 2e9  # Householder: geqrf and orgqr, 2 r² k FLOPs each
    launches = em.step_launches([[(m, n)]], r, accelerator=False, world_size=2)
    assert job_cost([(m, n)], r) == pytest.approx((launches * LAUNCH, gemms + passes + factors + orth))
    assert job_seconds([(m, n)], r) == pytest.approx(gemms + passes + factors + orth + launches * LAUNCH)
    # no measured orthonormalisation rate: its FLOPs at the matmul rate
    unmeasured = job_seconds([(m, n)], r, em.EngineRates(8e9, 4e9))
    assert unmeasured == pytest.approx(gemms + passes + factors + orth * 2e9 / FLOPS + launches * LAUNCH)
    # a measured error reads M once more and adds its launches
    measured = job_seconds([(m, n)], r, measure_error=True)
    extra_launches = em.step_launches([[(m, n)]], r, accelerator=False, measure_error=True) - launches
    assert extra_launches > 0
    assert measured == pytest.approx(job_seconds([(m, n)], r) + values * 4 / MEM + extra_launches * LAUNCH)


def test_gemm_flops_run_at_the_float32_rate_the_byte_rates_were_measured_at():
    """The products always run in float32 (the arena): their FLOPs at the rates' own matmul rate,
    not the caller's (the training precision); half-precision gradients get Ĝ's product in their
    dtype, at the caller's rate. With float32 gradients a CPU forms no residual product."""
    m, n, r = 2048, 512, 8
    flops = 2 * m * n * r
    fp32_rate = RATES._replace(gemm_flops_per_s=FLOPS / 4)
    device = job_cost([(m, n)], r, fp32_rate).device_s - job_cost([(m, n)], r).device_s
    # the three products' FLOPs (P, Q, Ĝ); the orthonormalisation keeps its own measured rate
    assert device == pytest.approx(3 * flops * (4 / FLOPS - 1 / FLOPS))
    # bf16 gradients: P, Q and the residual's product at the float32 rate, Ĝ's at the caller's
    half = job_cost([(m, n)], r, fp32_rate, 2).device_s - job_cost([(m, n)], r, bytes_per_value=2).device_s
    assert half == pytest.approx(3 * flops * (4 / FLOPS - 1 / FLOPS))
    # on an accelerator the float32 residual is a fourth product
    accelerator, fast = RATES._replace(accelerator=True), fp32_rate._replace(accelerator=True)
    device = job_cost([(m, n)], r, fast).device_s - job_cost([(m, n)], r, accelerator).device_s
    assert device == pytest.approx(4 * flops * (4 / FLOPS - 1 / FLOPS))


def test_an_accelerator_moves_the_cpus_bytes_and_batches_its_orthonormalisation():
    """The accelerator's path against the CPU's on four same-shape matrices: the same passes over the
    gradients and the arena (both move M and Ĝ matrix by matrix, where the gradients lie), and P and
    Q orthonormalised by CholeskyQR2 (float64 casts; 3 r² k FLOPs a pass: P in two, the warm start
    in `WARM_START_PASSES`) instead of a Householder QR per block (LAPACK's copies, 4 r² k FLOPs);
    and the residual as one product for the group (its FLOPs), where the CPU subtracts each written
    Ĝ (a read of Ĝ); each path's launches at the per-op cost."""
    shapes, r = [(1024, 4096)] * 4, 16
    m, n = shapes[0]
    cpu, gpu = job_cost(shapes, r), job_cost(shapes, r, RATES._replace(accelerator=True))
    launches = em.step_launches([shapes], r, accelerator=True) - em.step_launches([shapes], r, accelerator=False)
    orth_bytes = 4 * r * (m + n) * (em.ORTH_CAST_BYTES - em.HOUSEHOLDER_COPY_BYTES) / MEM  # 4 matrices' factors
    orth_flops = 4 * r * r * ((6 - 4) * m + (3 * em.WARM_START_PASSES - 4) * n) / RATES.orth_flops_per_s
    residual = 4 * (2 * m * n * r / FLOPS - m * n * 4 / MEM)  # the product's FLOPs, not a read of Ĝ
    assert gpu.device_s - cpu.device_s == pytest.approx(orth_bytes + orth_flops + residual)
    assert gpu.host_s - cpu.host_s == pytest.approx(launches * LAUNCH)


def test_an_accelerator_hides_the_smaller_of_host_and_device_time():
    """A CPU issues and runs every op in turn: host + device. An accelerator's host issues ahead of
    its side stream: the larger of the two, whichever it is."""
    shapes, r = [(1024, 4096)] * 4, 16
    for launch in (1e-7, 1e-2):  # device-bound, then launch-bound
        cost = em.engine_step_cost([shapes], r, FLOPS, MEM, launch, 4, RATES._replace(accelerator=True))
        assert (cost.host_s > cost.device_s) == (launch > 1e-3)
        overlapped = em.engine_compute_time([shapes], r, FLOPS, MEM, launch, 4, RATES._replace(accelerator=True))
        assert overlapped == pytest.approx(max(cost))
        assert em.engine_compute_time([shapes], r, FLOPS, MEM, launch, 4, RATES) == pytest.approx(
            sum(em.engine_step_cost([shapes], r, FLOPS, MEM, launch, 4, RATES))
        )


def test_same_shapes_share_their_launches_and_new_shapes_add_some():
    """A second matrix of a shape shares its group's launches (the batched products, the blocks'
    orthonormalisation): it adds only what touches its gradient, fewer launches than a new shape
    group, and fewer again than a new group with a new block on both sides."""
    r = 8
    one, two = job_seconds([(512, 2048)], r), job_seconds([(512, 2048)] * 2, r)
    per_matrix = em.step_launches([[(512, 2048)] * 2], r, accelerator=False) - em.step_launches(
        [[(512, 2048)]], r, accelerator=False
    )
    shared = em.step_launches([[(512, 2048)]], r, accelerator=False) - per_matrix
    assert 0 < per_matrix < shared
    assert two == pytest.approx(2 * one - shared * LAUNCH)
    for half in (False, True):
        batched = lambda shapes: em.step_launches([shapes], r, accelerator=True, half_gradients=half)  # noqa: E731, B023
        base = batched([(512, 2048)])
        same = batched([(512, 2048)] * 2) - base
        assert batched([(512, 2048)] * 8) - base == 7 * same  # nothing per matrix but its own
        new_group = batched([(512, 2048), (1536, 2048)]) - base  # a new m: a new P block
        both = batched([(512, 2048), (2048, 512)]) - base  # its transpose: a new P and Q block
        assert same < new_group < both


def test_half_precision_gradients_halve_the_gradient_accesses_not_the_arena():
    m, n, r = 1024, 4096, 16
    rates = RATES._replace(accelerator=True)
    full, half = job_cost([(m, n)], r, rates), job_cost([(m, n)], r, rates, bytes_per_value=2)
    # the gradient's read and the decompression's write at 2 bytes; the arena (4 arena accesses, the
    # product forms' reads) stays fp32; the factors' casts and launches come on top
    saved = m * n * 2 * (1 / MEM + 1 / 4e9)
    extra_launches = em.step_launches([[(m, n)]], r, accelerator=True, half_gradients=True) - em.step_launches(
        [[(m, n)]], r, accelerator=True
    )
    casts = (
        r
        * (
            m * (em.HALF_WIRE_BYTES + em.HALF_P_DECOMPRESS_BYTES)
            + n * (em.HALF_WIRE_BYTES + em.HALF_Q_DECOMPRESS_BYTES)
        )
        / MEM
    )
    # the casts between the gradient's dtype and the arena's: more launches, none fewer
    assert extra_launches > 0
    assert half.device_s == pytest.approx(full.device_s - saved + casts)
    assert half.host_s == pytest.approx(full.host_s + extra_launches * LAUNCH)


def test_the_step_model_prices_our_engine_only_with_its_rates():
    shapes, r = [(1920, 1920)] * 4 + [(1440, 1920)] * 2, 32
    paper = cm.powersgd_compute_time(shapes, r, 1e13, 9e11, 5e-6, 4)
    assert paper == pytest.approx(cm.optimus_powersgd_time(shapes, r, 1e13, 9e11, 5e-6, 4))
    ours = cm.powersgd_compute_time(shapes, r, 1e13, 9e11, 5e-6, 4, RATES)
    jobs = em.engine_jobs(shapes, 4, accelerator=False)
    assert ours == pytest.approx(em.engine_compute_time(jobs, r, 1e13, 9e11, 5e-6, 4, RATES))
    # a matrix that gains nothing at this rank is sent raw: no GEMMs
    assert cm.powersgd_compute_time([(64, 64)], 64, 1e13, 9e11, 5e-6, 4, RATES) < cm.powersgd_compute_time(
        [(64, 64)], 8, 1e13, 9e11, 5e-6, 4, RATES
    )
