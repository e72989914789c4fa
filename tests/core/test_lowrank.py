import math

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from edgc import EDGCConfig, LowRankCompressor, LowRankConfig, orthogonalize_
from edgc.distributed.comm import Communicator
from edgc.engine.factors import orthonormalize_blocks_, orthonormalize_rows_


def make_grads(seed, dtype=torch.float64):
    g = torch.Generator().manual_seed(seed)
    return {
        "attn.weight": torch.randn(48, 32, generator=g, dtype=dtype),
        "mlp.weight": torch.randn(48, 32, generator=g, dtype=dtype),  # same shape: batched with attn
        "conv.weight": torch.randn(16, 4, 3, 3, generator=g, dtype=dtype),  # viewed as 16 × 36
        "bias": torch.randn(48, generator=g, dtype=dtype),
        "tiny.weight": torch.randn(3, 3, generator=g, dtype=dtype),  # not worth compressing
    }


class OpNames(TorchDispatchMode):
    """The names of the aten ops dispatched inside the block."""

    def __init__(self):
        super().__init__()
        self.names: set[str] = set()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.names.add(func.overloadpacket.__name__)
        return func(*args, **(kwargs or {}))


def test_error_feedback_conserves_the_gradient_single_process():
    compressor = LowRankCompressor(EDGCConfig(r_max=4))
    comm = Communicator()
    previous_error = {}
    for step in range(3):
        grads = make_grads(step)
        names = list(grads)
        originals = {n: g.clone() + previous_error.get(n, torch.zeros_like(g)).view_as(g) for n, g in grads.items()}
        stats = compressor.reduce(names, list(grads.values()), 4, comm)
        for name in names:
            residual = compressor.error.get(name, torch.zeros_like(grads[name])).view_as(grads[name])
            torch.testing.assert_close(grads[name] + residual, originals[name], rtol=0, atol=1e-12)
        previous_error = {n: e.clone() for n, e in compressor.error.items()}
        assert stats.ranks == {"attn.weight": 4, "mlp.weight": 4, "conv.weight": 4, "bias": 0, "tiny.weight": 0}
        assert stats.elements_sent == 48 + 9 + 1 + 2 * 4 * (48 + 32) + 4 * (16 + 36)
        assert stats.elements_raw == 2 * 48 * 32 + 16 * 36 + 48 + 9
        assert 0 < stats.error_sq < stats.norm_sq


