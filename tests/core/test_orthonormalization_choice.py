"""How the engine orthonormalises its factors: a method per device, and a factorisation that fails.

cuSOLVER (like LAPACK) leaves a finite, partial factor when a Cholesky factorisation fails, so rows
solved against it come out finite and not orthonormal; only ``cholesky_ex``'s info tells. Here a
failure is injected through that info, as a device would report it, on a factor that is itself
fine: the engine must act on the info, not on what the factor looks like."""

import pytest
import torch
from distributed_harness import run_distributed
from test_lowrank import FlatBlock, ill_conditioned_rows, make_grads

import edgc.engine.orthonormal_choice as orthonormal_choice
from edgc import EDGCConfig, EDGCState, LowRankCompressor, LowRankConfig
from edgc.distributed.comm import Communicator
from edgc.engine.factors import ORTHONORMALIZATIONS, orthonormalize_blocks_
from edgc.engine.orthonormal_choice import orthonormalization_for

CHOLESKY = [method for method in ORTHONORMALIZATIONS if method != "householder"]


def test_each_accelerator_gets_the_method_timed_faster_there_once(monkeypatch):
    """Compute capability does not tell a cut-float64 part (H20: 9.0) from a fast one (H100: 9.0):
    the engine times both Cholesky methods once per device and takes the faster."""
    timed = []
    float64_seconds = {0: 1.0, 1: 9.0}  # device 0 as an H100, device 1 as an H20 (same capability)

    def seconds_of(method, device, shape=orthonormal_choice.TIMED_SHAPE):
        timed.append((device.index, method))
        return float64_seconds[device.index] if method == "cholesky2-fp64" else 2.0

    monkeypatch.setattr(orthonormal_choice, "seconds_of", seconds_of)
    orthonormal_choice.timed.cache_clear()
    try:
        assert orthonormalization_for(torch.device("cpu")) == "householder"
        assert orthonormalization_for(torch.device("cuda", 0)) == "cholesky2-fp64"
        assert orthonormalization_for(torch.device("cuda", 1)) == "cholesky4-fp32"
        assert orthonormalization_for(torch.device("cuda", 0)) == "cholesky2-fp64"
        assert sorted(timed) == sorted((d, m) for d in (0, 1) for m in orthonormal_choice.TIMED)  # once each
    finally:
        orthonormal_choice.timed.cache_clear()


def test_a_method_is_timed_on_the_device_it_runs_on():
    for method in orthonormal_choice.TIMED:
        assert 0 < orthonormal_choice.seconds_of(method, torch.device("cpu"), (2, 4, 64)) < 10


def _agreeing(rank, world_size):
    from edgc.distributed.comm import Communicator

    mine = orthonormal_choice.TIMED[rank]  # each rank timed its device differently
    return orthonormal_choice.agreed(mine, Communicator(None), torch.device("cpu"))


def test_the_group_runs_its_rank_0s_method():
    assert run_distributed(_agreeing, 2) == [orthonormal_choice.TIMED[0]] * 2


def test_the_method_is_kept_in_the_checkpoint_and_a_resume_times_nothing(monkeypatch):
    grads = make_grads(0, torch.float32)
    compressor = LowRankCompressor(EDGCConfig(r_max=2))
    compressor.state.orthonormalization = "cholesky4-fp32"  # as the group agreed on an accelerator
    compressor.reduce(list(grads), list(grads.values()), 2, Communicator(None))
    saved = compressor.state_dict()
    assert saved["orthonormalization"] == "cholesky4-fp32"

    def no_timing(*args):
        raise AssertionError("a resumed engine must not time: its checkpoint says which method runs")

    monkeypatch.setattr(orthonormal_choice, "timed", no_timing)
    resumed = LowRankCompressor(EDGCConfig(r_max=2))
    resumed.load_state_dict(saved)
    resumed.agree_orthonormalization(torch.device("cuda"), Communicator(None))  # nothing to time or agree
    assert resumed.orthonormalization(torch.device("cuda")) == "cholesky4-fp32"
    state = EDGCState(None, EDGCConfig(r_max=2, total_steps=10))
    state.compressor.load_state_dict(saved)
    checked = {**state.state_dict(), "compressor": {**saved, "orthonormalization": "qr-by-hand"}}
    with pytest.raises(ValueError, match="orthonormalization"):
        EDGCState(None, EDGCConfig(r_max=2, total_steps=10)).load_state_dict(checked)


@pytest.mark.parametrize("method", CHOLESKY)
@pytest.mark.parametrize("condition", [1e3, 1e6])
def test_the_cholesky_methods_give_orthonormal_rows(method, condition):
    rows = ill_conditioned_rows(4, 8, 200, condition)
    flat = rows.flatten().clone()
    orthonormalize_blocks_(flat, [FlatBlock(0, 4, 8, 200)], method=method)
    out = flat.view(4, 8, 200)
    torch.testing.assert_close(out @ out.transpose(-1, -2), torch.eye(8).expand(4, -1, -1), atol=1e-5, rtol=0)
    # the same rows' span: each input row is in the span of the output rows
    projected = (rows @ out.transpose(-1, -2)) @ out
    assert ((rows - projected).norm() / rows.norm()).item() < 1e-5