def _powersgd_step(matrix: torch.Tensor, q: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """One matrix's step of PowerSGD as torch's hook computes it: P = M·Q, orth(P), Q = Mᵀ·P."""
    p = torch.linalg.qr(matrix @ q).Q
    q = matrix.T @ p
    return p @ q.T, q


def test_batched_engine_computes_per_matrix_powersgd_on_tall_and_wide_matrices():
    # The engine batches, fuses and orthonormalises differently, but what it sends must be
    # PowerSGD's Ĝ = P·Pᵀ·M with Q warm-started on M's columns, whichever side of M is longer:
    # working on Mᵀ for wide matrices gives a different approximation, and learned worse.
    shapes = {"tall.weight": (48, 32), "wide.weight": (24, 80), "conv.weight": (16, 4, 3, 3)}
    rank = 4
    compressor = LowRankCompressor(EDGCConfig(r_max=rank))
    generator = torch.Generator().manual_seed(3)
    q = {
        name: torch.randn(math.prod(shape[1:]), rank, generator=generator, dtype=torch.float64)
        for name, shape in shapes.items()
    }
    compressor.q.update({name: value.clone() for name, value in q.items()})
    error = {name: torch.zeros(shape[0], math.prod(shape[1:]), dtype=torch.float64) for name, shape in shapes.items()}
    for _ in range(4):
        grads = {name: torch.randn(*shape, generator=generator, dtype=torch.float64) for name, shape in shapes.items()}
        expected = {}
        for name, grad in grads.items():
            matrix = grad.reshape(error[name].shape) + error[name]
            expected[name], q[name] = _powersgd_step(matrix, q[name])
            error[name] = matrix - expected[name]
        compressor.reduce(list(grads), list(grads.values()), rank, Communicator())
        for name, grad in grads.items():
            torch.testing.assert_close(grad.reshape(expected[name].shape), expected[name], rtol=0, atol=1e-9)
            torch.testing.assert_close(
                compressor.error[name].reshape(error[name].shape), error[name], rtol=0, atol=1e-9
            )


def test_a_step_without_gradient_does_not_stall_the_power_iteration():
    # A zero gradient leaves Q = Mᵀ·P = 0, and a zero Q would stay zero for ever; its rows restart.
    compressor = LowRankCompressor(EDGCConfig(r_max=4, engine=LowRankConfig(error_feedback=False)))
    low_rank = torch.randn(24, 2, dtype=torch.float64) @ torch.randn(2, 80, dtype=torch.float64)
    for grad, expected in (
        (torch.zeros(24, 80, dtype=torch.float64), torch.zeros(24, 80, dtype=torch.float64)),
        (low_rank.clone(), low_rank),
    ):
        compressor.reduce(["w"], [grad], 4, Communicator())
        torch.testing.assert_close(grad, expected, rtol=0, atol=1e-9)  # rank 2 ≤ 4: one step is exact
    assert compressor.q["w"].norm() > 0


def test_rank_at_least_min_dimension_is_lossless():
    compressor = LowRankCompressor(
        EDGCConfig(r_max=64, engine=LowRankConfig(min_compression_rate=0.0, error_feedback=False))
    )
    grads = make_grads(7, dtype=torch.float32)
    originals = {n: g.clone() for n, g in grads.items()}
    stats = compressor.reduce(list(grads), list(grads.values()), 64, Communicator())
    assert stats.ranks["attn.weight"] == 32 and stats.ranks["conv.weight"] == 16
    for name in grads:
        torch.testing.assert_close(grads[name], originals[name], rtol=0, atol=1e-5)


def test_orthogonalize_handles_all_zero_columns():
    for rank in (1, 2, 5):
        matrices = torch.zeros(3, 10, rank)
        matrices[1, :, 0] = 1.0
        orthogonalize_(matrices)
        assert torch.isfinite(matrices).all()
        orthonormal = orthogonalize_(torch.randn(2, 10, rank))
        torch.testing.assert_close(
            orthonormal.transpose(1, 2) @ orthonormal, torch.eye(rank).expand(2, -1, -1), atol=1e-5, rtol=0
        )


def ill_conditioned_rows(batch: int, rank: int, side: int, condition: float) -> torch.Tensor:
    generator = torch.Generator().manual_seed(0)
    u, _ = torch.linalg.qr(torch.randn(batch, rank, rank, generator=generator, dtype=torch.float64))
    v, _ = torch.linalg.qr(torch.randn(batch, side, rank, generator=generator, dtype=torch.float64))
    singular = torch.logspace(0, -math.log10(condition), rank, dtype=torch.float64)
    return ((u * singular) @ v.transpose(-1, -2)).float()


@pytest.mark.parametrize("householder", [False, True], ids=["cholesky-qr2", "householder"])
@pytest.mark.parametrize("condition", [1e3, 1e5, 1e7])
def test_weak_directions_come_out_orthonormal_not_shrunk(condition, householder):
    """A factor whose weakest direction is far below its strongest (a gradient's top-r spectrum)
    still comes out orthonormal: a shrunk direction would shrink again every step and be lost."""
    rows = ill_conditioned_rows(4, 8, 200, condition)
    out = orthonormalize_rows_(rows.clone())
    torch.testing.assert_close(out @ out.transpose(-1, -2), torch.eye(8).expand(4, -1, -1), atol=1e-6, rtol=0)
    flat = torch.cat([rows.flatten(), rows[:2].flatten()])
    blocks = [FlatBlock(0, 4, 8, 200), FlatBlock(rows.numel(), 2, 8, 200)]
    orthonormalize_blocks_(flat, blocks, method="householder" if householder else "cholesky2-fp64")
    for block in blocks:
        view = block.view(flat)
        torch.testing.assert_close(
            view @ view.transpose(-1, -2), torch.eye(8).expand(len(view), -1, -1), atol=1e-6, rtol=0
        )


def test_the_accelerators_kernels_give_the_cpus_averages_and_error_feedback():
    """The engine's two paths (gathered copies and batched CholeskyQR2 on an accelerator; per-matrix
    copies and Householder per block on a CPU) compute the same PowerSGD step: P's column signs may
    differ, P·Qᵀ may not. Checked over steps, so warm-started Q and error feedback carry it."""
    cpu = LowRankCompressor(EDGCConfig(r_max=4))
    accelerator = LowRankCompressor(EDGCConfig(r_max=4, engine=LowRankConfig(force_accelerator_kernels=True)))
    for step in range(4):
        grads = make_grads(step, dtype=torch.float32)
        names = list(grads)
        on_cpu, on_accelerator = [g.clone() for g in grads.values()], [g.clone() for g in grads.values()]
        cpu.reduce(names, on_cpu, 4, Communicator())
        with OpNames() as ops:
            accelerator.reduce(names, on_accelerator, 4, Communicator())
        assert "baddbmm" in ops.names  # e = M − P·Qᵀ, Ĝ never read back
        for name, a, b in zip(names, on_cpu, on_accelerator):
            torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5, msg=f"step {step} {name}")
        assert cpu.error.keys() == accelerator.error.keys()
        for name in cpu.error:
            torch.testing.assert_close(cpu.error[name], accelerator.error[name], rtol=1e-4, atol=1e-5)


def test_on_a_cpu_the_residual_is_exactly_what_the_average_left_out():
    """A CPU forms e = M − Ĝ from the Ĝ it just wrote (an element-wise pass, cheaper there than a
    second rank-r product, which an accelerator keeps because it never reads Ĝ back): with float32
    gradients each residual is the element-wise difference, bit for bit, across steps of
    warm-started Q."""
    compressor = LowRankCompressor(EDGCConfig(r_max=4))
    error = {}
    for step in range(3):
        grads = make_grads(step, dtype=torch.float32)
        names = list(grads)
        corrected = {n: g + error[n].view_as(g) if n in error else g.clone() for n, g in grads.items()}
        with OpNames() as ops:
            compressor.reduce(names, list(grads.values()), 4, Communicator())
        assert "baddbmm" not in ops.names and "sub" in ops.names
        assert set(compressor.error) == {"attn.weight", "mlp.weight", "conv.weight"}
        for name, residual in compressor.error.items():
            expected = (corrected[name] - grads[name]).view_as(residual)
            torch.testing.assert_close(residual, expected, rtol=0, atol=0, msg=f"step {step} {name}")
        error = {n: e.clone() for n, e in compressor.error.items()}


class FlatBlock:
    def __init__(self, offset: int, count: int, rank: int, side: int):
        self.offset, self.count, self.rank, self.side = offset, count, rank, side

    def view(self, flat: torch.Tensor) -> torch.Tensor:
        return flat[self.offset : self.offset + self.count * self.rank * self.side].view(
            self.count, self.rank, self.side
        )


def test_q_resize_truncates_or_extends_identically_everywhere():
    a, b = LowRankCompressor(LowRankConfig(seed=3)), LowRankCompressor(LowRankConfig(seed=3))
    q8 = a.state.resized_q("w", 20, 8, torch.device("cpu"))
    torch.testing.assert_close(q8, b.state.resized_q("w", 20, 8, torch.device("cpu")), rtol=0, atol=0)
    a.q["w"] = q8
    torch.testing.assert_close(a.state.resized_q("w", 20, 4, torch.device("cpu")), q8[:, :4], rtol=0, atol=0)
    grown = a.state.resized_q("w", 20, 12, torch.device("cpu"))
    torch.testing.assert_close(grown[:, :8], q8, rtol=0, atol=0)
    b.q["w"] = q8.clone()
    torch.testing.assert_close(grown, b.state.resized_q("w", 20, 12, torch.device("cpu")), rtol=0, atol=0)
    assert not torch.equal(
        LowRankCompressor(LowRankConfig(seed=4)).state.resized_q("w", 20, 8, torch.device("cpu")), q8
    )