def failing_on(monkeypatch, matrices: set[int], calls: set[int] | None = None) -> list[int]:
    """Make ``cholesky_ex`` report a failure for these batch entries (on the numbered calls only, if
    given), leaving its factor as computed. Returns the list of calls made."""
    real = torch.linalg.cholesky_ex
    made = []

    def cholesky_ex(gram, **kwargs):
        lower, info = real(gram, **kwargs)
        made.append(len(made))
        if calls is None or made[-1] in calls:
            info = info.clone()
            for index in matrices:
                info[index] = 1
        return lower, info

    monkeypatch.setattr(torch.linalg, "cholesky_ex", cholesky_ex)
    return made


@pytest.mark.parametrize("method", CHOLESKY)
def test_a_failed_factorisation_leaves_its_rows_nan(monkeypatch, method):
    rows = ill_conditioned_rows(3, 4, 50, 10.0)
    flat = rows.flatten().clone()
    failing_on(monkeypatch, {1}, calls={0})  # the first pass of the second matrix
    orthonormalize_blocks_(flat, [FlatBlock(0, 3, 4, 50)], method=method)
    out = flat.view(3, 4, 50)
    assert torch.isnan(out[1]).all()
    for k in (0, 2):
        torch.testing.assert_close(out[k] @ out[k].T, torch.eye(4), atol=1e-5, rtol=0)


def test_a_failed_orthonormalisation_of_p_makes_the_step_non_finite(monkeypatch):
    compressor = LowRankCompressor(EDGCConfig(r_max=4, engine=LowRankConfig(orthonormalization="cholesky2-fp64")))
    compressor.reduce(*_step(0), 4, Communicator())
    q_before = {name: q.clone() for name, q in compressor.q.items()}
    names, grads = _step(1)
    compressor.state.begin_step()
    failing_on(monkeypatch, {0})  # every factorisation of the first matrix of each rank fails
    stats = compressor.reduce(names, grads, 4, Communicator())
    monkeypatch.undo()
    assert bool(stats.nonfinite)
    compressed = [grad for name, grad in zip(names, grads) if stats.ranks[name]]
    assert compressed and all(torch.isnan(grad).all() for grad in compressed)  # every optimizer skips the step
    compressor.state.end_step(nonfinite=True)
    assert all(torch.equal(compressor.q[name], q) for name, q in q_before.items())  # Q kept
    assert all((e == 0).all() for e in compressor.error.values())  # the step's residual cleared
    stats = compressor.reduce(*_step(2), 4, Communicator())
    assert not bool(stats.nonfinite)  # the next step goes on


def test_a_failed_orthonormalisation_of_the_warm_start_restarts_it(monkeypatch):
    """Q's warm start does not depend on the step's gradient: were its failure poison, every step
    after it would fail the same way. Rows that come out of a failed factor not finite restart from
    the seeded replacement rows instead."""
    compressor = LowRankCompressor(EDGCConfig(r_max=4, engine=LowRankConfig(orthonormalization="cholesky2-fp64")))
    compressor.reduce(*_step(0), 4, Communicator())
    names, grads = _step(1)
    real = torch.linalg.cholesky_ex
    made = []

    def cholesky_ex(gram, **kwargs):  # the warm start's one pass fails on the first matrix, its factor NaN
        lower, info = real(gram, **kwargs)
        made.append(len(made))
        if made[-1] == 0:
            lower, info = lower.clone(), info.clone()
            lower[0], info[0] = float("nan"), 1
        return lower, info

    monkeypatch.setattr(torch.linalg, "cholesky_ex", cholesky_ex)
    stats = compressor.reduce(names, grads, 4, Communicator())
    assert len(made) == 3  # one pass for Q's warm start (it only conditions Q), two for P
    assert not bool(stats.nonfinite)
    assert all(torch.isfinite(grad).all() for grad in grads)
    assert all(torch.isfinite(q).all() for q in compressor.q.values())


def _step(seed: int) -> tuple[list[str], list[torch.Tensor]]:
    grads = make_grads(seed, dtype=torch.float32)
    return list(grads), list(grads.values())


@pytest.mark.parametrize("method", CHOLESKY)
def test_every_method_gives_the_cpus_averages_and_error_feedback(method):
    """Householder (the CPU's) against each Cholesky method over steps: P's column signs may differ,
    P·Qᵀ and the error feedback may not."""
    cpu = LowRankCompressor(EDGCConfig(r_max=4))
    other = LowRankCompressor(EDGCConfig(r_max=4, engine=LowRankConfig(orthonormalization=method)))
    for step in range(4):
        names, grads = _step(step)
        on_cpu, on_other = [g.clone() for g in grads], [g.clone() for g in grads]
        cpu.reduce(names, on_cpu, 4, Communicator())
        other.reduce(names, on_other, 4, Communicator())
        for name, a, b in zip(names, on_cpu, on_other):
            torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5, msg=f"step {step} {name}")
        for name in cpu.error:
            torch.testing.assert_close(cpu.error[name], other.error[name], rtol=1e-4, atol=1e-5)