def test_half_precision_gradients_keep_fp32_state():
    compressor = LowRankCompressor(EDGCConfig(r_max=4))
    grads = {n: g.to(torch.bfloat16) for n, g in make_grads(1, torch.float32).items()}
    compressor.reduce(list(grads), list(grads.values()), 4, Communicator())
    assert all(q.dtype == torch.float32 for q in compressor.q.values())
    assert all(e.dtype == torch.float32 for e in compressor.error.values())
    assert all(g.dtype == torch.bfloat16 and torch.isfinite(g).all() for g in grads.values())


def test_non_finite_gradient_gives_nan_averages_keeps_q_and_clears_error_feedback():
    compressor = LowRankCompressor(EDGCConfig(r_max=4))
    grads = make_grads(2)
    compressor.reduce(list(grads), list(grads.values()), 4, Communicator())
    saved = compressor.state_dict()
    before = {k: {n: t.clone() for n, t in saved[k].items()} for k in ("q", "error")}
    grads = make_grads(3)
    grads["mlp.weight"][5, 5] = float("inf")
    poisoned = {n: g.clone() for n, g in grads.items()}
    compressor.state.begin_step()
    stats = compressor.reduce(list(grads), list(grads.values()), 4, Communicator())
    assert bool(stats.nonfinite)
    for name, rank in stats.ranks.items():
        if rank:  # compressed: NaN everywhere, so every optimizer (or GradScaler) skips the step
            assert torch.isnan(grads[name]).all(), name
        else:  # raw: the average of one rank is the gradient itself
            torch.testing.assert_close(grads[name], poisoned[name], rtol=0, atol=0)
    compressor.state.end_step(nonfinite=True)  # what EDGCState does at the end of such a step
    after = compressor.state_dict()
    for kind in before:
        assert after[kind].keys() == before[kind].keys()
        for name, tensor in before[kind].items():
            # Q is kept; the residual of the step's compressed matrices is cleared (see
            # LowRankCompressor.end_step for why)
            expected = torch.zeros_like(tensor) if kind == "error" else tensor
            assert torch.equal(after[kind][name], expected), (kind, name)


def test_matrix_that_turns_raw_after_a_rank_change_flushes_its_residual():
    compressor = LowRankCompressor(EDGCConfig(r_max=4, engine=LowRankConfig(min_compression_rate=1.0)))
    grads = make_grads(4)
    compressor.reduce(list(grads), list(grads.values()), 4, Communicator())
    residual = compressor.error["conv.weight"].clone()
    grads = make_grads(5)
    expected = grads["conv.weight"] + residual.view_as(grads["conv.weight"])
    stats = compressor.reduce(list(grads), list(grads.values()), 16, Communicator())  # (16+36)·16 ≥ 16·36 → raw
    assert stats.ranks["conv.weight"] == 0 and "conv.weight" not in compressor.error
    torch.testing.assert_close(grads["conv.weight"], expected, rtol=0, atol=1e-12)


def test_a_rank_fall_is_one_batched_eigendecomposition_not_one_per_matrix():
    from torch.utils._python_dispatch import TorchDispatchMode

    class CountEigh(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.calls = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.calls += func.overloadpacket.__name__.startswith("_linalg_eigh")
            return func(*args, **(kwargs or {}))

    compressor = LowRankCompressor(EDGCConfig(r_max=8, engine=LowRankConfig(min_compression_rate=1.0)))
    generator = torch.Generator().manual_seed(0)
    names = [f"w{k}" for k in range(6)]
    shapes = [(48, 32), (48, 32), (32, 48), (64, 24), (64, 24), (40, 40)]
    compressor.reduce(names, [torch.randn(s, generator=generator) for s in shapes], 8, Communicator())
    before = {name: q.clone() for name, q in compressor.q.items()}
    with CountEigh() as counted:
        compressor.change_rank(4, Communicator())
    assert counted.calls == 1
    for name in names:
        q, kept = before[name], compressor.q[name]
        assert kept.shape == (q.shape[0], 4)
        # The kept columns span the top directions of the old Q: the projection of Q onto them
        # keeps at least the energy of any 4 of its own columns.
        projection = kept @ torch.linalg.pinv(kept) @ q
        assert projection.norm() >= q[:, :4].norm() * 0.999
